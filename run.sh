#!/usr/bin/env bash
# Main job: set up (first run only), then serve. No arguments: the embedded tiny Qwen3.5 model on
# 0.0.0.0:8000; `./run.sh CONFIG.yaml [--port N ...]` serves what the config names.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/bootstrap.sh
exec .venv/bin/qwen35-serve "$@"
