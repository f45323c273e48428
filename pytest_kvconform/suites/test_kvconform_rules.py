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

from pytest_kvconform import checks
from pytest_kvconform.conformance import assert_same, call_rule
from pytest_kvconform.scenario import KV_CACHE_DTYPES, MODEL_DTYPES, Scenario


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
    checks.hybrid_alignment(kv_backend, kv_reference, kv_scenario)


@pytest.mark.kvconform_rule("block_size")
def test_choose_block_size(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    checks.choose_block_size(kv_backend, kv_reference, kv_scenario)


@pytest.mark.kvconform_rule("state_page")
def test_state_shapes_and_page(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    checks.state_shapes_and_page(kv_backend, kv_reference, kv_scenario)


@pytest.mark.kvconform_rule("layer_specs")
def test_layer_specs(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    """The backend's own per-layer specs (its ``get_kv_cache_spec``), layer by layer."""
    checks.layer_specs(kv_backend, kv_reference, kv_scenario)


@pytest.mark.kvconform_rule("attention_page")
def test_attention_page_bytes(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    checks.attention_page_bytes(kv_backend, kv_reference, kv_scenario)


@pytest.mark.kvconform_rule("max_memory")
def test_max_memory_usage_bytes(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    checks.max_memory_usage_bytes(kv_backend, kv_reference, kv_scenario)


@pytest.mark.kvconform_rule("unification")
def test_unify_page_sizes(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    checks.unify_page_sizes(kv_backend, kv_reference, kv_scenario)


@pytest.mark.kvconform_rule("grouping")
def test_kv_cache_groups(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    checks.kv_cache_groups(kv_backend, kv_reference, kv_scenario)


@pytest.mark.kvconform_rule("memory")
def test_check_memory(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    checks.check_memory(kv_backend, kv_reference, kv_scenario)


@pytest.mark.kvconform_rule("memory")
@pytest.mark.parametrize("fraction", checks.FRACTIONS)
def test_estimate_max_model_len(
    kv_backend: Any, kv_reference: Any, kv_scenario: Scenario, fraction: float
) -> None:
    checks.estimate_max_model_len(kv_backend, kv_reference, kv_scenario, fraction)


@pytest.mark.kvconform_rule("one_sequence")
def test_one_sequence_bytes(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:
    checks.one_sequence_bytes(kv_backend, kv_reference, kv_scenario)


#: Logical block sizes of the packaged hybrids' alignments and translations, plus a few small ones.
BLOCK_SIZES = [8, 16, 24, 32, 48, 64, 144, 160, 288, 400, 416, 528, 544, 784, 1056, 1808, 2768, 4160]


@pytest.mark.kvconform_rule("kernel_block")
@pytest.mark.parametrize("block_size", [*BLOCK_SIZES, 7, 100])
def test_kernel_block_size(kv_backend: Any, kv_reference: Any, block_size: int) -> None:
    checks.kernel_block_size(kv_backend, kv_reference, block_size)


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
    checks.plan(kv_backend, kv_reference, kv_scenario, record_property)


@pytest.mark.kvconform_rule("plan")
def test_expectations(kv_backend: Any, kv_scenario: Scenario) -> None:
    """The scenario file's own ``[expect]`` table (numbers its author derived) and the plan fields
    of its ``[expect.external]`` (public observations) against the backend's plan, for packaged
    scenarios and ``--kvconform-scenarios`` files alike."""
    checks.expectations(kv_backend, kv_scenario)


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
