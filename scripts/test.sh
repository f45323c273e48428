#!/usr/bin/env bash
# Run every test: the plugin's own tests and the conformance suites against the reference,
# then the conformance suites against the bundled Metal runtime and against the installed vLLM.
# Extra arguments go to the first run. Exits non-zero if any run fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$PWD/.vllm-cache} HF_HUB_OFFLINE=1
status=0
run() { echo "+ pytest $*"; "$PY" -m pytest -p no:cacheprovider --benchmark-disable "$@" || status=1; }
run "$@"
run suites --kvconform-backend=metal
run suites --kvconform-backend=vllm --kvconform-max-examples=10
exit $status
