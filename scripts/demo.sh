#!/usr/bin/env bash
# The main job: builds the environment if needed, then serves a tiny local
# model under opentelemetry-instrument, loads it and prints what the KV cache did.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python -m demo "$@"
