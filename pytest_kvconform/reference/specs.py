"""KV cache specs: page bytes and max memory per request.

Mirrors ``vllm/v1/kv_cache_interface.py`` of vLLM 0.33.0: ``AttentionSpec`` and its
subclasses (``FullAttentionSpec``, ``SlidingWindowSpec``, ``ChunkedLocalAttentionSpec``,
``CrossAttentionSpec``, ``MLAAttentionSpec``) and ``MambaSpec``. One frozen dataclass per
family; the ``kind`` field names the vLLM class.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..scenario import RuntimeSettings
from .dtypes import DTYPE_SIZE

ATTENTION_SPEC_KINDS = ("full_attention", "sliding_window", "chunked_local", "cross_attention", "mla")


def cdiv(a: int, b: int) -> int:
    """``vllm.utils.math_utils.cdiv``."""
    return -(a // -b)


def round_up(x: int, m: int) -> int:
    """``vllm.utils.math_utils.round_up``."""
    return ((x + m - 1) // m) * m


def _cached_hash(self: AttentionSpec | MambaSpec) -> int:
    """Field hash computed once per (immutable) spec: specs are hashed in every grouping step."""
    try:
        return self.__dict__["_hash"]
    except KeyError:
        h = self.__dict__["_hash"] = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
        return h


@dataclass(frozen=True)
class AttentionSpec:
    """``AttentionSpec`` (kv_cache_interface.py): K+V (or one MLA latent) per token and head.

    ``page = num_heads * block_size * C`` with ``C = state_content_bytes`` when a packed
    format sets it, else ``(head_size + head_size_v) * dtype_size``; ``page_size_padded``
    overrides it (and must not be smaller).
    """

    kind: str
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    head_size_v: int | None = None  # None: same as head_size (MLA: 0, no V)
    num_head_slots: int | None = None
    state_content_bytes: int | None = None
    page_size_padded: int | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    cache_role: str = "kv"  # "kv" or "indexer" (DSA lightning-indexer K cache)
    extra_retained_tokens: int = 0  # sliding window: kept below the window (speculative.py)

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_SPEC_KINDS:
            raise ValueError(f"unknown attention spec kind {self.kind!r}")
        if self.page_size_padded is not None:
            assert self.page_size_padded >= self.real_page_size_bytes

    @property
    def is_mla(self) -> bool:
        return self.kind == "mla"

    @property
    def state_content_size_bytes(self) -> int:
        """Bytes per head slot per token (``AttentionSpec.state_content_size_bytes``)."""
        if self.state_content_bytes is not None:
            return self.state_content_bytes
        v = (0 if self.is_mla else self.head_size) if self.head_size_v is None else self.head_size_v
        return (self.head_size + v) * DTYPE_SIZE[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return (self.num_head_slots or self.num_kv_heads) * self.state_content_size_bytes

    @property
    def real_page_size_bytes(self) -> int:
        """``unpadded_page_size_bytes``: ``num_heads * block_size * C``."""
        return self.block_size * self.bytes_per_token

    @property
    def page_size_bytes(self) -> int:
        return _page_size_bytes(self)

    __hash__ = _cached_hash

    def with_block_size(self, block_size: int) -> AttentionSpec:
        return dataclasses.replace(self, block_size=block_size)

    def max_memory_usage_bytes(self, rt: RuntimeSettings) -> int:
        """``max_memory_usage_bytes`` of the spec class named by ``kind``.

        full/MLA: ``cdiv(L', bs) * P`` with ``L' = cdiv(L, dcp)`` (``FullAttentionSpec``: decode
        context parallelism shards the tokens of every attention cache over ``dcp`` ranks);
        sliding window: ``(cdiv(min(sw - 1 + extra + F, L), bs) + 1) * P`` with ``F`` the
        in-flight tokens and ``extra`` the speculative retained tokens
        (``SlidingWindowSpec.max_admission_blocks_per_request``; it asserts ``dcp == 1``);
        chunked local: ``cdiv(min(chunk + F, L), bs) * P``; cross attention:
        ``cdiv(max_num_encoder_input_tokens, bs) * P``, where the encoder budget defaults to
        ``max_num_batched_tokens`` (vllm/config/scheduler.py).
        """
        length, bs, page = rt.max_model_len, self.block_size, self.page_size_bytes
        in_flight = rt.max_concurrent_batches * rt.max_num_batched_tokens
        if self.kind == "sliding_window":
            assert self.sliding_window is not None
            if rt.decode_context_parallel_size > 1:
                raise ValueError("DCP not support sliding window.")
            retained = self.sliding_window - 1 + self.extra_retained_tokens + in_flight
            return (cdiv(min(retained, length), bs) + 1) * page
        if self.kind == "chunked_local":
            assert self.attention_chunk_size is not None
            return cdiv(min(self.attention_chunk_size + in_flight, length), bs) * page
        if self.kind == "cross_attention":
            return cdiv(rt.max_num_batched_tokens, bs) * page
        return cdiv(cdiv(length, rt.decode_context_parallel_size), bs) * page


@dataclass(frozen=True)
class MambaSpec:
    """``MambaSpec`` (kv_cache_interface.py): one state page per request, independent of block size."""

    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    kind: str = "mamba"

    def __post_init__(self) -> None:
        if self.page_size_padded is not None:
            assert self.page_size_padded >= self.real_page_size_bytes

    @property
    def real_page_size_bytes(self) -> int:
        """``sum(prod(shape) * dtype_size)`` over the state tensors."""
        return sum(math.prod(s) * DTYPE_SIZE[d] for s, d in zip(self.shapes, self.dtypes, strict=True))

    @property
    def page_size_bytes(self) -> int:
        return _page_size_bytes(self)

    __hash__ = _cached_hash

    def with_block_size(self, block_size: int) -> MambaSpec:
        return dataclasses.replace(self, block_size=block_size)

    def max_memory_usage_bytes(self, rt: RuntimeSettings) -> int:
        """``align``: ``P * (2 + spec + checkpoint)``; ``all`` (vLLM 0.23 ... 0.31): a state per
        block, ``P * (cdiv(max_model_len, block) + spec)``; otherwise ``P * (1 + spec)``.

        Like vLLM it reads the cache mode from the runtime (``cache_config``), not the spec.
        """
        if rt.mamba_cache_mode == "all":
            extra = -(-rt.max_model_len // self.block_size) + self.num_speculative_blocks
        elif rt.mamba_cache_mode == "align":
            extra = 2 + self.num_speculative_blocks + self.num_prefill_checkpoint_blocks
        else:
            extra = 1 + self.num_speculative_blocks
        return self.page_size_bytes * extra


KVCacheSpec = AttentionSpec | MambaSpec


def _page_size_bytes(spec: KVCacheSpec) -> int:
    """``page_size_bytes``: the padded page, else the real one; computed once per (immutable) spec
    object and kept on it (a plan reads it for every layer of every group)."""
    page: int | None = spec.__dict__.get("_page_size_bytes")
    if page is None:
        page = spec.page_size_padded if spec.page_size_padded is not None else spec.real_page_size_bytes
        spec.__dict__["_page_size_bytes"] = page
    return page
