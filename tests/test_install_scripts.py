"""scripts/install-vllm.sh: torch from a local wheel when find-links has one, else PyTorch's CPU index."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install-vllm.sh"
VENV = str(Path(sys.executable).parents[1])


def _source(links: Path) -> str:
    env = {**os.environ, "PIP_FIND_LINKS": str(links), "PIP_CONFIG_FILE": os.devnull}
    out = subprocess.run(["bash", str(SCRIPT), "--print-torch-source", VENV], env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return out.stdout.strip()


def test_a_local_wheel_is_used_when_find_links_has_one(tmp_path: Path) -> None:
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    assert _source(tmp_path) == f"local wheel {wheel}"


def test_pytorchs_cpu_index_otherwise(tmp_path: Path) -> None:
    (tmp_path / "torch-2.12.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")  # not pinned
    assert _source(tmp_path) == "index https://download.pytorch.org/whl/cpu"


@pytest.mark.skipif(sys.platform == "win32", reason="bash scripts")
def test_install_sh_skips_vllm_on_macos() -> None:
    text = (SCRIPT.parent / "install.sh").read_text()
    darwin = text.split('if [[ "$(uname -s)" == Darwin ]]; then', 1)[1].split("else", 1)[0]
    assert "'.[metal,dev]'" in darwin and "install-vllm.sh" not in darwin


@pytest.mark.skipif(sys.platform == "win32", reason="bash scripts")
def test_install_sh_builds_the_tpu_venv_behind_its_switch() -> None:
    """tpu-inference goes into .venv-tpu on Linux only, and KVCONFORM_TPU=0 skips it."""
    text = (SCRIPT.parent / "install.sh").read_text()
    darwin, linux = text.split('if [[ "$(uname -s)" == Darwin ]]; then', 1)[1].split("else", 1)
    assert "install-tpu-inference.sh" not in darwin
    assert '"${KVCONFORM_TPU:-1}" != 0 ]]; then\n        bash scripts/install-tpu-inference.sh' in linux
    assert "VENV=${1:-.venv-tpu}" in (SCRIPT.parent / "install-tpu-inference.sh").read_text()


@pytest.mark.skipif(sys.platform == "win32", reason="bash scripts")
def test_every_overlay_run_has_its_overlay_installed() -> None:
    """Each scripts/test.sh run on a ``.vllm-overlay/X`` (0.33, and 0.23, the oldest release) is
    installed by scripts/install-vllm-releases.sh and asserts release X in its header."""
    import re

    test_sh = (SCRIPT.parent / "test.sh").read_text()
    runs = re.findall(r"PYTHONPATH=\.vllm-overlay/(\S+) .*\\\n\s+run_vllm (\S+) ", test_sh)
    installed = re.findall(
        r"^overlay \.vllm-overlay/(\S+) ", (SCRIPT.parent / "install-vllm-releases.sh").read_text(), re.M
    )
    assert {"0.23", "0.33"} <= {release for release, _ in runs}
    assert all(release == asserted for release, asserted in runs)
    assert sorted(installed) == sorted(release for release, _ in runs)
