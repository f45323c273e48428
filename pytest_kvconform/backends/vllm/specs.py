"""Neutral specs to vLLM's ``KVCacheSpec`` classes and back, and the per-spec rules.

vLLM code: the spec classes of ``vllm/v1/kv_cache_interface.py`` (``FullAttentionSpec``,
``SlidingWindowSpec``, ``ChunkedLocalAttentionSpec``, ``CrossAttentionSpec``,
``MLAAttentionSpec``, ``MambaSpec``; ``page_size_bytes``, ``max_memory_usage_bytes``),
``kv_cache_dtype_str_to_dtype`` / ``get_dtype_size`` (vllm/utils/torch_utils.py) and
``MLAAttention.get_kv_cache_spec`` (vllm/model_executor/layers/attention/mla_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...reference.specs import AttentionSpec, KVCacheSpec, MambaSpec
from ...scenario import RuntimeSettings
from .api import cache_role, construct, state_content_bytes
from .config_view import ModelConfigStandIn, VllmConfigView, base_config, spec_level_config
from .runtime import UnsupportedByVllmError, dtype_name, installed_vllm_version, torch_dtype, vllm_runtime

MAMBA_TYPES = {"mamba1": "MAMBA1", "mamba2": "MAMBA2", "gdn": "GDN_ATTN", "kda": "GDN_ATTN",
               "short_conv": "SHORT_CONV"}  # fmt: skip
_STATE_KINDS = {"MAMBA1": "mamba1", "MAMBA2": "mamba2", "GDN_ATTN": "gdn", "SHORT_CONV": "short_conv",
                "LINEAR": "linear"}  # fmt: skip


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    """``get_dtype_size(kv_cache_dtype_str_to_dtype(kv_cache_dtype, model_config))``."""
    vllm_runtime()
    from vllm.utils.torch_utils import get_dtype_size, kv_cache_dtype_str_to_dtype

    model_config = ModelConfigStandIn(max_model_len=1, dtype=torch_dtype(model_dtype))
    try:
        dtype = kv_cache_dtype_str_to_dtype(kv_cache_dtype, model_config)
    except KeyError:  # e.g. the octave_* formats are newer than vLLM 0.32
        raise UnsupportedByVllmError(
            "release_lacks", f"vLLM {installed_vllm_version()} has no kv_cache_dtype {kv_cache_dtype!r}"
        ) from None
    return int(get_dtype_size(dtype))


def to_vllm_spec(spec: KVCacheSpec, *, kv_cache_dtype: str | None = None) -> Any:
    """The vLLM ``KVCacheSpec`` for a neutral spec (``kind`` names the vLLM class).

    Packed formats keep the neutral ``state_content_bytes`` / ``num_head_slots`` as the
    layer or backend would have set them. ``kv_cache_dtype`` (the ``--kv-cache-dtype``
    string) fills ``kv_quant_mode`` and MLA's ``cache_dtype_str``; without it MLA gets
    ``cache_dtype_str=None``. For an MLA spec built the way the MLA layer builds it, use
    :func:`mla_layer_spec`.
    """
    kci = vllm_runtime().kv_cache_interface
    if isinstance(spec, MambaSpec):
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

        return construct(
            kci.MambaSpec,
            block_size=spec.block_size, shapes=tuple(tuple(s) for s in spec.shapes),
            dtypes=tuple(torch_dtype(d) for d in spec.dtypes), page_size_padded=spec.page_size_padded,
            mamba_type=getattr(MambaAttentionBackendEnum, MAMBA_TYPES.get(spec.mamba_type, "MAMBA2")),
            num_speculative_blocks=spec.num_speculative_blocks,
            num_prefill_checkpoint_blocks=spec.num_prefill_checkpoint_blocks,
        )  # fmt: skip
    common: dict[str, Any] = dict(
        block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
        dtype=torch_dtype(spec.dtype), page_size_padded=spec.page_size_padded,
        num_head_slots=spec.num_head_slots, state_content_bytes=spec.state_content_bytes,
    )  # fmt: skip
    if kv_cache_dtype is not None:
        common["kv_quant_mode"] = kci.get_kv_quant_mode(kv_cache_dtype)
    if spec.kind == "mla":
        mla: dict[str, Any] = {"head_size_v": 0 if spec.head_size_v is None else spec.head_size_v}
        if hasattr(kci, "SparseCacheRole"):  # vLLM 0.30+; before, the indexer's spec has no dtype string
            indexer = spec.cache_role == "indexer"
            mla["cache_role"] = kci.SparseCacheRole.INDEXER if indexer else kci.SparseCacheRole.SPARSE
            mla["cache_dtype_str"] = kv_cache_dtype
        elif spec.cache_role != "indexer":
            mla["cache_dtype_str"] = kv_cache_dtype
        return construct(kci.MLAAttentionSpec, **common, **mla)
    common["head_size_v"] = spec.head_size_v
    if spec.kind == "full_attention":
        return construct(kci.FullAttentionSpec, **common)
    if spec.kind == "sliding_window":
        return construct(kci.SlidingWindowSpec, **common, sliding_window=spec.sliding_window)
    if spec.kind == "chunked_local":
        return construct(
            kci.ChunkedLocalAttentionSpec, **common, attention_chunk_size=spec.attention_chunk_size
        )
    if spec.kind == "cross_attention":
        return construct(kci.CrossAttentionSpec, **common)
    raise ValueError(f"unknown attention spec kind {spec.kind!r}")


def spec_kind(vllm_spec: Any) -> str:
    """The neutral ``kind`` of a vLLM spec class (``uniform_type`` for ``UniformTypeKVCacheSpecs``)."""
    kci = vllm_runtime().kv_cache_interface
    for cls_name, kind in (
        ("UniformTypeKVCacheSpecs", "uniform_type"), ("MambaSpec", "mamba"), ("MLAAttentionSpec", "mla"),
        ("SlidingWindowSpec", "sliding_window"), ("ChunkedLocalAttentionSpec", "chunked_local"),
        ("CrossAttentionSpec", "cross_attention"), ("FullAttentionSpec", "full_attention"),
    ):  # fmt: skip
        cls = getattr(kci, cls_name, None)
        if cls is not None and isinstance(vllm_spec, cls):
            return kind
    raise TypeError(
        f"{type(vllm_spec).__qualname__} is no KVCacheSpec class the harness compares (a subclass of "
        "vLLM's FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, CrossAttentionSpec, "
        "MLAAttentionSpec, MambaSpec or UniformTypeKVCacheSpecs)"
    )


def from_vllm_spec(vllm_spec: Any, template: KVCacheSpec | None = None, layer: Any = None) -> KVCacheSpec:
    """The neutral spec of a vLLM spec. ``template`` supplies what vLLM does not carry
    (the state kind of a GDN-backed layer: ``gdn`` or ``kda``)."""
    kind = spec_kind(vllm_spec)
    if kind == "mamba":
        state_kind = _STATE_KINDS.get(vllm_spec.mamba_type.name, vllm_spec.mamba_type.name.lower())
        if isinstance(template, MambaSpec):
            state_kind = template.mamba_type
        return MambaSpec(
            block_size=vllm_spec.block_size,
            shapes=tuple(tuple(int(d) for d in s) for s in vllm_spec.shapes),
            dtypes=tuple(dtype_name(d) for d in vllm_spec.dtypes),
            page_size_padded=vllm_spec.page_size_padded,
            mamba_type=state_kind, num_speculative_blocks=vllm_spec.num_speculative_blocks,
            num_prefill_checkpoint_blocks=getattr(vllm_spec, "num_prefill_checkpoint_blocks", 0),
        )  # fmt: skip
    if kind == "uniform_type":
        raise TypeError("UniformTypeKVCacheSpecs holds several specs; convert its kv_cache_specs")
    head_size_v = vllm_spec.head_size_v
    if kind != "mla" and head_size_v == vllm_spec.head_size:
        head_size_v = None
    role = cache_role(vllm_spec, layer)
    return AttentionSpec(
        kind=kind, block_size=vllm_spec.block_size, num_kv_heads=vllm_spec.num_kv_heads,
        head_size=vllm_spec.head_size, dtype=dtype_name(vllm_spec.dtype), head_size_v=head_size_v,
        num_head_slots=getattr(vllm_spec, "num_head_slots", None),
        state_content_bytes=state_content_bytes(vllm_spec),
        page_size_padded=vllm_spec.page_size_padded,
        sliding_window=getattr(vllm_spec, "sliding_window", None),
        attention_chunk_size=getattr(vllm_spec, "attention_chunk_size", None),
        cache_role=role,
    )  # fmt: skip


def mla_layer_spec(
    kv_cache_dtype: str, head_size: int, block_size: int, model_dtype: str = "bfloat16"
) -> Any:
    """The spec vLLM's MLA layer reports: ``MLAAttention.get_kv_cache_spec`` on a stand-in
    layer, so ``state_content_bytes`` (656 for ``fp8_ds_mla``, 352 for ``nvfp4_ds_mla``)
    comes from the layer's own table rather than from ``cache_dtype_str``."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layer = _MLALayerStandIn(kv_cache_dtype=kv_cache_dtype, head_size=head_size)
    base = base_config(RuntimeSettings(block_size=block_size, user_specified_block_size=True))
    # before 0.26 the layer reads the engine's --kv-cache-dtype, not its own kv_cache_dtype
    base.cache_config.cache_dtype = kv_cache_dtype
    config = VllmConfigView(
        base, ModelConfigStandIn(max_model_len=1, dtype=torch_dtype(model_dtype)), max_concurrent_batches=1
    )
    return MLAAttention.get_kv_cache_spec(layer, config)  # type: ignore[arg-type]


@dataclass
class _MLALayerStandIn:
    """The attributes ``MLAAttention.get_kv_cache_spec`` reads from the layer."""

    kv_cache_dtype: str
    head_size: int
    sliding_window: int | None = None
    indexer: Any = None
    non_causal_multi_token_decode: bool = False
    topk_buffer_width: int | None = None  # read by vLLM 0.33


# --------------------------------------------------------------------------- the config view


def page_size_bytes(spec: KVCacheSpec) -> int:
    """``<vLLM spec>.page_size_bytes``."""
    return int(to_vllm_spec(spec).page_size_bytes)


def max_memory_usage_bytes(spec: KVCacheSpec, rt: RuntimeSettings) -> int:
    """``<vLLM spec>.max_memory_usage_bytes(vllm_config)``."""
    return int(to_vllm_spec(spec).max_memory_usage_bytes(spec_level_config(rt)))
