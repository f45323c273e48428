"""End-to-end checks with real allocations in the MLX runtime, and the ``allocation`` rule family.

Whatever backend is selected, its one-sequence bytes are turned into a pool the runtime really
allocates: it must hold ``max_model_len`` tokens (written through a slot mapping and attended
over, against the dense oracle; MLA latents, which the runtime has no attention kernel for, are
read back through the block table). Big models are scaled down to one attention layer with one KV
head of 64 values per token, which keeps what the pool's capacity depends on (the block size, the
blocks the bytes buy, the token count).

The ``allocation`` family runs on backends that really allocate (those that do not declare it in
``declines``): given the reference's plan, the pool the backend allocates must hold exactly
``num_blocks * bytes_per_block`` bytes, and an engine KV cache config larger than the pool must
be rejected.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from pytest_kvconform.checks import reference_choice
from pytest_kvconform.conformance import (
    NotApplicable,
    assert_same,
    call_rule,
    decline_if_declared,
    outcome,
    served,
)
from pytest_kvconform.reference.hybrid import block_choice, hybrid_alignment
from pytest_kvconform.regressions import one_sequence_bytes
from pytest_kvconform.scenario import Scenario


def _blocks_in_one_sequence(scenario: Scenario, one_sequence_bytes: int) -> tuple[int, int]:
    """How many whole blocks of the scenario's pool ``one_sequence_bytes`` pays for, and the block size.

    The state layers' share (one padded page, or one slot, per state layer) is taken off
    first, as the one-sequence estimate adds it on top of the paged layers.
    """
    from pytest_kvconform.metal_runtime import KVPool, layers_from_scenario

    choice = block_choice(scenario, hybrid_alignment(scenario))
    block, padded = choice.block_size, choice.state_page_padded
    layers = layers_from_scenario(scenario)
    paged = [layer for layer in layers if layer.is_paged]
    per_block = KVPool(paged, 1, block, 0).bytes_per_block()
    assert scenario.model is not None
    if padded is not None:
        state = scenario.model.num_state_layers * padded
    else:
        state = KVPool([x for x in layers if not x.is_paged], 0, block, 1).state_bytes()
    return max(0, one_sequence_bytes - state) // per_block, block


#: Values per token in the scaled-down pool. What the pool holds depends on the block size, the
#: blocks the one-sequence bytes buy and the token count, not on the row width; 64 instead of a
#: 256-wide head (or a 576-wide MLA latent) makes a 262,144-token sequence 4x (9x) cheaper.
_ROW_WIDTH = 64


@pytest.mark.kvconform_metal
@pytest.mark.kvconform_independent
@pytest.mark.kvconform_rule("one_sequence")
def test_one_sequence_pool_holds_max_model_len(
    kv_backend: Any, kv_reference: Any, kv_scenario: Scenario
) -> None:
    """The pool the backend's one-sequence bytes buy holds ``max_model_len`` tokens: every token's
    K and V (for MLA, its one latent) written through the slot mapping read back unchanged
    through the block table, and paged attention over them equals the dense oracle (not for MLA:
    the runtime has no MLA attention kernel)."""
    model = kv_scenario.model
    if model is None or not model.num_attention_layers:
        raise NotApplicable("needs a model-level scenario with attention layers")
    reference_choice(kv_reference, kv_scenario)  # an engine that refuses first has no pool to size
    one_sequence = one_sequence_bytes(kv_backend, kv_reference, kv_scenario)
    num_blocks, block = _blocks_in_one_sequence(kv_scenario, one_sequence)
    length = kv_scenario.runtime.max_model_len
    assert num_blocks * block >= length, (
        f"{one_sequence} B buy {num_blocks} blocks of {block} tokens: {num_blocks * block} < {length} tokens"
    )
    cache_k, cache_v, table, keys, values = _write_and_read_back(kv_scenario, num_blocks, block)
    if model.attention.kind != "mla":
        _attention_matches_dense(model.dtype, cache_k, cache_v, table, keys, values)


def _write_and_read_back(scenario: Scenario, num_blocks: int, block: int) -> tuple[Any, ...]:
    """Every token's K and V (for MLA its one latent, no separate V) written through the slot
    mapping into a pool of ``num_blocks`` blocks, then read back through the block table: each
    must come back unchanged and in order. Returns (K cache, V cache, block table, K, V), the
    rows as exact float32."""
    import mlx.core as mx
    import numpy as np

    from pytest_kvconform.metal_runtime import reshape_and_cache

    model, length = scenario.model, scenario.runtime.max_model_len
    assert model is not None and model.attention is not None
    dtype = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}[model.dtype]
    table, slots = _sequence_layout(num_blocks, block, length)
    rng = np.random.default_rng(0)
    keys = _token_rows(rng, length)
    values = keys if model.attention.kind == "mla" else _token_rows(rng, length)
    empty = mx.zeros((num_blocks, block, 1, _ROW_WIDTH), dtype=dtype)
    cache_k, cache_v = reshape_and_cache(keys.astype(dtype), values.astype(dtype), empty, empty, slots)
    for name, cache, rows in (("K", cache_k, keys), ("V", cache_v, values)):
        read = cache[mx.array(table)].reshape(len(table) * block, 1, _ROW_WIDTH)[:length]
        assert mx.array_equal(read.astype(mx.float32), rows).item(), (
            f"{name} of {length} tokens does not read back through the block table {table[:4]}..."
        )
    return cache_k, cache_v, table, keys, values


def _sequence_layout(num_blocks: int, block: int, length: int) -> tuple[list[int], Any]:
    """The sequence's block table (blocks in reverse order, so it really is a permutation) and the
    slot of each token (``slot = block_id * block_size + offset``)."""
    import mlx.core as mx
    import numpy as np

    table = list(range(num_blocks - 1, -1, -1))
    positions = np.arange(length)
    slots = np.array(table)[positions // block] * block + positions % block
    return table[: -(-length // block)], mx.array(slots, dtype=mx.int64)


def _token_rows(rng: Any, length: int) -> Any:
    """``[length, 1, _ROW_WIDTH]`` float32 values: multiples of 1/64 in [-2, 2) from random bytes,
    so exact in bfloat16 and float16 (7 significant bits) and about the spread of unit normals
    (a query-key score has std ~1.3 after 1/sqrt(d)); standard normals cost 4x as much to draw."""
    import mlx.core as mx
    import numpy as np

    raw = np.frombuffer(rng.bytes(length * _ROW_WIDTH), dtype=np.int8).reshape(length, 1, _ROW_WIDTH)
    return mx.array(raw).astype(mx.float32) * (1 / 64)


def _attention_matches_dense(
    model_dtype: str, cache_k: Any, cache_v: Any, table: list[int], keys: Any, values: Any
) -> None:
    """A decode query's paged attention over the sequence's block table equals the dense oracle
    over the same tokens."""
    import mlx.core as mx
    import numpy as np

    from pytest_kvconform.metal_runtime import DTYPE_TOLERANCES, dense_attention, paged_attention_logical

    length = keys.shape[0]
    query = mx.array(np.random.default_rng(1).standard_normal((1, 2, _ROW_WIDTH), dtype=np.float32))
    query = query.astype(cache_k.dtype)
    scale = 1 / math.sqrt(_ROW_WIDTH)
    cu = mx.array([0, 1], dtype=mx.int32)
    out = paged_attention_logical(
        query, cache_k, cache_v, [table], mx.array([length], dtype=mx.int32), cu, scale=scale, num_kv_heads=1,
    )  # fmt: skip
    expected = dense_attention(query, [keys], [values], cu, scale=scale)
    atol, rtol = DTYPE_TOLERANCES[model_dtype]
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), expected, atol=atol, rtol=rtol)


def _reference_plan(kv_backend: Any, kv_reference: Any, scenario: Scenario) -> tuple[Any, Scenario]:
    """The reference's plan to allocate, once the backend is known to allocate for ``scenario``,
    and the scenario as the backend serves it (at its kernel's block alignment, which the
    reference plans at too); a plan the reference rejects has nothing to allocate."""
    decline_if_declared(kv_backend, "allocation", scenario)
    scenario = served(kv_backend, scenario)
    answer = outcome(kv_reference, "plan", scenario=scenario)
    if answer[0] != "ok":
        raise NotApplicable(f"the reference rejects the plan ({answer[1]}): no pool to allocate")
    if not answer[1].kv_cache_groups:
        raise NotApplicable(
            "no KV cache groups: the engine allocates no tensor (its one block is the null block)"
        )
    return answer[1], scenario


def _pool(allocation: Any) -> dict[str, int]:
    """What a pool holds, as compared: the bytes held first (a pool short of a block says so)."""
    return {"num_blocks": allocation.num_blocks, "bytes_held": allocation.bytes_held,
            "bytes_per_block": allocation.bytes_per_block}  # fmt: skip


@pytest.mark.kvconform_rule("allocation")
def test_pool_holds_exactly_the_planned_blocks(
    kv_backend: Any, kv_reference: Any, kv_scenario: Scenario
) -> None:
    """The backend allocates the reference's plan at a few blocks (the full pool is gigabytes):
    what it holds (each storage once) is ``num_blocks * bytes_per_block``, and its bytes per block
    are the plan's."""
    plan, kv_scenario = _reference_plan(kv_backend, kv_reference, kv_scenario)
    num_blocks = 3
    expected = kv_reference.allocate_kv_cache(plan, num_blocks, scenario=kv_scenario)
    got = call_rule(kv_backend, "allocate_kv_cache", plan, num_blocks, scenario=kv_scenario)
    assert_same("allocation", kv_backend, kv_scenario, _pool(expected), _pool(got))


