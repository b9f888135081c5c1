#!/usr/bin/env bash
# Test job: set up (first run only), lint, then run the whole test suite (slow cases included).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/bootstrap.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
