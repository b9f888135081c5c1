#!/usr/bin/env bash
# Main job: set up (first run only) and print the capability probe's report.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/bootstrap.sh
exec .venv/bin/qwen35-probe "$@"
