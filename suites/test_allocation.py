"""End-to-end checks with real allocations in the MLX runtime.

Whatever backend is selected, its numbers are turned into a pool the runtime really
allocates: a pool sized by the backend's one-sequence bytes must hold ``max_model_len``
tokens (written through a slot mapping and attended over, against the dense oracle), and a
pool of the backend's ``num_blocks`` must hold exactly ``num_blocks * bytes_per_block`` bytes
and accept no slot beyond it. Big models are scaled down to one attention layer with one KV
head, which keeps the sizing shape (block size, per-token bytes per head, token count).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from pytest_kvconform.conformance import call_rule
from pytest_kvconform.reference.hybrid import block_and_padding, hybrid_alignment
from pytest_kvconform.scenario import Scenario

pytestmark = [pytest.mark.metal, pytest.mark.kvconform_rule("one_sequence")]


def _blocks_in_one_sequence(scenario: Scenario, one_sequence_bytes: int) -> tuple[int, int]:
    """How many whole blocks of the scenario's pool ``one_sequence_bytes`` pays for, and the block size.

    The state layers' share (one padded page, or one slot, per state layer) is taken off
    first, as the one-sequence estimate adds it on top of the paged layers.
    """
    from pytest_kvconform.metal_runtime import KVPool, layers_from_scenario

    block, padded = block_and_padding(scenario, hybrid_alignment(scenario))
    layers = layers_from_scenario(scenario)
    paged = [layer for layer in layers if layer.is_paged]
    per_block = KVPool(paged, 1, block, 0).bytes_per_block()
    assert scenario.model is not None
    if padded is not None:
        state = scenario.model.num_state_layers * padded
    else:
        state = KVPool([x for x in layers if not x.is_paged], 0, block, 1).state_bytes()
    return max(0, one_sequence_bytes - state) // per_block, block


def test_one_sequence_pool_holds_max_model_len(kv_backend: Any, kv_scenario: Scenario) -> None:
    import mlx.core as mx
    import numpy as np

    from pytest_kvconform.metal_runtime import (
        DTYPE_TOLERANCES,
        dense_attention,
        paged_attention_logical,
        reshape_and_cache,
    )

    model = kv_scenario.model
    if model is None or model.attention is None:
        pytest.skip("needs a model-level scenario with attention layers")
    one_sequence = call_rule(
        kv_backend, "one_sequence", "one_sequence_bytes", kv_scenario, scenario=kv_scenario
    )
    num_blocks, block = _blocks_in_one_sequence(kv_scenario, one_sequence)
    length = kv_scenario.runtime.max_model_len
    assert num_blocks * block >= length, (
        f"{one_sequence} B buy {num_blocks} blocks of {block} tokens: {num_blocks * block} < {length} tokens"
    )
    if model.attention.kind == "mla":
        return  # the runtime has no MLA attention kernel; the capacity check above is the claim
    dtype = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}[model.dtype]
    d = model.attention.head_dim
    cache_k = mx.zeros((num_blocks, block, 1, d), dtype=dtype)
    cache_v = mx.zeros_like(cache_k)
    rng = np.random.default_rng(0)
    keys = mx.array(rng.standard_normal((length, 1, d), dtype=np.float32)).astype(dtype)
    values = mx.array(rng.standard_normal((length, 1, d), dtype=np.float32)).astype(dtype)
    # Blocks in reverse order, so the table really is a permutation: slot = block_id * bs + offset.
    table = list(range(num_blocks - 1, -1, -1))
    positions = np.arange(length)
    slots = np.array(table)[positions // block] * block + positions % block
    cache_k, cache_v = reshape_and_cache(keys, values, cache_k, cache_v, mx.array(slots, dtype=mx.int64))
    query = mx.array(rng.standard_normal((1, 2, d), dtype=np.float32)).astype(dtype)
    scale = 1 / math.sqrt(d)
    cu = mx.array([0, 1], dtype=mx.int32)
    out = paged_attention_logical(
        query, cache_k, cache_v, [table[: -(-length // block)]], mx.array([length], dtype=mx.int32), cu,
        scale=scale, num_kv_heads=1,
    )  # fmt: skip
    expected = dense_attention(query, [keys], [values], cu, scale=scale)
    atol, rtol = DTYPE_TOLERANCES[model.dtype]
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), expected, atol=atol, rtol=rtol)


def test_pool_of_num_blocks_holds_exactly_its_blocks(kv_backend: Any, kv_scenario: Scenario) -> None:
    import mlx.core as mx

    from pytest_kvconform.metal_runtime import KVPool, layers_from_scenario, reshape_and_cache

    model = kv_scenario.model
    if model is None:
        pytest.skip("needs a model-level scenario")
    kv_dtype = kv_scenario.runtime.kv_cache_dtype
    if kv_dtype not in ("auto", model.dtype):
        pytest.skip(f"the runtime allocates plain K/V in the model dtype, not {kv_dtype}")
    plan = call_rule(kv_backend, "plan", "plan", kv_scenario, scenario=kv_scenario)
    # The full pool is gigabytes; keep the per-block layout and give it a budget of a few blocks.
    budget = 3 * plan.bytes_per_block + plan.bytes_per_block // 2
    num_blocks = KVPool.num_blocks_for_budget(budget, plan.bytes_per_block)
    paged = [layer for layer in layers_from_scenario(kv_scenario) if layer.is_paged]
    pool = KVPool(paged, num_blocks, plan.block_size, 0)
    assert pool.bytes_per_block() == plan.bytes_per_block
    assert pool.bytes_held() == num_blocks * plan.bytes_per_block
    if paged[0].kind != "attention":
        return
    k, v = pool.caches[0]["k"], pool.caches[0]["v"]
    token = mx.ones((1, *k.shape[2:]), dtype=k.dtype)
    last = num_blocks * plan.block_size - 1
    reshape_and_cache(token, token, k, v, mx.array([last], dtype=mx.int64))  # the last slot is fine
    with pytest.raises(ValueError, match="slot"):
        reshape_and_cache(token, token, k, v, mx.array([last + 1], dtype=mx.int64))
