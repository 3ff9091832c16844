#!/usr/bin/env bash
# The main job: builds the environment if needed, then serves a tiny local
# model under opentelemetry-instrument, loads it and prints what the KV cache did.
# `scripts/demo.sh --help` lists its options.
set -euo pipefail
cd "$(dirname "$0")/.."
# Help needs no rebuild when an environment exists (a stale one rebuilds in minutes).
for arg in "$@"; do
  if [[ ( $arg == -h || $arg == --help ) && -x .venv/bin/python ]]; then
    exec .venv/bin/python -m demo "$@"
  fi
done
scripts/bootstrap.sh
exec .venv/bin/python -m demo "$@"
