#!/usr/bin/env bash
# Install everything the tests need into a virtual environment (default: .venv):
# the plugin (editable) with MLX on CPU, the dev tools, and vLLM for CPU (scripts/install-vllm.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet -e '.[metal-cpu,dev]'
bash scripts/install-vllm.sh "$VENV"
"$VENV/bin/python" -c "import pytest_kvconform, mlx.core; print('pytest-kvconform', pytest_kvconform.__version__, 'installed in $VENV')"
