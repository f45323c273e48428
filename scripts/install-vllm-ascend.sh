#!/usr/bin/env bash
# vllm-ascend 0.23.0.post1 (Huawei Ascend NPU's vLLM plugin) for the `vllm-ascend` backend
# (pytest_kvconform/backends/vllm/profiles/vllm_ascend.py), in a venv of its own layered over .venv:
#
#   scripts/install-vllm-ascend.sh [VENV [BASE]]     # VENV defaults to .venv-ascend, BASE to .venv
#
#   .venv-ascend/  the Python package of the vllm-ascend 0.23.0.post1 sdist (vllm_ascend/ and its
#                  egg-info, whose entry points name vLLM's `ascend` platform plugin), and scipy
#                  (vllm_ascend/attention/sfa_v1.py imports it), layered (scripts/lib/layered-venv.sh)
#                  over .vllm-overlay/0.23 (vLLM 0.23.0's Python sources over 0.32's kernels, the
#                  release vllm-ascend 0.23 is built for: its Dockerfile's VLLM_TAG) and then BASE.
#
# The sdist is not built: its setup.py compiles Ascend C++ kernels with CANN (SOC_VERSION, cmake),
# which sizing never runs; the package is taken from the sdist as is (sha256-pinned download from
# the package index). Not installed: torch-npu and CANN (the profile stubs torch_npu and acl).
# Needs BASE and the overlay first (bash scripts/install.sh calls this script last). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-ascend}
BASE=${2:-.venv}
VERSION=0.23.0.post1
SDIST_URL=${VLLM_ASCEND_SDIST_URL:-https://files.pythonhosted.org/packages/ab/7a/32a1b1f13467fb7372588206fa1ffb735f28dcd8504d562f5c7ccdbd90d0/vllm_ascend-$VERSION.tar.gz}
SDIST_SHA256=a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1
OVERLAY=.vllm-overlay/0.23      # the vLLM vllm-ascend $VERSION is built for
start=$SECONDS
source scripts/lib/layered-venv.sh
layered_venv "$VENV" "$BASE" "$OVERLAY"
"${PIP[@]}" install --quiet scipy==1.17.1
if [[ "$(cat "$SITE/vllm_ascend/.sdist" 2>/dev/null)" != "$SDIST_SHA256" ]]; then
    tmp=$(mktemp -d)
    curl --fail --silent --show-error --location --retry 3 -o "$tmp/sdist.tar.gz" "$SDIST_URL"
    echo "$SDIST_SHA256  $tmp/sdist.tar.gz" | sha256sum --check --quiet
    tar -xzf "$tmp/sdist.tar.gz" -C "$tmp" "vllm_ascend-$VERSION/vllm_ascend" "vllm_ascend-$VERSION/vllm_ascend.egg-info"
    rm -rf "$SITE/vllm_ascend" "$SITE/vllm_ascend.egg-info"
    mv "$tmp/vllm_ascend-$VERSION/vllm_ascend" "$tmp/vllm_ascend-$VERSION/vllm_ascend.egg-info" "$SITE/"
    echo "$SDIST_SHA256" >"$SITE/vllm_ascend/.sdist"
    rm -rf "$tmp"
fi
echo "install-vllm-ascend: done in $((SECONDS - start)) s"
# vllm-ascend's vLLM plugins are seen from VENV, never from BASE
"$BASE/bin/python" -c 'from importlib.metadata import entry_points
assert not [e for e in entry_points(group="vllm.platform_plugins") if e.value.startswith("vllm_ascend")], "vllm-ascend visible from the base venv"'
"$VENV/bin/python" -c 'from importlib.metadata import entry_points, version
assert [e for e in entry_points(group="vllm.platform_plugins") if e.value.startswith("vllm_ascend")]
print("vllm-ascend", version("vllm-ascend"))'
