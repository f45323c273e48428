"""Differential property tests: backend vs reference over hypothesis-generated scenarios.

A failure prints the shrunk scenario as ``kv-scenario/1`` TOML, ready to paste into a file.
``--kvconform-max-examples`` sets the number of examples. Generated inputs are seeded per test
(hypothesis's ``derandomize``; ``--hypothesis-seed`` picks another seed), so two runs, or two
hosts, compare the same inputs. Every answer is recorded with who gave it, as in every suite.

Each generated input is compared; one the backend declines (its declared ``declines``, or an
offline gap) is counted and rejected, one where it departs exactly as a known departure of that
kind of input says (``KnownDeparture(when=...)``) is counted; any other departure fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, note, reject, settings

from pytest_kvconform import provenance
from pytest_kvconform.conformance import (
    Declined,
    Departure,
    NotApplicable,
    assert_same_layers,
    assert_same_outcome,
    decline_if_declared,
    outcome,
    plan_view,
    served,
)
from pytest_kvconform.scenario import Scenario, scenario_from_dict
from pytest_kvconform.strategies import exercised_rules, mla_sliding_spec_dicts, scenario_dicts, scenario_toml
from pytest_kvconform.verdict import Verdict, decide

# Inputs a backend declines are counted (the summary's "gen. declined" column); hypothesis's
# filter_too_much health check still fails a backend that declines nearly all.
_settings = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def generated(data: dict[str, Any], backend: Any, rule: str) -> Iterator[Scenario]:
    """One generated input of a ``rule`` test as a scenario, at the backend's kernel block
    alignment: declined or not modelled by the reference, or a step of it declined (the reference
    answered that step), it is counted and rejected (its answers dropped from the test's
    record); departing where a known departure of its kind says, it is counted and passes;
    compared, it is counted with the rules it reached. A backend that declines the whole rule
    declines the test."""
    decline_if_declared(backend, rule)
    note("counterexample scenario (kv-scenario/1):\n" + scenario_toml(data))
    scenario = scenario_from_dict(data, "<hypothesis>")
    ledger = provenance.current()
    asked = len(ledger.answers)
    try:
        scenario = served(backend, scenario)  # at the backend's kernel block alignment
        yield scenario
    except Declined as exc:
        del ledger.answers[asked:]
        ledger.declined[str(exc)] += 1
        reject()
    except NotApplicable:
        del ledger.answers[asked:]
        reject()
    except Departure as exc:
        known = next(
            (k for k in ledger.known if (k.when is None or k.when(scenario)) and k.matches(exc.to_dict())),
            None,
        )
        if known is None:
            raise
        del ledger.answers[asked:]  # counted as a known departure, not compared
        ledger.known_departures[known.reason] += 1
    else:
        mine = decide(rule=rule, error=None, answers=ledger.answers[asked:], backend=backend)
        if mine.verdict is Verdict.DECLINED:  # (the reference itself is never declined)
            del ledger.answers[asked:]  # a step declined on this input: the reference's, not compared
            ledger.declined[mine.message] += 1
            reject()
        ledger.compared += 1
        ledger.exercised.update(exercised_rules(scenario))


def _both(
    kv_backend: Any, kv_reference: Any, method: str, *inputs: Any, scenario: Scenario
) -> tuple[Any, Any]:
    """(reference outcome, backend outcome): ``("ok", answer)`` or ``("rejects", kind)``."""
    expected = outcome(kv_reference, method, *inputs, scenario=scenario)
    return expected, outcome(kv_backend, method, *inputs, scenario=scenario)


def _specs(kv_reference: Any, scenario: Scenario) -> dict[str, Any]:
    """The reference's layer specs, the input of the spec-level rules; a scenario rejected before
    grouping (a TP split) has none: the layer-specs property covers it."""
    answer = outcome(kv_reference, "layer_specs", scenario=scenario)
    if answer[0] != "ok":
        raise NotApplicable(f"the reference rejects the layers ({answer[1]})")
    return answer[1]  # type: ignore[no-any-return]


@pytest.mark.kvconform_rule("hybrid_alignment")
@_settings
@given(data=scenario_dicts(hybrid=True))
def test_hybrid_alignment_generated(kv_backend: Any, kv_reference: Any, data: dict[str, Any]) -> None:
    with generated(data, kv_backend, "hybrid_alignment") as s:
        expected, got = _both(kv_backend, kv_reference, "align_hybrid_block_size", scenario=s)
        fields = ("block_size", "page_size_bytes", "state_page_padded_bytes")
        assert_same_outcome("hybrid_alignment", kv_backend, s, "alignment", expected, got,
                            lambda a: {f: getattr(a, f, None) for f in fields})  # fmt: skip


@pytest.mark.kvconform_rule("layer_specs")
@_settings
@given(data=scenario_dicts())
def test_layer_specs_generated(kv_backend: Any, kv_reference: Any, data: dict[str, Any]) -> None:
    with generated(data, kv_backend, "layer_specs") as s:
        expected, got = _both(kv_backend, kv_reference, "layer_specs", scenario=s)
        if expected[0] != "ok" or got[0] != "ok":
            assert_same_outcome("layer_specs", kv_backend, s, "layer_specs", expected, got)
        else:
            assert_same_layers(kv_backend, s, expected[1], got[1])


@pytest.mark.kvconform_rule("grouping")
@_settings
@given(data=scenario_dicts())
def test_grouping_generated(kv_backend: Any, kv_reference: Any, data: dict[str, Any]) -> None:
    with generated(data, kv_backend, "grouping") as s:
        expected, got = _both(
            kv_backend, kv_reference, "kv_cache_groups", _specs(kv_reference, s), scenario=s
        )
        assert_same_outcome("grouping", kv_backend, s, "groups", expected, got)


@pytest.mark.kvconform_rule("grouping")
@_settings
@given(data=mla_sliding_spec_dicts())
def test_grouping_of_mla_and_windows_generated(
    kv_backend: Any, kv_reference: Any, data: dict[str, Any]
) -> None:
    """MLA next to sliding-window layers (spec-level, as an MLA target with a sliding-window draft
    registers them): pages unification refuses take vLLM's full-allocation fallback (0.27+,
    reference/grouping.py), the others group as usual."""
    with generated(data, kv_backend, "grouping") as s:
        expected, got = _both(
            kv_backend, kv_reference, "kv_cache_groups", _specs(kv_reference, s), scenario=s
        )
        assert_same_outcome("grouping", kv_backend, s, "groups", expected, got)


@pytest.mark.kvconform_rule("memory")
@_settings
@given(data=scenario_dicts())
def test_memory_generated(kv_backend: Any, kv_reference: Any, data: dict[str, Any]) -> None:
    from pytest_kvconform.checks import memory_view

    with generated(data, kv_backend, "memory") as s:
        expected, got = _both(kv_backend, kv_reference, "check_memory", _specs(kv_reference, s), scenario=s)
        assert_same_outcome("memory", kv_backend, s, "check_memory", expected, got, memory_view)


@pytest.mark.kvconform_rule("one_sequence")
@_settings
@given(data=scenario_dicts())
def test_one_sequence_generated(kv_backend: Any, kv_reference: Any, data: dict[str, Any]) -> None:
    with generated(data, kv_backend, "one_sequence") as s:
        choice = outcome(kv_reference, "choose_block_size", scenario=s)
        if choice[0] != "ok":
            raise NotApplicable(f"the reference rejects the block choice ({choice[1]})")
        inputs = (choice[1].block_size, choice[1].state_page_padded)
        expected, got = _both(kv_backend, kv_reference, "one_sequence_bytes", *inputs, scenario=s)
        assert_same_outcome("one_sequence", kv_backend, s, "one_sequence_bytes", expected, got)


@pytest.mark.kvconform_rule("plan")
@_settings
@given(data=scenario_dicts())
def test_plan_generated(kv_backend: Any, kv_reference: Any, data: dict[str, Any]) -> None:
    with generated(data, kv_backend, "plan") as s:
        expected, got = _both(kv_backend, kv_reference, "plan", scenario=s)
        assert_same_outcome("plan", kv_backend, s, "plan", expected, got, plan_view)
