"""The pytest11 entry point is imported by every pytest run where the package is installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = (
    "mlx",
    "torch",
    "vllm",
    "numpy",
    "hypothesis",
    "pytest_kvconform.reference",
    "pytest_kvconform.backends",
)


def test_plugin_import_pulls_in_nothing_heavy() -> None:
    code = (
        "import sys, pytest; before = set(sys.modules); import pytest_kvconform.plugin; "
        "print(' '.join(sorted(set(sys.modules) - before)))"
    )
    added = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert [m for m in added if m.split(".")[0] in HEAVY or m.startswith(HEAVY)] == []
    assert set(added) <= {"pytest_kvconform", "pytest_kvconform.plugin", "pytest_kvconform.session"}


def test_metal_runtime_fixture(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        "def test_x(metal_runtime):\n    assert metal_runtime.pick_kernel_block_size(160) == 32\n"
    )
    pytester.runpytest().assert_outcomes(passed=1)
