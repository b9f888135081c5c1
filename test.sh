#!/usr/bin/env bash
# Test job: set up (skipped when the environment is current), lint, then run the whole test suite (slow cases
# included) and list the 15 slowest tests. Arguments go to pytest. QWEN35_VENV picks the virtual environment.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${QWEN35_VENV:-.venv}
bash scripts/bootstrap.sh
"$VENV/bin/ruff" check .
exec "$VENV/bin/python" -m pytest -q --durations=15 "$@"
