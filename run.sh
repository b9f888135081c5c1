#!/usr/bin/env bash
# Main job: set up (skipped when the environment is current), then serve. No arguments: the embedded tiny
# Qwen3.5 model on 0.0.0.0:8000; `./run.sh CONFIG.yaml [--port N ...]` serves what the config names.
# QWEN35_VENV picks the virtual environment (default ./.venv).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${QWEN35_VENV:-.venv}
bash scripts/bootstrap.sh
exec "$VENV/bin/qwen35-serve" "$@"
