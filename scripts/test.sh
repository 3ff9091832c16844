#!/usr/bin/env bash
# Builds the environment if needed, then runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python -m pytest "$@"
