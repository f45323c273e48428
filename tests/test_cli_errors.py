"""Every error path of the ``kvconform`` command: one line on stderr, exit status 2, no traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pytest_kvconform.cli import main

BROKEN = """
from pytest_kvconform.backends.base import ReferenceBackend
from pytest_kvconform.gaps import OfflineGap

class Declines(ReferenceBackend):
    name = "declines"
    def layer_specs(self, scenario):
        raise OfflineGap("cpu_build", "no code path for this model on this host")
    def plan(self, scenario):
        return self.layer_specs(scenario)

class Crashes(ReferenceBackend):
    name = "crashes"
    def plan(self, scenario):
        raise RuntimeError("kernel library failed to load")

class NeedsGpu(ReferenceBackend):
    name = "needs-gpu"
    def __init__(self):
        raise OSError("no device")
"""


@pytest.fixture
def broken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "clibroken.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "no-such-scenario"], "kvconform: bad scenario: no-such-scenario: name: not a file"),
        (["plan", "missing.toml"], "kvconform: bad scenario: missing.toml: path: no such file"),
        (["plan", "granite-4.0-h-tiny", "--set", "colour=red"], "kvconform: bad scenario: --set: colour"),
        (["plan", "granite-4.0-h-tiny", "--set", "block_size=0"],
         "kvconform: bad scenario: granite-4.0-h-tiny.toml: runtime.block_size: expected an integer >= 1"),
        (["plan", "granite-4.0-h-tiny", "--backend", "nope"], "kvconform: unknown kvconform backend 'nope'"),
        (["plan", "granite-4.0-h-tiny", "--backend-option", "x"], "kvconform: backend option 'x': expected"),
        (["plan", "granite-4.0-h-tiny", "--backend-option", "a=1"], "kvconform: backend 'reference' takes"),
        (["plan", "granite-4.0-h-tiny", "--backend", "clibroken:Declines"],
         "kvconform: backend 'declines' cannot run 'ibm-granite/granite-4.0-h-tiny' here: cpu_build: "),
        (["plan", "granite-4.0-h-tiny", "--backend", "clibroken:Crashes"],
         "kvconform: backend 'crashes' raised on 'ibm-granite/granite-4.0-h-tiny': RuntimeError: kernel"),
        (["plan", "granite-4.0-h-tiny", "--backend", "clibroken:NeedsGpu"],
         "kvconform: backend 'clibroken:NeedsGpu' failed to start: OSError: no device"),
    ],
)  # fmt: skip
def test_error_is_one_line_and_exit_2(
    broken: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code = main(argv)
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith(message), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_the_plan_of_a_backend_that_cannot_answer_is_not_a_traceback(broken: Path) -> None:
    import subprocess

    run = subprocess.run([sys.executable, "-m", "pytest_kvconform.cli", "plan", "granite-4.0-h-tiny",
                          "--backend", "clibroken:Crashes"], capture_output=True, text=True,
                         env={"PYTHONPATH": str(broken), "PATH": ""})  # fmt: skip
    assert run.returncode == 2 and run.stderr.count("\n") == 1


def test_a_reader_that_stops_early_is_no_error() -> None:
    """``kvconform plan ... | head -0``: the reader is gone before the plan is printed; no
    BrokenPipeError traceback, exit status 0."""
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest_kvconform.cli", "plan", "granite-4.0-h-tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command (about a second to start) writes anything
    stderr = proc.stderr.read().decode()
    assert proc.wait(60) == 0, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr
