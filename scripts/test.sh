#!/usr/bin/env bash
# Run every test: the plugin's own tests and the conformance suites against the reference,
# then the conformance suites against the bundled Metal runtime, against the installed vLLM on
# vLLM core's neutral platform, and against vLLM's CPU platform (its CPU probes answering as an
# AVX-512 BF16 host, its departures kept as data in pytest_kvconform/xfails/).
# Extra arguments go to the first run. Exits non-zero if any run fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$PWD/.vllm-cache} HF_HUB_OFFLINE=1
status=0
run() { echo "+ pytest $*"; "$PY" -m pytest -p no:cacheprovider --benchmark-disable "$@" || status=1; }
run "$@"
run pytest_kvconform/suites --kvconform-backend=metal
run pytest_kvconform/suites --kvconform-backend=vllm --kvconform-max-examples=10
run pytest_kvconform/suites --ignore=pytest_kvconform/suites/test_kvconform_properties.py --kvconform-backend=vllm \
    --kvconform-backend-option=platform=vllm.platforms.cpu:CpuPlatform \
    --kvconform-backend-option=cpu_features=avx512_bf16 \
    --kvconform-xfails=pytest_kvconform/xfails/vllm-cpu-platform.toml
exit $status
