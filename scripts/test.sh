#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite: the import contracts, then every
# lane (tests/conftest.py) on every core through pytest-xdist. Arguments go to pytest:
#   bash scripts/test.sh                        everything (what CI runs)
#   bash scripts/test.sh tests/unit             one lane (unit, integration, trainer, e2e)
#   bash scripts/test.sh -m "not slow"          everything but the slow tests
#   bash scripts/test.sh tests/unit/test_config.py -k duration
# DFLASHCTL_TEST_WORKERS sets the number of workers (default: two per CPU: most tests
# wait on processes, sshd hosts and timers, and two per CPU keep the CPUs busy).
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

workers=${DFLASHCTL_TEST_WORKERS:-$((2 * $(nproc 2>/dev/null || echo 1)))}
[ "$workers" -ge 1 ] 2>/dev/null || workers=2
# Whole files to a worker (module fixtures: an sshd harness, a trained checkpoint);
# the slow lanes first (tests/conftest.py orders them).
xdist=(-n "$workers" --dist loadfile)
if [ $# -eq 0 ]; then
  # Every lane, named: a run that finds no test is a broken checkout, not a pass.
  echo "==> tests: every lane, $workers workers"
  set +e
  .venv/bin/python -m pytest -q -ra --durations=20 "${xdist[@]}" tests/unit tests/integration tests/trainer tests/e2e
  rc=$?
  set -e
  if [ $rc -eq 5 ]; then
    echo "error: no tests were collected" >&2
    exit 1
  fi
  exit $rc
fi
echo "==> tests: $*"
exec .venv/bin/python -m pytest -q -ra "${xdist[@]}" "$@"
