#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Triton and a NumPy its interpreter runs with (it fails on NumPy 2.4), apart from
# .venv: tests run the loss kernel through TRITON_INTERPRET=1 on the CPU with them.
interp=.venv/triton-interp
if [ ! -f $interp/.ok ]; then
  echo "==> installing triton (interpreter) into $interp"
  rm -rf $interp
  .venv/bin/python -m pip install -q --no-deps --target $interp "triton==3.6.0" "numpy>=2,<2.4"
  touch $interp/.ok
fi
echo "==> import contracts (pyproject.toml, [tool.importlinter])"
.venv/bin/lint-imports --no-cache | sed -n '/^Contracts/,$p'
exec .venv/bin/python -m pytest -q -ra "$@"
