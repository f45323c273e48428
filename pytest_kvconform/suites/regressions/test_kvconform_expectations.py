"""The regression scenarios' own ``[expect]`` tables: numbers derived independently of the reference.

The goldens in ``__snapshots__/`` were written from the reference's plans, so for the reference
they detect a change, not a wrong number. Each file of ``scenarios/regressions/`` therefore carries
an ``[expect]`` table worked by hand from its bug report or PR, the upstream test and vLLM's
formulas (``docs/scenario-derivations.md``, "Regression scenarios"), never from the reference.

* ``test_expectations`` holds the selected backend's plan to those numbers.
* ``test_golden_agrees_with_its_expect`` holds every golden of a case that loads its regression
  file unchanged (``test_kvconform_reported.GOLDENS``, ``test_kvconform_history.GOLDENS``) to the
  same numbers, read from the JSON directly: a golden re-recorded from a wrong reference fails
  here even while the reference agrees with it. It checks the goldens of every release (each
  release's folder, ``regressions.golden_dirname``, against the values the file states for that
  release: ``[expect]`` and, for a release lacking a change, ``[expect.before.<change>]``),
  whatever release judges the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform import checks
from pytest_kvconform.reference.releases import RELEASES, rule_set
from pytest_kvconform.regressions import REGRESSION_SCENARIOS, golden_dirname
from pytest_kvconform.scenario import Scenario, expected_value_matches, load_scenario
from pytest_kvconform.suites.regressions.test_kvconform_history import GOLDENS as HISTORY_GOLDENS
from pytest_kvconform.suites.regressions.test_kvconform_reported import GOLDENS as REPORTED_GOLDENS

#: regressions compare with numbers derived independently of the reference (the reference's
#: self-check runs them)
pytestmark = pytest.mark.kvconform_independent

HERE = Path(__file__).parent
#: snapshot folder (the test module's name) -> its golden cases: id -> scenario loader
SUITES = {"test_kvconform_reported": REPORTED_GOLDENS, "test_kvconform_history": HISTORY_GOLDENS}
REGRESSION_FILES = sorted(REGRESSION_SCENARIOS.glob("*.toml"))


def _regression_file(scenario: Scenario) -> Path | None:
    """The regression file ``scenario`` is, unchanged; None for a packaged scenario or one whose
    runtime a case changed (``Scenario.with_runtime`` also drops the ``[expect]`` table)."""
    path = Path(scenario.source)
    if path.suffix != ".toml" or path.resolve().parent != REGRESSION_SCENARIOS.resolve():
        return None
    return path if scenario == load_scenario(path) else None


def unchanged_cases() -> list[tuple[str, str, Path]]:
    """``(snapshot folder, case id, regression file)`` of every golden case that loads its
    regression file unchanged."""
    cases = []
    for folder, goldens in SUITES.items():
        for name, load in goldens.items():
            path = _regression_file(load())
            if path is not None:
                cases.append((folder, name, path))
    return cases


UNCHANGED = unchanged_cases()


@pytest.mark.kvconform_rule("plan")
@pytest.mark.parametrize("path", REGRESSION_FILES, ids=[p.stem for p in REGRESSION_FILES])
def test_expectations(kv_backend: Any, kv_reference: Any, path: Path) -> None:
    """The backend's plan of the regression file against the file's ``[expect]`` table."""
    checks.expectations(kv_backend, kv_reference, load_scenario(path))


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize(
    ("folder", "name", "path"), UNCHANGED, ids=[f"{folder}-{name}" for folder, name, _ in UNCHANGED]
)
def test_golden_agrees_with_its_expect(folder: str, name: str, path: Path, release: str) -> None:
    """Every value the file states for ``release`` (``[expect]``, and ``[expect.before.<change>]``
    for a change the release lacks) equals the value of that release's golden (a float to the
    places it is written in)."""
    rules = rule_set(release)
    golden_path = HERE / golden_dirname(rules) / folder / f"test_plan_golden[{name}].json"
    assert golden_path.is_file(), f"{golden_path}: no golden for case {name!r}"
    golden = json.loads(golden_path.read_text(encoding="utf-8"))
    wrong = [
        f"{key}: [{table}] {want!r}, golden {golden.get(key, '<missing>')!r}"
        for key, (table, want) in load_scenario(path).expect_for(rules).items()
        if not expected_value_matches(want, golden.get(key))
    ]
    where = f"{golden_dirname(rules)}/{golden_path.name}"
    assert not wrong, f"vLLM {release}: {where} disagrees with {path.name}: " + "; ".join(wrong)


@pytest.mark.parametrize("folder", list(SUITES))
def test_every_release_has_every_golden(folder: str) -> None:
    """The golden folder of each release holds a golden of every case (and nothing else)."""
    cases = {f"test_plan_golden[{name}].json" for name in SUITES[folder]}
    for dirname in sorted({golden_dirname(rule_set(r)) for r in RELEASES}):
        held = {p.name for p in (HERE / dirname / folder).glob("*.json")}
        missing, extra = sorted(cases - held), sorted(held - cases)
        assert not missing and not extra, f"{dirname}/{folder}: missing {missing}, extra {extra}"


def test_every_regression_file_is_pinned() -> None:
    """Each regression file has an ``[expect]`` table and a golden case that loads it unchanged,
    so that no golden of a regression file escapes the comparison above."""
    assert REGRESSION_FILES, f"no regression scenarios in {REGRESSION_SCENARIOS}"
    no_expect = [p.name for p in REGRESSION_FILES if not load_scenario(p).expect]
    used = {path.resolve() for _, _, path in UNCHANGED}
    no_case = [p.name for p in REGRESSION_FILES if p.resolve() not in used]
    assert not no_expect, f"regression files without an [expect] table: {', '.join(no_expect)}"
    assert not no_case, f"regression files no golden case loads unchanged: {', '.join(no_case)}"
