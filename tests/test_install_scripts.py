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
    installed by scripts/install-vllm-releases.sh and asserts release X in its header; each overlay
    installed is run, or layered under a plugin's venv."""
    import re

    test_sh = (SCRIPT.parent / "test.sh").read_text()
    runs = re.findall(r"PYTHONPATH=\.vllm-overlay/(\S+) .*\\\n\s+run_vllm (\S+) ", test_sh)
    installed = re.findall(
        r"^overlay \.vllm-overlay/(\S+) ", (SCRIPT.parent / "install-vllm-releases.sh").read_text(), re.M
    )
    # the plugin venvs layer an overlay of their own (vllm-rbln 0.12 pins vLLM 0.30)
    layered = {
        m for script in SCRIPT.parent.glob("install-*.sh")
        for m in re.findall(r"^OVERLAY=\.vllm-overlay/(\S+)", script.read_text(), re.M)
    }  # fmt: skip
    assert {"0.23", "0.33"} <= {release for release, _ in runs}
    assert layered == {"0.23", "0.30"}
    assert all(release == asserted for release, asserted in runs)
    assert sorted(installed) == sorted({release for release, _ in runs} | layered)


TPU_SCRIPT = SCRIPT.parent / "install-tpu-inference.sh"
ROOT = SCRIPT.parents[1]


@pytest.mark.skipif(sys.platform != "linux", reason="Linux install script")
def test_the_tpu_venv_needs_its_base_venv_first(tmp_path: Path) -> None:
    """.venv-tpu layers over .venv: without it, one line says what to run, and nothing is built."""
    out = subprocess.run(["bash", str(TPU_SCRIPT), str(tmp_path / "tpu"), str(tmp_path / "missing")],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"install-tpu-inference: {tmp_path / 'tpu'} layers over {tmp_path / 'missing'}, which is missing:"
        " run bash scripts/install.sh first"
    ]
    assert not (tmp_path / "tpu").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="Linux install script")
def test_the_tpu_venv_is_never_its_base_venv(tmp_path: Path) -> None:
    out = subprocess.run(["bash", str(TPU_SCRIPT), str(tmp_path / "v"), f"{tmp_path}/./v"],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2 and "needs a venv of its own" in out.stderr


_PROBE = """
import importlib.util, json
from importlib.metadata import entry_points
print(json.dumps({
    "plugins": sorted(e.value for e in entry_points(group="vllm.general_plugins")),
    "origins": {m: (s := importlib.util.find_spec(m)) and s.origin
                for m in ("vllm", "torch", "pytest_kvconform", "tpu_inference")},
}))
"""


@pytest.mark.skipif(
    not (ROOT / ".venv-tpu" / "bin" / "python").exists() or not (ROOT / ".venv" / "bin" / "python").exists(),
    reason="no .venv-tpu (bash scripts/install-tpu-inference.sh)",
)
def test_the_tpu_venv_sees_dot_venv_and_dot_venv_never_sees_tpu_inference() -> None:
    """.venv-tpu takes vLLM, torch and the plugin from .venv (no copies of its own); tpu-inference's
    vllm.general_plugins entry point is visible from .venv-tpu only."""
    import json

    def probe(venv: str) -> dict:
        out = subprocess.run([str(ROOT / venv / "bin" / "python"), "-c", _PROBE], cwd=ROOT.parent,
                             capture_output=True, text=True, check=True)  # fmt: skip
        return json.loads(out.stdout)

    base, tpu = probe(".venv"), probe(".venv-tpu")
    assert not any(p.startswith("tpu_inference") for p in base["plugins"])
    assert base["origins"]["tpu_inference"] is None
    assert "tpu_inference.layers.vllm:register_layers" in tpu["plugins"]
    assert tpu["origins"]["tpu_inference"].startswith(str(ROOT / ".venv-tpu") + "/")
    for module in ("vllm", "torch", "pytest_kvconform"):
        assert tpu["origins"][module] == base["origins"][module], module
    assert tpu["origins"]["vllm"].startswith(str(ROOT / ".venv") + "/")
