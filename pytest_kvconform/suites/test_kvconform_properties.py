"""Differential property tests: backend vs reference over hypothesis-generated scenarios.

A failure prints the shrunk scenario as ``kv-scenario/1`` TOML, ready to paste into a file.
``--kvconform-max-examples`` sets the number of examples; hypothesis's own profiles (``ci``)
are respected otherwise.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, note, reject, settings

from pytest_kvconform.backends.base import METHOD_FAMILY
from pytest_kvconform.conformance import (
    REJECTIONS,
    RuleNotApplicable,
    assert_same,
    assert_same_layers,
    compared,
    discard,
    skip_if_not_provided,
)
from pytest_kvconform.scenario import Scenario, scenario_from_dict
from pytest_kvconform.strategies import exercised_rules, mla_sliding_spec_dicts, scenario_dicts, scenario_toml

# Inputs a backend cannot model are discarded and counted (the summary's "discarded" column);
# hypothesis's filter_too_much health check still fails a backend that discards nearly all.
_settings = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _scenario(data: dict[str, Any], backend: Any) -> Scenario:
    note("counterexample scenario (kv-scenario/1):\n" + scenario_toml(data))
    scenario = scenario_from_dict(data, "<hypothesis>")
    reason = backend.unsupported(scenario) if hasattr(backend, "unsupported") else None
    if reason:
        discard(f"unsupported: {reason}")
        reject()
    return scenario


def _both(
    kv_backend: Any, kv_reference: Any, method: str, *inputs: Any, scenario: Scenario
) -> tuple[Any, Any]:
    """(reference answer, backend answer); (None, None) when both reject the input alike.

    An input the backend has no code path for (``RuleNotApplicable``) is discarded.
    """
    skip_if_not_provided(kv_backend, METHOD_FAMILY[method])
    try:
        expected = getattr(kv_reference, method)(*inputs, scenario=scenario)
    except REJECTIONS as exc:
        # The reference rejects this input (as vLLM would); the backend must reject it too.
        try:
            with pytest.raises(type(exc)):
                getattr(kv_backend, method)(*inputs, scenario=scenario)
        except RuleNotApplicable as not_applicable:
            discard(f"not applicable: {not_applicable}")
            reject()
        compared(*exercised_rules(scenario))
        return None, None
    try:
        got = getattr(kv_backend, method)(*inputs, scenario=scenario)
    except RuleNotApplicable as exc:
        discard(f"not applicable: {exc}")
        reject()
    compared(*exercised_rules(scenario))
    return expected, got


@pytest.mark.kvconform_rule("hybrid_alignment")
@_settings
@given(data=scenario_dicts(hybrid=True))
def test_hybrid_alignment_generated(kv_backend: Any, kv_reference: Any, data: dict[str, Any]) -> None:
    s = _scenario(data, kv_backend)
    expected, got = _both(kv_backend, kv_reference, "align_hybrid_block_size", scenario=s)
    if expected is not None:
        fields = ("block_size", "page_size_bytes", "state_page_padded_bytes")
        want, have = ({f: getattr(a, f, None) for f in fields} for a in (expected, got))
        assert_same("hybrid_alignment", kv_backend, s, want, have)


def _on_layer_specs(kv_backend: Any, kv_reference: Any, data: dict[str, Any], method: str) -> tuple:
    """(scenario, reference answer, backend answer) of a spec-level rule (``method(specs,
    scenario=...)``) on the reference's layer specs."""
    s = _scenario(data, kv_backend)
    try:
        specs = kv_reference.layer_specs(scenario=s)
    except REJECTIONS:
        reject()  # rejected before grouping (e.g. a TP split); the layer-specs property covers it
    return (s, *_both(kv_backend, kv_reference, method, specs, scenario=s))


@pytest.mark.kvconform_rule("layer_specs")
@_settings
@given(data=scenario_dicts())
def test_layer_specs_generated(kv_backend: Any, kv_reference: Any, data: dict[str, Any]) -> None:
    s = _scenario(data, kv_backend)
    expected, got = _both(kv_backend, kv_reference, "layer_specs", scenario=s)
    if expected is not None:
        assert_same_layers(kv_backend, s, expected, got)


@pytest.mark.kvconform_rule("grouping")
@_settings
@given(data=scenario_dicts())
def test_grouping_generated(kv_backend: Any, kv_reference: Any, data: dict[str, Any]) -> None:
    s, expected, got = _on_layer_specs(kv_backend, kv_reference, data, "kv_cache_groups")
    assert_same("grouping", kv_backend, s, {"groups": expected}, {"groups": got})


@pytest.mark.kvconform_rule("grouping")
@_settings
@given(data=mla_sliding_spec_dicts())
def test_grouping_of_mla_and_windows_generated(
    kv_backend: Any, kv_reference: Any, data: dict[str, Any]
) -> None:
    """MLA next to sliding-window layers (spec-level, as an MLA target with a sliding-window draft
    registers them): pages unification refuses take vLLM's full-allocation fallback (0.27+,
    reference/grouping.py), the others group as usual."""
    s, expected, got = _on_layer_specs(kv_backend, kv_reference, data, "kv_cache_groups")
    assert_same("grouping", kv_backend, s, {"groups": expected}, {"groups": got})


@pytest.mark.kvconform_rule("memory")
@_settings
@given(data=scenario_dicts())
def test_memory_generated(kv_backend: Any, kv_reference: Any, data: dict[str, Any]) -> None:
    s, expected, got = _on_layer_specs(kv_backend, kv_reference, data, "check_memory")
    assert_same("memory", kv_backend, s, expected, got)


@pytest.mark.kvconform_rule("one_sequence")
@_settings
@given(data=scenario_dicts())
def test_one_sequence_generated(kv_backend: Any, kv_reference: Any, data: dict[str, Any]) -> None:
    s = _scenario(data, kv_backend)
    try:
        choice = kv_reference.choose_block_size(scenario=s)
    except REJECTIONS:
        reject()
    inputs = (choice.block_size, choice.state_page_padded)
    expected, got = _both(kv_backend, kv_reference, "one_sequence_bytes", *inputs, scenario=s)
    assert_same("one_sequence", kv_backend, s, {"one_sequence_bytes": expected}, {"one_sequence_bytes": got})


@pytest.mark.kvconform_rule("plan")
@_settings
@given(data=scenario_dicts())
def test_plan_generated(kv_backend: Any, kv_reference: Any, data: dict[str, Any]) -> None:
    s = _scenario(data, kv_backend)
    expected, got = _both(kv_backend, kv_reference, "plan", scenario=s)
    if expected is not None:
        assert_same("plan", kv_backend, s, expected.to_dict(), got.to_dict())
