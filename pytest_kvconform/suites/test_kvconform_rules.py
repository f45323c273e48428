"""Differential conformance suite: the selected backend vs the reference, rule family by rule family.

Run with ``pytest --kvconform-backend=NAME``. Each test carries ``kvconform_rule(family)``;
``kv_scenario`` parametrizes over the packaged scenarios (plus ``--kvconform-scenarios``). A
per-rule test hands the backend the reference's inputs for that rule (its layer specs, its
block choice), so each rule is checked on its own; ``test_layer_specs`` compares the backend's
own specs and ``test_plan`` its own composition, step by step. A failure names the rule, the
backend, the scenario and the first differing field with both values.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvconform.conformance import (
    assert_same,
    assert_same_layers,
    call_rule,
    outcome,
    plan_with_trace,
)
from pytest_kvconform.model import KVPlan
from pytest_kvconform.reference.specs import AttentionSpec, MambaSpec
from pytest_kvconform.reference.unify import POLICIES
from pytest_kvconform.scenario import KV_CACHE_DTYPES, MODEL_DTYPES, Scenario


def distinct(specs: dict[str, Any], kind: type) -> list[Any]:
    return list(dict.fromkeys(s for s in specs.values() if isinstance(s, kind)))


def reference_specs(kv_reference: Any, scenario: Scenario) -> dict[str, Any]:
    """The reference's layer specs; a scenario the reference rejects has none to hand on."""
    answer = outcome(kv_reference, "layer_specs", scenario=scenario)
    if answer[0] != "ok":
        pytest.skip(
            f"the reference rejects this scenario's layers ({answer[1]}); test_layer_specs checks that"
        )
    return answer[1]


@pytest.mark.kvconform_rule("dtype")
@pytest.mark.parametrize("model_dtype", MODEL_DTYPES)
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_kv_cache_dtype_bytes(
    kv_backend: Any, kv_reference: Any, kv_cache_dtype: str, model_dtype: str
) -> None:
    key = f"kv_cache_dtype_bytes({kv_cache_dtype!r}, {model_dtype!r})"
    expected = kv_reference.kv_cache_dtype_bytes(kv_cache_dtype, model_dtype)
    got = call_rule(kv_backend, "kv_cache_dtype_bytes", kv_cache_dtype, model_dtype)
    assert_same("dtype", kv_backend, None, {key: expected}, {key: got})


