#!/usr/bin/env bash
# Set up a development environment on a fresh Debian/Ubuntu machine:
#   system packages (openssh-server, tmux) and a virtualenv in .venv with
#   dflashctl, the CPU build of torch, transformers and the test tools.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v tmux >/dev/null 2>&1 || need_apt+=(tmux)
[ -x /usr/sbin/sshd ] || need_apt+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need_apt+=(openssh-client)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "==> installing Debian packages: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
stamp=.venv/.dflashctl-setup
want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat $stamp 2>/dev/null)" != "$want" ]; then
  echo "==> installing Python packages into .venv (torch CPU build)"
  .venv/bin/python -m pip install -q --upgrade pip
  # Pin the CPU build of torch: an unpinned torch pulls a multi-GB CUDA build.
  .venv/bin/python -m pip install -q "torch==2.13.0" "transformers>=4.51"
  .venv/bin/python -m pip install -q -e ".[test]"
  # The engines' own loaders the export tests run on CPU (tests/trainer/test_engine_loaders.py):
  # z-lab's dflash and vLLM speculators, without their dependencies (those pin transformers
  # and pull a CUDA torch, datasets and an OpenAI client; the model code needs none of them).
  .venv/bin/python -m pip install -q --no-deps "dflash==0.1.0" "speculators==0.9.0"
  echo "$want" > $stamp
fi
echo "==> ready: $(.venv/bin/dflashctl --help >/dev/null && echo dflashctl ok)"
