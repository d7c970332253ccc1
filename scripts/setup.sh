#!/usr/bin/env bash
# Create .venv and install dsl-lit into it. Idempotent: reruns are instant until pyproject.toml changes.
#
#   scripts/setup.sh                 # CPU build of torch (never pulls a multi-GB CUDA wheel)
#   TORCH=cuda scripts/setup.sh      # torch with CUDA (PyPI's Linux wheels), for GPU machines
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 TORCH=cuda scripts/setup.sh
#   EXTRAS=dev,gpu scripts/setup.sh  # add flash-attn on a CUDA machine
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH=${TORCH:-cpu}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
EXTRAS=${EXTRAS:-dev}
stamp="$VENV/.dsl-lit-installed"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) torch=$TORCH extras=$EXTRAS"

# Our modules' bytecode, written here once: where PYTHONDONTWRITEBYTECODE is set (as on these
# images), every process otherwise compiles our ~300 modules again: 0.6 s of a 2.3 s tiny recipe run,
# and the suite starts several hundred. Up to date, this takes 0.3 s.
compile_sources() { "$VENV/bin/python" -m compileall -q -j 0 src data_pipeline recipes tests benchmarks scripts >/dev/null; }

if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
  compile_sources
  exit 0
fi
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if [[ $TORCH == cuda ]]; then
    echo "[setup] installing torch with CUDA"
    if [[ -n ${TORCH_INDEX_URL:-} ]]; then "${pip[@]}" torch --index-url "$TORCH_INDEX_URL"; else "${pip[@]}" "torch>=2.6"; fi
  else
    echo "[setup] installing the CPU build of torch==$TORCH_VERSION"
    # A local wheel (pip's find-links) first; else PyTorch's CPU index. Plain PyPI is never asked
    # for torch here, because on Linux it serves the CUDA build. One retry: where that index is
    # unreachable but a local mirror has the wheels, pip's five default retries only waste time.
    "${pip[@]}" --no-index "torch==$TORCH_VERSION" 2>/dev/null \
      || "${pip[@]}" --retries 1 "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
echo "[setup] installing dsl-lit[$EXTRAS]"
"${pip[@]}" -e ".[$EXTRAS]"
compile_sources
echo "$want" > "$stamp"
