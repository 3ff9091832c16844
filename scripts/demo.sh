#!/usr/bin/env bash
# The main job: builds the environment if needed, then serves a tiny local
# model under opentelemetry-instrument, loads it and prints what the KV cache did.
# `scripts/demo.sh --help` lists its options. It runs where it is called from:
# --out is relative to that directory, as are the commands it prints.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
demo=(env "PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}" "$repo/.venv/bin/python" -m demo)
# Help needs no rebuild when an environment exists (a stale one rebuilds in minutes).
for arg in "$@"; do
  if [[ ( $arg == -h || $arg == --help ) && -x "$repo/.venv/bin/python" ]]; then
    exec "${demo[@]}" "$@"
  fi
done
"$repo/scripts/bootstrap.sh"
exec "${demo[@]}" "$@"
