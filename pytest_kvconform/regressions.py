"""Shared pieces of the regression suites (``pytest_kvconform/suites/regressions/``).

A regression is a scenario (``scenarios/regressions/*.toml`` or a packaged one), a JSON golden
of the reference's KVPlan, and tests that call the selected backend.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .conformance import call_rule, departure
from .reference.rules import reference_rules
from .scenario import Scenario, load_scenario

REGRESSION_SCENARIOS = Path(__file__).parent / "scenarios" / "regressions"


def regression(stem: str, **runtime: Any) -> Callable[[], Scenario]:
    """A loader for ``scenarios/regressions/<stem>.toml`` (or a packaged name), runtime changed."""

    def load() -> Scenario:
        path = REGRESSION_SCENARIOS / f"{stem}.toml"
        s = load_scenario(path if path.is_file() else stem)
        return s.with_runtime(**runtime) if runtime else s

    return load


def backend_plan(backend: Any, scenario: Scenario) -> Any:
    return call_rule(backend, "plan", scenario=scenario)


def one_sequence_bytes(backend: Any, scenario: Scenario) -> int:
    """The backend's one-sequence estimate at the reference's block choice for ``scenario``."""
    choice = reference_rules().choose_block_size(scenario=scenario)
    return call_rule(
        backend, "one_sequence_bytes", choice.block_size, choice.state_page_padded, scenario=scenario
    )


def assert_plan_matches_golden(backend: Any, reference: Any, golden: Any, scenario: Scenario) -> None:
    """The backend's full KVPlan equals the reference's golden (same file for every backend).

    When the backend skips or raises, the golden is still checked against the reference, so a
    skip never leaves it unused (which would fail the run) and a changed reference still shows.
    """
    expected = reference.plan(scenario).to_dict()
    try:
        got = backend_plan(backend, scenario).to_dict()
    except (pytest.skip.Exception, pytest.fail.Exception):
        assert expected == golden, f"the reference's plan of {scenario.name!r} no longer matches its golden"
        raise
    assert got == golden, (
        departure("plan", backend, scenario, expected, got) or "the reference departs from its golden"
    )