@pytest.mark.kvconform_rule("hybrid_alignment")
def test_hybrid_alignment(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    expected = kv_reference.align_hybrid_block_size(scenario=kv_scenario)
    if expected is None:
        pytest.skip("not a hybrid attention + state model")
    got = call_rule(kv_backend, "align_hybrid_block_size", scenario=kv_scenario)
    fields = ("block_size", "page_size_bytes", "state_page_padded_bytes", "attn_page_bytes_per_token",
              "state_page_bytes")  # fmt: skip
    want, have = ({f: getattr(answer, f, None) for f in fields} for answer in (expected, got))
    assert_same("hybrid_alignment", kv_backend, kv_scenario, want, have)


@pytest.mark.kvconform_rule("block_size")
def test_choose_block_size(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    expected = outcome(kv_reference, "choose_block_size", scenario=kv_scenario)
    got = outcome(kv_backend, "choose_block_size", scenario=kv_scenario)
    assert_same("block_size", kv_backend, kv_scenario, expected, got)


@pytest.mark.kvconform_rule("state_page")
def test_state_shapes_and_page(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    if kv_scenario.model is None or kv_scenario.model.state is None:
        pytest.skip("no state layers")
    expected = outcome(kv_reference, "state_shapes", scenario=kv_scenario)
    got = outcome(kv_backend, "state_shapes", scenario=kv_scenario)
    if got[0] == "ok":
        got = ("ok", tuple(map(tuple, got[1])))
    assert_same("state_page", kv_backend, kv_scenario, {"state_shapes": expected}, {"state_shapes": got})
    specs = distinct(reference_specs(kv_reference, kv_scenario), MambaSpec)
    pages = [call_rule(kv_backend, "state_page_bytes", s, scenario=kv_scenario) for s in specs]
    want = [s.page_size_bytes for s in specs]
    assert_same(
        "state_page", kv_backend, kv_scenario, {"state_page_bytes": want}, {"state_page_bytes": pages}
    )


@pytest.mark.kvconform_rule("layer_specs")
def test_layer_specs(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    """The backend's own per-layer specs (its ``get_kv_cache_spec``), layer by layer."""
    expected = outcome(kv_reference, "layer_specs", scenario=kv_scenario)
    got = outcome(kv_backend, "layer_specs", scenario=kv_scenario)
    if expected[0] != "ok" or got[0] != "ok":
        assert_same("layer_specs", kv_backend, kv_scenario, expected[:1], got[:1])
        assert_same("layer_specs", kv_backend, kv_scenario, expected, got)
        return
    assert_same_layers(kv_backend, kv_scenario, expected[1], got[1])


@pytest.mark.kvconform_rule("attention_page")
def test_attention_page_bytes(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    specs = distinct(reference_specs(kv_reference, kv_scenario), AttentionSpec)
    got = [call_rule(kv_backend, "attention_page_bytes", s, scenario=kv_scenario) for s in specs]
    want = [s.page_size_bytes for s in specs]
    assert_same(
        "attention_page", kv_backend, kv_scenario, {"page_size_bytes": want}, {"page_size_bytes": got}
    )


@pytest.mark.kvconform_rule("max_memory")
def test_max_memory_usage_bytes(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    specs = list(dict.fromkeys(reference_specs(kv_reference, kv_scenario).values()))
    got = [call_rule(kv_backend, "max_memory_usage_bytes", s, scenario=kv_scenario) for s in specs]
    want = [kv_reference.max_memory_usage_bytes(s, scenario=kv_scenario) for s in specs]
    assert_same("max_memory", kv_backend, kv_scenario, {"max_memory_usage_bytes": want},
                {"max_memory_usage_bytes": got})  # fmt: skip


def _policies(backend: Any) -> tuple[str, ...]:
    fixed = getattr(backend, "unify_policy", None)
    return (fixed,) if fixed else POLICIES


@pytest.mark.kvconform_rule("unification")
def test_unify_page_sizes(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    for policy in _policies(kv_backend):
        s = kv_scenario.with_runtime(unify_policy=policy)
        specs = reference_specs(kv_reference, s)
        expected = outcome(kv_reference, "unify_page_sizes", specs, scenario=s)
        got = outcome(kv_backend, "unify_page_sizes", specs, scenario=s)
        if expected[0] == "ok" and got[0] == "ok":
            got = ("ok", {k: (v.block_size, v.page_size_bytes) for k, v in got[1].items()})
            expected = ("ok", {k: (v.block_size, v.page_size_bytes) for k, v in expected[1].items()})
        assert_same("unification", kv_backend, s, {policy: expected}, {policy: got})


@pytest.mark.kvconform_rule("grouping")
def test_kv_cache_groups(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    specs = reference_specs(kv_reference, kv_scenario)
    expected = kv_reference.kv_cache_groups(specs, scenario=kv_scenario)
    got = call_rule(kv_backend, "kv_cache_groups", specs, scenario=kv_scenario)
    shape = {"groups (kind, layers)": [(g.kind, len(g.layer_names)) for g in expected]}
    assert_same(
        "grouping",
        kv_backend,
        kv_scenario,
        shape,
        {"groups (kind, layers)": [(g.kind, len(g.layer_names)) for g in got]},
    )
    assert_same("grouping", kv_backend, kv_scenario, {"groups": expected}, {"groups": got})


@pytest.mark.kvconform_rule("memory")
def test_check_memory(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    specs = reference_specs(kv_reference, kv_scenario)
    expected = kv_reference.check_memory(specs, scenario=kv_scenario)
    got = call_rule(kv_backend, "check_memory", specs, scenario=kv_scenario)
    assert_same("memory", kv_backend, kv_scenario, expected, got)


@pytest.mark.kvconform_rule("memory")
@pytest.mark.parametrize("fraction", [0.001, 0.5, 1.0])
def test_estimate_max_model_len(
    kv_backend: Any, kv_reference: Any, kv_scenario: Scenario, fraction: float
) -> None:
    specs = reference_specs(kv_reference, kv_scenario)
    available = int(kv_reference.check_memory(specs, scenario=kv_scenario).needed_bytes * fraction)
    key = f"estimate_max_model_len({available} B)"
    expected = kv_reference.estimate_max_model_len(specs, available, scenario=kv_scenario)
    got = call_rule(kv_backend, "estimate_max_model_len", specs, available, scenario=kv_scenario)
    assert_same("memory", kv_backend, kv_scenario, {key: expected}, {key: got})


@pytest.mark.kvconform_rule("one_sequence")
def test_one_sequence_bytes(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    if kv_scenario.is_spec_level:
        pytest.skip("the one-sequence estimate needs a model-level scenario")
    choice = kv_reference.choose_block_size(scenario=kv_scenario)
    inputs = (choice.block_size, choice.state_page_padded)
    expected = kv_reference.one_sequence_bytes(*inputs, scenario=kv_scenario)
    got = call_rule(kv_backend, "one_sequence_bytes", *inputs, scenario=kv_scenario)
    assert_same("one_sequence", kv_backend, kv_scenario, {"one_sequence_bytes": expected},
                {"one_sequence_bytes": got})  # fmt: skip


#: Logical block sizes of the packaged hybrids' alignments and translations, plus a few small ones.
BLOCK_SIZES = [8, 16, 24, 32, 48, 64, 144, 160, 288, 400, 416, 528, 544, 784, 1056, 1808, 2768, 4160]


@pytest.mark.kvconform_rule("kernel_block")
@pytest.mark.parametrize("block_size", [*BLOCK_SIZES, 7, 100])
def test_kernel_block_size(kv_backend: Any, kv_reference: Any, block_size: int) -> None:
    key = f"kernel_block_size({block_size})"
    expected = outcome(kv_reference, "kernel_block_size", block_size)
    assert_same(
        "kernel_block",
        kv_backend,
        None,
        {key: expected},
        {key: outcome(kv_backend, "kernel_block_size", block_size)},
    )


@pytest.mark.kvconform_rule("kernel_block")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_build_block_tables(kv_backend: Any, kv_reference: Any, block_size: int) -> None:
    rows = [[0, 2], [1], [5, 3, 4]]
    table, kernel = call_rule(kv_backend, "build_block_tables", rows, block_size)
    want_table, want_kernel = kv_reference.build_block_tables(rows, block_size)
    assert_same("kernel_block", kv_backend, None, {"kernel_block": want_kernel, "table": want_table},
                {"kernel_block": kernel, "table": [list(map(int, r)) for r in table]})  # fmt: skip


@pytest.mark.kvconform_rule("plan")
def test_plan(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario, record_property: Any) -> None:
    """The backend's own composition: each step answered by its own rule, or the reference's
    where it declines (those steps are recorded and reported)."""
    expected = outcome(kv_reference, "plan", scenario=kv_scenario)
    if expected[0] != "ok":
        assert_same(
            "plan", kv_backend, kv_scenario, expected, outcome(kv_backend, "plan", scenario=kv_scenario)
        )
        return
    got = plan_with_trace(kv_backend, kv_scenario, record_property)
    assert_same("plan", kv_backend, kv_scenario, expected[1].to_dict(), got.to_dict())


def _matches(want: Any, got: Any) -> bool:
    """Authors write percentages and ratios to two decimals: floats match to 0.01."""
    return abs(got - want) <= 0.01 if isinstance(want, float) else got == want


@pytest.mark.kvconform_rule("plan")
def test_expectations(kv_backend: Any, kv_scenario: Scenario) -> None:
    """The scenario file's own ``[expect]`` table (numbers its author derived) and the plan fields
    of its ``[expect.external]`` (public observations) against the backend's plan, for packaged
    scenarios and ``--kvconform-scenarios`` files alike."""
    external = {k: v for k, v in kv_scenario.expect_external.items() if k in KVPlan.field_names()}
    if not kv_scenario.expect and not external:
        pytest.skip("no [expect] table")
    got = call_rule(kv_backend, "plan", scenario=kv_scenario).to_dict()
    wrong = [f"{table}.{k}: expected {v!r}, got {got[k]!r}"
             for table, values in (("expect", kv_scenario.expect), ("expect.external", external))
             for k, v in values.items() if not _matches(v, got[k])]  # fmt: skip
    if wrong:
        pytest.fail(f"{kv_scenario.source}: backend {kv_backend.name!r}: " + "; ".join(wrong), pytrace=False)


@pytest.mark.kvconform_rule("dtype")
@pytest.mark.parametrize("torch_dtype", ["int8", "float32"])
def test_registered_kv_cache_dtype(kv_backend: Any, kv_reference: Any, torch_dtype: str) -> None:
    """A platform's own ``--kv-cache-dtype`` (``register_kv_cache_dtype``, vllm/config/cache.py,
    vLLM 0.33) is stored in the torch dtype its handler names: Llama-3-8B's 8 KV heads x (128 + 128)
    x 1 B (int8) = 2048 B per token per layer, x 4 B (float32) = 8192."""
    from pytest_kvconform.scenario import scenario_from_dict

    s = scenario_from_dict({
        "schema": "kv-scenario/1", "name": f"llama-3-8b, registered kv_cache_dtype plugin_{torch_dtype}",
        "model": {"architecture": "LlamaForCausalLM", "dtype": "bfloat16", "num_hidden_layers": 32,
                  "layers": "A" * 32, "attention": {"kind": "gqa", "num_kv_heads": 8, "head_dim": 128}},
        "runtime": {"kv_cache_dtype": f"plugin_{torch_dtype}",
                    "registered_kv_cache_dtypes": {f"plugin_{torch_dtype}": torch_dtype}},
    }, "<registered dtype>")  # fmt: skip
    want = {"int8": 2048, "float32": 8192}[torch_dtype]
    assert kv_reference.plan(scenario=s).attn_bytes_per_token_per_layer == want
    got = call_rule(kv_backend, "plan", scenario=s)
    assert_same("dtype", kv_backend, s, {"attn_bytes_per_token_per_layer": want},
                {"attn_bytes_per_token_per_layer": got.attn_bytes_per_token_per_layer})  # fmt: skip
