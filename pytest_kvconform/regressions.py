"""Shared pieces of the regression suites (``pytest_kvconform/suites/regressions/``).

A regression is a scenario (``scenarios/regressions/*.toml`` or a packaged one), a JSON golden
of the reference's KVPlan, and tests that call the selected backend.

A golden is the reference's plan under the judged release's rules (``--kvconform-vllm``). The
releases whose plans of these scenarios differ keep their own set: a release lacking a change of
:data:`GOLDEN_CHANGES` reads (and ``--snapshot-update`` writes) its goldens in
``__snapshots_before_<change>__/`` beside ``__snapshots__/`` (the newest rules);
:func:`golden_dirname` picks the folder. Every run also holds the reference of each other folder's
releases to that folder's goldens (:class:`Goldens`), so no set goes unchecked (or unused).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .conformance import Departure, assert_same_outcome, call_rule, numbers_apply, outcome, plan_view
from .reference.releases import RELEASES, RuleSet, rule_set
from .reference.rules import reference_rules
from .scenario import REJECTS, Scenario, load_scenario

REGRESSION_SCENARIOS = Path(__file__).parent / "scenarios" / "regressions"

#: The changes of ``reference.releases.CHANGES`` that alter a golden: ``attention_page_padding``
#: (vLLM 0.24: 0.23 rejects the TurboQuant probe under pad-to-max), ``mamba_page_padding`` (0.26:
#: 0.23 ... 0.25 reject the Granite dense draft), ``mla_hybrid_block_floor`` (0.27: the MLA hybrid
#: probes' blocks) and ``null_block_reserved`` (0.29) changes ``available_bytes`` of every plan, and
#: the admission and the estimate of those whose pool is one block short. The other changes leave
#: every golden as it is (the suites pass on each release with one set per group).
GOLDEN_CHANGES = (
    "attention_page_padding",
    "mamba_page_padding",
    "mla_hybrid_block_floor",
    "null_block_reserved",
)


def golden_dirname(release: Any) -> str:
    """The snapshot folder of ``release`` (a ``RuleSet``): ``__snapshots__`` when it has every
    change of :data:`GOLDEN_CHANGES`, else ``__snapshots_before_<change>[_<change>...]__`` named
    by the ones it lacks (vLLM 0.27 and 0.28: ``__snapshots_before_null_block_reserved__``; 0.26:
    ``__snapshots_before_mla_hybrid_block_floor_null_block_reserved__``, ...)."""
    lacking = [name for name in GOLDEN_CHANGES if not release.has(name)]
    return f"__snapshots_before_{'_'.join(lacking)}__" if lacking else "__snapshots__"


def golden_folders() -> dict[str, RuleSet]:
    """Each golden folder, with the newest release whose goldens it holds."""
    return {golden_dirname(rule_set(r)): rule_set(r) for r in RELEASES}


@dataclass
class Goldens:
    """The goldens of one test: ``judged``, the snapshot of the judged release's folder, and
    ``others``, ``(release, snapshot)`` of every other folder (held to that release's reference)."""

    judged: Any
    others: list[tuple[RuleSet, Any]] = field(default_factory=list)


def regression(stem: str, **runtime: Any) -> Callable[[], Scenario]:
    """A loader for ``scenarios/regressions/<stem>.toml`` (or a packaged name), runtime changed."""

    def load() -> Scenario:
        path = REGRESSION_SCENARIOS / f"{stem}.toml"
        s = load_scenario(path if path.is_file() else stem)
        return s.with_runtime(**runtime) if runtime else s

    return load


def backend_plan(backend: Any, scenario: Scenario) -> Any:
    """The backend's plan of a regression scenario, whose numbers apply to it
    (:func:`~.conformance.numbers_apply`)."""
    numbers_apply(backend, scenario)
    return call_rule(backend, "plan", scenario=scenario)


def plan_record(rules: Any, scenario: Scenario) -> dict[str, Any]:
    """What a golden holds of ``rules``' plan: its fields, or ``{"rejects": <kind>}`` when the
    rules reject the scenario (an older release's vLLM refusing it; ``rejections.KINDS``)."""
    answer = outcome(rules, "plan", scenario=scenario)
    return dict(answer[1].to_dict()) if answer[0] == "ok" else {REJECTS: answer[1]}


def one_sequence_bytes(backend: Any, reference: Any, scenario: Scenario) -> int:
    """The backend's one-sequence estimate at the block the reference (the selected release's
    rules) chooses for ``scenario``."""
    choice = reference.choose_block_size(scenario=scenario)
    return call_rule(
        backend, "one_sequence_bytes", choice.block_size, choice.state_page_padded, scenario=scenario
    )


def assert_plan_matches_golden(backend: Any, reference: Any, golden: Any, scenario: Scenario) -> None:
    """The backend's full KVPlan equals the reference's golden (same file for every backend).

    ``golden`` is a snapshot, or :class:`Goldens`: then the judged release's golden is the one
    compared, and first the reference of every other folder's release is held to that folder's.
    When the backend skips or raises, the golden is still checked against the reference, so a
    skip never leaves it unused (which would fail the run) and a changed reference still shows.
    """
    goldens = golden if isinstance(golden, Goldens) else Goldens(golden)
    for release, other in goldens.others:
        _reference_matches(plan_record(reference_rules(release), scenario), other, scenario, release.release)
    expected = plan_record(reference, scenario)
    _reference_matches(expected, goldens.judged, scenario, reference.release.release)
    numbers_apply(backend, scenario, reference)
    answer = outcome(backend, "plan", scenario=scenario)
    want = ("rejects", expected[REJECTS]) if REJECTS in expected else ("ok", expected)
    assert_same_outcome("plan", backend, scenario, "plan", want, answer, plan_view)


def _reference_matches(record: dict[str, Any], golden: Any, scenario: Scenario, release: str) -> None:
    """The reference's plan equals its golden (syrupy records the comparison: a golden compared
    is a golden used); a reference that moved is a failure of the reference, not of the backend."""
    if not (golden == record):  # noqa: SIM201 (syrupy's snapshot compares by ==)
        message = (
            f"the reference's plan of {scenario.name!r} under vLLM {release} rules no longer matches its "
            "golden (syrupy's report shows the difference; --snapshot-update rewrites it from the reference)"
        )
        raise Departure(message, "plan", "golden", "the golden", "the reference's plan", pytrace=False)
