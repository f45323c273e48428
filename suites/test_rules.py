"""Differential conformance suite: the selected backend vs the reference, rule family by rule family.

Run with ``pytest --kvconform-backend=NAME``. Each test carries ``kvconform_rule(family)``;
``kv_scenario`` parametrizes over the packaged scenarios (plus ``--kvconform-scenarios``).
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvconform.conformance import RuleNotApplicable, call_rule, skip_if_not_provided
from pytest_kvconform.reference.specs import AttentionSpec, MambaSpec
from pytest_kvconform.reference.unify import POLICIES
from pytest_kvconform.scenario import KV_CACHE_DTYPES, MODEL_DTYPES, Scenario


def outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    """``("ok", value)`` or ``("raises", exception type name)``, so rejections compare too."""
    try:
        return ("ok", fn(*args))
    except RuleNotApplicable as exc:
        pytest.skip(f"the backend cannot answer this input: {exc}")
    except (ValueError, NotImplementedError, AssertionError) as exc:
        return ("raises", type(exc).__name__)


def distinct(specs: dict[str, Any], kind: type) -> list[Any]:
    return list(dict.fromkeys(s for s in specs.values() if isinstance(s, kind)))


@pytest.mark.kvconform_rule("dtype")
@pytest.mark.parametrize("model_dtype", MODEL_DTYPES)
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_kv_cache_dtype_bytes(
    kv_backend: Any, kv_reference: Any, kv_cache_dtype: str, model_dtype: str
) -> None:
    expected = kv_reference.kv_cache_dtype_bytes(kv_cache_dtype, model_dtype)
    assert call_rule(kv_backend, "dtype", "kv_cache_dtype_bytes", kv_cache_dtype, model_dtype) == expected


@pytest.mark.kvconform_rule("attention_page")
def test_attention_page_bytes(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    specs = distinct(kv_reference.layer_specs(kv_scenario), AttentionSpec)
    got = [
        call_rule(kv_backend, "attention_page", "attention_page_bytes", s, scenario=kv_scenario)
        for s in specs
    ]
    assert got == [s.page_size_bytes for s in specs]


@pytest.mark.kvconform_rule("state_page")
def test_state_shapes_and_page(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    if kv_scenario.model is None or kv_scenario.model.state is None:
        pytest.skip("no state layers")
    shapes = call_rule(kv_backend, "state_page", "state_shapes", kv_scenario, scenario=kv_scenario)
    assert tuple(map(tuple, shapes)) == kv_reference.state_shapes(kv_scenario)
    specs = distinct(kv_reference.layer_specs(kv_scenario), MambaSpec)
    got = [call_rule(kv_backend, "state_page", "state_page_bytes", s, scenario=kv_scenario) for s in specs]
    assert got == [s.page_size_bytes for s in specs]


@pytest.mark.kvconform_rule("max_memory")
def test_max_memory_usage_bytes(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    rt = kv_scenario.runtime
    specs = list(dict.fromkeys(kv_reference.layer_specs(kv_scenario).values()))
    got = [
        call_rule(kv_backend, "max_memory", "max_memory_usage_bytes", s, rt, scenario=kv_scenario)
        for s in specs
    ]
    assert got == [kv_reference.max_memory_usage_bytes(s, rt) for s in specs]


@pytest.mark.kvconform_rule("hybrid_alignment")
def test_hybrid_alignment(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    expected = kv_reference.align_hybrid_block_size(kv_scenario)
    if expected is None:
        pytest.skip("not a hybrid attention + state model")
    got = call_rule(
        kv_backend, "hybrid_alignment", "align_hybrid_block_size", kv_scenario, scenario=kv_scenario
    )
    assert (got.block_size, got.page_size_bytes, got.state_page_padded_bytes) == (
        expected.block_size, expected.page_size_bytes, expected.state_page_padded_bytes,
    )  # fmt: skip
    assert (got.attn_page_bytes_per_token, got.state_page_bytes) == (
        expected.attn_page_bytes_per_token, expected.state_page_bytes,
    )  # fmt: skip


def _policies(backend: Any) -> tuple[str, ...]:
    fixed = getattr(backend, "unify_policy", None)
    return (fixed,) if fixed else POLICIES


@pytest.mark.kvconform_rule("unification")
def test_unify_page_sizes(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    skip_if_not_provided(kv_backend, "unification")
    specs = kv_reference.layer_specs(kv_scenario)
    for policy in _policies(kv_backend):
        expected = outcome(kv_reference.unify_page_sizes, specs, policy)
        got = outcome(kv_backend.unify_page_sizes, specs, policy)
        if expected[0] == "ok" and got[0] == "ok":
            got = ("ok", {k: (s.block_size, s.page_size_bytes) for k, s in got[1].items()})
            expected = ("ok", {k: (s.block_size, s.page_size_bytes) for k, s in expected[1].items()})
        assert got == expected, f"policy {policy}"


@pytest.mark.kvconform_rule("grouping")
def test_kv_cache_groups(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    specs, rt = kv_reference.layer_specs(kv_scenario), kv_scenario.runtime
    policy = kv_backend.policy_for(kv_scenario) if hasattr(kv_backend, "policy_for") else rt.unify_policy
    expected = kv_reference.kv_cache_groups(specs, rt, policy)
    got = call_rule(kv_backend, "grouping", "kv_cache_groups", specs, rt, policy, scenario=kv_scenario)
    assert [(g.kind, len(g.layer_names)) for g in got] == [(g.kind, len(g.layer_names)) for g in expected]
    assert got == expected


@pytest.mark.kvconform_rule("memory")
def test_check_memory(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    specs, rt = kv_reference.layer_specs(kv_scenario), kv_scenario.runtime
    policy = kv_backend.policy_for(kv_scenario) if hasattr(kv_backend, "policy_for") else rt.unify_policy
    expected = kv_reference.check_memory(specs, rt, policy)
    assert (
        call_rule(kv_backend, "memory", "check_memory", specs, rt, policy, scenario=kv_scenario) == expected
    )


@pytest.mark.kvconform_rule("memory")
@pytest.mark.parametrize("fraction", [0.001, 0.5, 1.0])
def test_estimate_max_model_len(
    kv_backend: Any, kv_reference: Any, kv_scenario: Scenario, fraction: float
) -> None:
    specs, rt = kv_reference.layer_specs(kv_scenario), kv_scenario.runtime
    policy = kv_backend.policy_for(kv_scenario) if hasattr(kv_backend, "policy_for") else rt.unify_policy
    available = int(kv_reference.check_memory(specs, rt, policy).needed_bytes * fraction)
    expected = kv_reference.estimate_max_model_len(specs, rt, available, policy)
    got = call_rule(
        kv_backend, "memory", "estimate_max_model_len", specs, rt, available, policy, scenario=kv_scenario
    )
    assert got == expected


@pytest.mark.kvconform_rule("one_sequence")
def test_one_sequence_bytes(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    if kv_scenario.is_spec_level:
        pytest.skip("the one-sequence estimate needs a model-level scenario")
    expected = kv_reference.one_sequence_bytes(kv_scenario)
    assert (
        call_rule(kv_backend, "one_sequence", "one_sequence_bytes", kv_scenario, scenario=kv_scenario)
        == expected
    )


#: Logical block sizes seen in the notes (hybrid alignments, translations) plus a few small ones.
BLOCK_SIZES = [8, 16, 24, 32, 48, 64, 144, 160, 288, 400, 416, 528, 544, 784, 1056, 1808, 2768, 4160]


@pytest.mark.kvconform_rule("kernel_block")
@pytest.mark.parametrize("block_size", [*BLOCK_SIZES, 7, 100])
def test_kernel_block_size(kv_backend: Any, kv_reference: Any, block_size: int) -> None:
    skip_if_not_provided(kv_backend, "kernel_block")
    assert outcome(kv_backend.kernel_block_size, block_size) == outcome(
        kv_reference.kernel_block_size, block_size
    )


@pytest.mark.kvconform_rule("kernel_block")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_build_block_tables(kv_backend: Any, kv_reference: Any, block_size: int) -> None:
    rows = [[0, 2], [1], [5, 3, 4]]
    got = call_rule(kv_backend, "kernel_block", "build_block_tables", rows, block_size)
    table, kernel = got
    assert ([list(map(int, r)) for r in table], kernel) == kv_reference.build_block_tables(rows, block_size)


@pytest.mark.kvconform_rule("plan")
def test_plan(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    expected = kv_reference.plan(kv_scenario).to_dict()
    got = call_rule(kv_backend, "plan", "plan", kv_scenario, scenario=kv_scenario).to_dict()
    assert {k: v for k, v in got.items() if v != expected[k]} == {}
