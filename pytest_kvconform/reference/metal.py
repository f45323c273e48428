"""The sizing rules vllm-metal computes itself (vllm-project/vllm-metal @ 211a1e4).

* ``_pick_kernel_block_size`` / ``_build_block_tables`` (attention/impls/sdpa.py): the Metal
  kernel has block sizes 8, 16 and 32 only; a larger logical block is split into
  ``block_size // kernel_block`` kernel blocks (PR #235).
* ``estimate_one_sequence_kv_bytes`` (v1/cache_policy.py): the bytes one max-length sequence
  needs, over the block-aligned token count (PR #229), MLA at one latent (PR #233), GDN
  recurrent state in fp32 (PR #243), padded state pages when set (PR #575).
* ``turboquant_page_size_bytes`` (v1/cache_policy.py): vllm-metal's own TurboQuant page,
  which differs from vLLM's ``slot_size_aligned`` packing.
* ``ModelCachePolicy.initialize_kv_cache`` (v1/cache_policy.py): the guard against an engine KV
  cache config larger than the allocated pool (PR #527).
* ``MetalPagedKVCache`` / ``MLAPagedLatentCache`` (attention/caches/) and ``sdpa_forward``: the
  layout of each cache the kernel reads (:func:`kernel_cache_views`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..model import KVCacheView
from ..scenario import Scenario
from .dtypes import DTYPE_SIZE, mamba_dtypes
from .mamba import state_shapes
from .specs import AttentionSpec, KVCacheSpec, cdiv

KERNEL_BLOCK_SIZES = (32, 16, 8)

#: vllm-metal ``QUANT_PARAMS`` / ``V_QUANT_PARAMS`` bits (attention/caches/turboquant.py).
METAL_K_QUANT_BITS = {"q8_0": 8, "int8": 8, "uint8": 8, "q5_0": 5, "q4_0": 4, "int4": 4, "uint4": 4,
                      "int2": 2, "uint2": 2}  # fmt: skip
METAL_V_QUANT_BITS = {"q2_0": 2, "q3_0": 3, "q4_0": 4, "q5_0": 5, "q8_0": 8}
METAL_TQ_SCALE_GROUP = 32


def pick_kernel_block_size(cache_block_size: int) -> int:
    """``_pick_kernel_block_size``: the largest of 32, 16, 8 that divides the cache block."""
    for kbs in KERNEL_BLOCK_SIZES:
        if cache_block_size % kbs == 0:
            return kbs
    raise ValueError(
        f"Cache block_size={cache_block_size} is not divisible by any supported kernel block size "
        f"{KERNEL_BLOCK_SIZES}. Adjust --block-size (must be a multiple of 8)."
    )


def build_block_tables(rows: Sequence[Sequence[int]], cache_block_size: int) -> tuple[list[list[int]], int]:
    """``_build_block_tables``: zero-pad the rows, then expand block ``b`` to
    ``b * ratio + [0, ratio)`` kernel blocks. Returns ``(table, kernel_block_size)``."""
    if not rows:
        return [], cache_block_size
    width = max(len(r) for r in rows)
    padded = [list(r) + [0] * (width - len(r)) for r in rows]
    if cache_block_size in KERNEL_BLOCK_SIZES:
        return padded, cache_block_size
    kernel = pick_kernel_block_size(cache_block_size)
    ratio = cache_block_size // kernel
    return [[b * ratio + j for b in row for j in range(ratio)] for row in padded], kernel


def kernel_cache_views(specs: Mapping[str, KVCacheSpec], num_blocks: int) -> tuple[KVCacheView, ...]:
    """Each paged layer's caches as the Metal kernel reads them, as ``[B, H, N, C]`` views (B
    blocks, H heads, N tokens, C elements of a head's row) of arrays of their own (offset 0).

    An attention layer has a K and a V cache, each ``[num_blocks, block_size, kv_heads, head_dim]``
    in the layer's dtype (``MetalPagedKVCache``, attention/caches/kv_cache.py): token-major, a
    token ``kv_heads * head_dim`` elements from the next. ``sdpa_forward`` (attention/impls/sdpa.py,
    PR #235) hands the kernel both reshaped to kernel blocks, ``[num_blocks * r, kbs, kv_heads,
    head_dim]`` with ``kbs`` :func:`pick_kernel_block_size` and ``r = block_size // kbs``; V takes
    its own head size. An MLA layer has one latent ``[num_blocks, block_size, kv_lora_rank +
    rope_dim]`` (``MLAPagedLatentCache``; its kernel takes the block whole), one head. State
    layers keep slot caches the kernel does not page: they have no view here.
    """
    views = []
    for name, spec in specs.items():
        if not isinstance(spec, AttentionSpec):
            continue
        if spec.is_mla:
            caches, heads, block = (("latent_cache", spec.head_size),), 1, spec.block_size
        else:
            head_size_v = spec.head_size if spec.head_size_v is None else spec.head_size_v
            caches = (("key_cache", spec.head_size), ("value_cache", head_size_v))
            heads, block = spec.num_kv_heads, pick_kernel_block_size(spec.block_size)
        blocks = num_blocks * (spec.block_size // block)
        for cache, width in caches:
            shape = (blocks, heads, block, width)
            views.append(KVCacheView(f"{name}.{cache}", spec.dtype, shape,
                                     (block * heads * width, width, heads * width, 1), 0))  # fmt: skip
    return tuple(views)


def oversized_config_error(requested: int, allocated: int) -> str:
    """The over-allocation guard of ``ModelCachePolicy.initialize_kv_cache`` (v1/cache_policy.py,
    PR #527): an engine KV cache config may not ask for more blocks than the Metal pool holds."""
    return (
        f"Engine KV cache config requests {requested} blocks but the Metal paged pool was allocated "
        f"with {allocated}. vllm-metal sizes its pool from available Metal memory and cannot grow it "
        "afterwards. If --num-gpu-blocks-override is set, lower or remove it; otherwise this is a "
        "capacity-accounting bug, please report it."
    )


def one_sequence_tokens(max_model_len: int, block_size: int) -> int:
    """Tokens the scheduler reserves for one sequence: ``cdiv(max_model_len, bs) * bs``."""
    return cdiv(max_model_len, block_size) * block_size


def linear_cache_bytes_per_slot(scenario: Scenario) -> int:
    """``linear_cache_bytes_per_slot`` per state layer: the conv state ``(K - 1, conv_dim)`` in
    its dtype (no speculative rows, no TP split) plus the recurrent state in fp32 (PR #243)."""
    model, rt = scenario.model, scenario.runtime
    assert model is not None and model.state is not None
    conv_shape, *recurrent_shapes = state_shapes(model.state)
    conv_dtype, _ = mamba_dtypes(model.state.kind, model.dtype, rt.mamba_cache_dtype, "float32")
    recurrent = sum(math.prod(shape) for shape in recurrent_shapes) * DTYPE_SIZE["float32"]
    return math.prod(conv_shape) * DTYPE_SIZE[conv_dtype] + recurrent


def one_sequence_kv_bytes(scenario: Scenario, block_size: int, state_page_padded: int | None = None) -> int:
    """``estimate_one_sequence_kv_bytes``: KV of one max-length sequence plus its state.

    Attention layers store the model dtype (vllm-metal never reads ``--kv-cache-dtype``):
    K and V of every KV head, or one latent for MLA. Each state layer adds its padded page
    when the hybrid alignment padded it, else its fp32-recurrent slot.
    """
    model, rt = scenario.model, scenario.runtime
    if model is None:
        raise ValueError(f"{scenario.name}: the one-sequence estimate needs a model-level scenario")
    tokens = one_sequence_tokens(rt.max_model_len, block_size)
    attn = model.attention
    per_token = 0  # summed over the attention layers, each with its own heads (``_kv_layer_size_sum``)
    if attn is not None:
        if attn.kind == "mla":
            per_token = model.num_attention_layers * (attn.kv_lora_rank + attn.qk_rope_head_dim)
        else:
            for code in model.layers:
                if code in "ASLXP":
                    layer = attn.for_layer("full_attention" if code in "AP" else "other")
                    dv = layer.head_dim if layer.head_dim_v is None else layer.head_dim_v
                    per_token += layer.num_kv_heads * (layer.head_dim + dv)
    total = tokens * per_token * DTYPE_SIZE[model.dtype]
    if model.num_state_layers:
        slot = state_page_padded if state_page_padded is not None else linear_cache_bytes_per_slot(scenario)
        total += model.num_state_layers * slot
    return total


def metal_turboquant_page_size_bytes(
    block_size: int, num_kv_heads: int, head_dim: int, k_quant: str, v_quant: str
) -> int:
    """vllm-metal ``turboquant_page_size_bytes``: bit-packed K and V plus three fp16 scale rows
    (K scale, V scale, K zero) per 32-element group."""
    k_bits, v_bits = METAL_K_QUANT_BITS[k_quant], METAL_V_QUANT_BITS[v_quant]
    for bits in (k_bits, v_bits):
        if head_dim * bits % 8:
            raise ValueError(f"head_dim={head_dim} at {bits} bits is not byte aligned")
    kv = block_size * num_kv_heads * (head_dim * k_bits // 8 + head_dim * v_bits // 8)
    scales = 3 * block_size * num_kv_heads * (head_dim // METAL_TQ_SCALE_GROUP) * 2
    return kv + scales
