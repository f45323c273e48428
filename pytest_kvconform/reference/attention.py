"""Attention page bytes per token: K+V, MLA latents, indexer caches and packed formats.

Mirrors the ``state_content_bytes`` / ``num_head_slots`` each vLLM 0.33.0 layer or backend
sets (``customize_spec``), see notes section 4:

* default (FlashAttention, Triton, FlashInfer): ``num_kv_heads * (D + Dv) * dtype_size``;
* MLA (``MLAAttention.get_kv_cache_spec``, mla_attention.py): one latent of
  ``kv_lora_rank + qk_rope_head_dim``, no V; ``fp8_ds_mla`` = 656 B, ``nvfp4_ds_mla`` = 352 B;
* DSA lightning indexer (``DeepseekV32IndexerCache``, deepseek_v2.py): ``D + D // 128 * 4`` uint8;
* TurboQuant (``TurboQuantConfig``, quantization/turboquant/config.py): one packed slot per head;
* ``*_per_token_head`` (triton_attn.py, ``MLACommonBackend.customize_spec``): 8 B of scales;
* FlashInfer ``nvfp4`` (flashinfer.py): ``2 * num_kv_heads`` slots of ``D/2 + D/16`` bytes;
* ``ultraquant_4bit`` (ultraquant/format.py ``slot_size``): ``D + 2 * D / 32``.
"""

from __future__ import annotations

from ..scenario import AttentionGeometry
from .dtypes import DTYPE_SIZE, storage_dtype
from .releases import LATEST, RuleSet
from .specs import AttentionSpec, cdiv

#: ``(key_bits, value_bits)`` of the TurboQuant presets (turboquant/config.py).
TURBOQUANT_PRESETS = {
    "turboquant_k8v4": (8, 4),
    "turboquant_4bit_nc": (4, 4),
    "turboquant_k3v4_nc": (3, 4),
    "turboquant_3bit_nc": (3, 3),
}
#: Packed MLA formats set by the MLA layer itself (mla_attention.py).
MLA_PACKED_BYTES = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}
ULTRAQUANT_GROUP_SIZE = 32


def turboquant_slot_bytes(head_dim: int, kv_cache_dtype: str) -> int:
    """``TurboQuantConfig.slot_size_aligned``: packed K + V bytes of one head, rounded up to even.

    ``key = D`` for 8-bit keys (fp8) else ``ceil(D * kb / 8) + 2``; ``value = ceil(D * vb / 8) + 4``.
    """
    key_bits, value_bits = TURBOQUANT_PRESETS[kv_cache_dtype]
    key = head_dim if key_bits == 8 else cdiv(head_dim * key_bits, 8) + 2
    value = cdiv(head_dim * value_bits, 8) + 4
    slot = key + value
    return slot + slot % 2


def indexer_head_size(indexer_head_dim: int) -> int:
    """DSA indexer K cache bytes per token: fp8 keys plus one fp32 scale per 128 (deepseek_v2.py)."""
    return indexer_head_dim + indexer_head_dim // 128 * 4


def attention_spec(
    geometry: AttentionGeometry,
    *,
    kind: str,
    block_size: int,
    kv_cache_dtype: str,
    model_dtype: str,
    tensor_parallel_size: int = 1,
    registered_dtypes: tuple[tuple[str, str], ...] = (),
    release: RuleSet = LATEST,
) -> AttentionSpec:
    """The spec one attention layer reports (``Attention``/``MLAAttention.get_kv_cache_spec``
    followed by the backend's ``customize_spec``), for ``kind`` full/sliding/chunked/cross.

    Before ``sliding_window_packed_formats`` (vLLM 0.28, when every spec first went through
    ``customize_spec``) only full attention has the TurboQuant slot (``TQFullAttentionSpec``):
    the other kinds store ``(D + Dv)`` uint8 per head, and ``SlidingWindowSpec.real_page_size_bytes``
    does not halve ``int4_per_token_head``."""
    dtype = storage_dtype(kv_cache_dtype, model_dtype, registered_dtypes, release)
    if geometry.kind == "mla":
        head = geometry.kv_lora_rank + geometry.qk_rope_head_dim
        content: int | None = MLA_PACKED_BYTES.get(kv_cache_dtype)
        if kv_cache_dtype.endswith("_per_token_head"):
            content = (head // 2 if kv_cache_dtype.startswith("int4") else head) * DTYPE_SIZE[dtype] + 8
        return AttentionSpec(
            kind="mla" if kind == "full_attention" else kind, block_size=block_size, num_kv_heads=1,
            head_size=head, head_size_v=0, dtype=dtype, state_content_bytes=content,
            sliding_window=geometry.sliding_window if kind == "sliding_window" else None,
            attention_chunk_size=geometry.attention_chunk_size if kind == "chunked_local" else None,
        )  # fmt: skip
    heads = max(1, geometry.num_kv_heads // tensor_parallel_size)
    d = geometry.head_dim
    dv = d if geometry.head_dim_v is None else geometry.head_dim_v
    slots: int | None = None
    content = None
    packed = kind == "full_attention" or release.has("sliding_window_packed_formats")
    if kv_cache_dtype in TURBOQUANT_PRESETS:
        content = turboquant_slot_bytes(d, kv_cache_dtype) if packed else None
    elif kv_cache_dtype.endswith("_per_token_head"):
        half = kv_cache_dtype.startswith("int4") and (packed or kind != "sliding_window")
        content = ((d // 2 if half else d) + (dv // 2 if half else dv)) * DTYPE_SIZE[dtype] + 2 * 4
    elif kv_cache_dtype in ("nvfp4", "nvfp4_4over6"):
        if d != dv:
            raise ValueError("FlashInfer nvfp4 KV cache needs head_size == head_size_v")
        slots, content = 2 * heads, d // 2 + d // 16
    elif kv_cache_dtype == "ultraquant_4bit":
        content = d + 2 * d // ULTRAQUANT_GROUP_SIZE
    elif kv_cache_dtype.startswith("octave_"):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is a ROCm-specific packed format; not modelled")
    return AttentionSpec(
        kind=kind, block_size=block_size, num_kv_heads=heads, head_size=d,
        head_size_v=None if dv == d else dv, dtype=dtype, num_head_slots=slots,
        state_content_bytes=content,
        sliding_window=geometry.sliding_window if kind == "sliding_window" else None,
        attention_chunk_size=geometry.attention_chunk_size if kind == "chunked_local" else None,
    )  # fmt: skip


def indexer_spec(geometry: AttentionGeometry, *, block_size: int) -> AttentionSpec:
    """The DSA lightning-indexer K cache: an ``MLAAttentionSpec`` of uint8 (``cache_role=INDEXER``)."""
    return AttentionSpec(
        kind="mla", block_size=block_size, num_kv_heads=1,
        head_size=indexer_head_size(geometry.indexer_head_dim), head_size_v=0, dtype="uint8",
        cache_role="indexer",
    )  # fmt: skip


def attention_bytes_per_token(spec: AttentionSpec) -> int:
    """Page bytes of one token of one layer (the spec at ``block_size=1``)."""
    return spec.with_block_size(1).real_page_size_bytes
