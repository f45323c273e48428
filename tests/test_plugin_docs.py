"""docs/plugins.md shows the toy plugin verbatim, and the suites run against it by entry-point name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "tests" / "toy_plugin"


def _blocks(language: str) -> list[str]:
    text = (ROOT / "docs" / "plugins.md").read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def test_the_docs_code_is_the_toy_plugin_file() -> None:
    code = _blocks("python")[0]
    assert code == (TOY / "kvtoy" / "platform.py").read_text()
    assert len(code.splitlines()) + len(_blocks("toml")[0].splitlines()) < 70  # a page, not a project


def test_the_docs_profile_is_the_vllm_rbln_file_and_a_page_long() -> None:
    """docs/plugins.md shows a whole plugin profile, under 100 lines."""
    code = _blocks("python")[-1]
    assert code == (ROOT / "pytest_kvconform" / "backends" / "vllm" / "profiles" / "vllm_rbln.py").read_text()
    assert len(code.splitlines()) < 100


def test_the_docs_entry_point_is_the_toy_plugins() -> None:
    group, line = _blocks("toml")[0].splitlines()
    assert group == '[project.entry-points."pytest_kvconform.backends"]'
    name, target = (part.strip().strip('"') for part in line.split("="))
    entry_points = (TOY / "kvtoy-0.1.0.dist-info" / "entry_points.txt").read_text().splitlines()
    assert "[pytest_kvconform.backends]" in entry_points
    assert f"{name} = {target}" in entry_points


def test_suites_run_against_the_toy_plugin_by_entry_point_name(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The toy distribution on PYTHONPATH, the packaged suites run by --pyargs, the backend by name."""
    monkeypatch.setenv("PYTHONPATH", f"{TOY}:{ROOT}")
    result = pytester.runpytest_subprocess(
        "--pyargs", "pytest_kvconform.suites.test_kvconform_allocation", "--kvconform-backend=toy-no-guard",
        "-k", "larger_than and granite-4.0-h-tiny and not hma-disabled and not mamba-all",
        "-p", "no:cacheprovider",
    )  # fmt: skip
    result.assert_outcomes(failed=2)  # granite-4.0-h-tiny and -tp4: the missing guard fails both
    result.stdout.fnmatch_lines(
        [
            "kvconform: backend=toy-no-guard *selected by option*",
            "*check_kv_cache_config(4 of 3 blocks): reference 'rejects: oversized_config', backend 'accepts'",
        ]
    )