@pytest.mark.kvconform_rule("allocation")
def test_config_larger_than_the_pool_is_rejected(
    kv_backend: Any, kv_reference: Any, kv_scenario: Scenario
) -> None:
    """vllm-metal#527: an engine KV cache config may use the pool's blocks or fewer, never more
    (``--num-gpu-blocks-override 999999`` against 1846 allocated oversubscribed 541x): the backend
    accepts 2 and 3 blocks of a pool of 3 and rejects 4 as the reference does (``oversized_config``)."""
    plan, kv_scenario = _reference_plan(kv_backend, kv_reference, kv_scenario)
    allocation = call_rule(kv_backend, "allocate_kv_cache", plan, 3, scenario=kv_scenario)
    for requested in (2, 3, 4):
        key = f"check_kv_cache_config({requested} of 3 blocks)"
        expected = _guard(
            outcome(kv_reference, "check_kv_cache_config", allocation, requested, scenario=kv_scenario)
        )
        got = _guard(
            outcome(kv_backend, "check_kv_cache_config", allocation, requested, scenario=kv_scenario)
        )
        assert_same("allocation", kv_backend, kv_scenario, {key: expected}, {key: got})


def _guard(answer: tuple[str, Any]) -> str:
    """A guard's outcome as compared: ``accepts`` or ``rejects: <kind>``."""
    return "accepts" if answer[0] == "ok" else f"rejects: {answer[1]}"
