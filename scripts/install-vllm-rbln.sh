#!/usr/bin/env bash
# vllm-rbln 0.12.0 (Rebellions' vLLM plugin, pure Python) for the `vllm-rbln` backend
# (pytest_kvconform/backends/vllm/profiles/vllm_rbln.py), in a venv of its own layered over .venv:
#
#   scripts/install-vllm-rbln.sh [VENV [BASE]]     # VENV defaults to .venv-rbln, BASE to .venv
#
#   .venv-rbln/  vllm-rbln==0.12.0 --no-deps, layered (scripts/lib/layered-venv.sh) over
#                .vllm-overlay/0.30 (vLLM 0.30.0's Python sources over 0.32's kernels,
#                scripts/install-vllm-releases.sh: vllm-rbln 0.12.0 pins vllm==0.30.0+cpu) and
#                then BASE (torch, the plugin). Its dependencies that size nothing are not
#                installed: rebel-compiler and torch-rbln (Rebellions' compiler and device runtime,
#                not on PyPI; the profile stubs the modules), optimum-rbln (the other model path),
#                datasets, torchvision/torchaudio/torchcodec (removed from .venv, as there).
#
# Why a venv of its own: vllm-rbln registers vLLM entry points (vllm.platform_plugins `rbln`,
# vllm.general_plugins) that vLLM loads in every process of the venv, .venv's included.
# Needs BASE and the overlay first (bash scripts/install.sh calls this script last). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-rbln}
BASE=${2:-.venv}
VLLM_RBLN_VERSION=${VLLM_RBLN_VERSION:-0.12.0}
OVERLAY=.vllm-overlay/0.30      # the vLLM vllm-rbln $VLLM_RBLN_VERSION pins
start=$SECONDS
source scripts/lib/layered-venv.sh
layered_venv "$VENV" "$BASE" "$OVERLAY"
"${PIP[@]}" install --quiet --no-deps "vllm-rbln==$VLLM_RBLN_VERSION"
echo "install-vllm-rbln: done in $((SECONDS - start)) s"
# vllm-rbln's vLLM plugins are seen from VENV, never from BASE
"$BASE/bin/python" -c 'from importlib.metadata import entry_points
assert not [e for e in entry_points(group="vllm.platform_plugins") if e.value.startswith("vllm_rbln")], "vllm-rbln visible from the base venv"'
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c 'from importlib.metadata import version; import vllm
print("vllm-rbln", version("vllm-rbln"), "on vLLM", vllm.__version__, "sources from", vllm.__file__)'
