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
from pytest_kvconform.conformance import assert_same, assert_same_outcome, call_rule, outcome
from pytest_kvconform.scenario import KV_CACHE_DTYPES, MODEL_DTYPES


@pytest.mark.kvconform_rule("dtype")
@pytest.mark.parametrize("model_dtype", MODEL_DTYPES)
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_kv_cache_dtype_bytes(
    kv_backend: Any, kv_reference: Any, kv_cache_dtype: str, model_dtype: str
) -> None:
    """The element size, or the rejection of a name the judged release lacks (``CacheDType``)."""
    key = f"kv_cache_dtype_bytes({kv_cache_dtype!r}, {model_dtype!r})"
    expected = outcome(kv_reference, "kv_cache_dtype_bytes", kv_cache_dtype, model_dtype)
    got = outcome(kv_backend, "kv_cache_dtype_bytes", kv_cache_dtype, model_dtype)
    assert_same_outcome("dtype", kv_backend, None, key, expected, got)


# One test per per-scenario check of ``checks.CHECKS`` (the table ``kvconform check`` runs too):
# test_hybrid_alignment, test_choose_block_size, test_state_shapes_and_page, test_layer_specs,
# test_attention_page_bytes, test_max_memory_usage_bytes, test_unify_page_sizes,
# test_kv_cache_groups, test_kv_cache_tensors, test_kv_cache_views, test_kernel_cache_views,
# test_check_memory, test_estimate_max_model_len[scenario-fraction], test_one_sequence_bytes,
# test_plan, test_expectations.
for _check in checks.CHECKS:
    globals()[_check.test] = checks.suite_test(_check)
del _check


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


@pytest.mark.kvconform_independent
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
    assert_same(
        "dtype",
        kv_reference,
        s,
        {"attn_bytes_per_token_per_layer": want},
        {"attn_bytes_per_token_per_layer": kv_reference.plan(scenario=s).attn_bytes_per_token_per_layer},
    )
    got = call_rule(kv_backend, "plan", scenario=s)
    assert_same("dtype", kv_backend, s, {"attn_bytes_per_token_per_layer": want},
                {"attn_bytes_per_token_per_layer": got.attn_bytes_per_token_per_layer})  # fmt: skip
