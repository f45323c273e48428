"""Plain result types shared by the reference and every backend.

Everything here is a frozen dataclass of integers, floats and strings, so a
:class:`KVPlan` compares field by field and snapshots cleanly. Standard library only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HybridAlignment:
    """Outcome of ``Platform._align_hybrid_block_size`` (vllm/platforms/interface.py)."""

    block_size: int
    attn_page_bytes_per_token: int
    state_page_bytes: int
    page_size_bytes: int  # block_size * attn_page_bytes_per_token
    state_page_padded_bytes: int | None  # None when the pages were already equal
    min_block_size: float  # state_page / attn_page_bytes_per_token (the unaligned minimum)

    @property
    def padding_pct(self) -> float:
        """``100 * (attn_page - mamba) / mamba``, as vLLM's "Padding mamba page size by" log."""
        if self.state_page_bytes == 0:
            return 0.0
        return 100 * (self.page_size_bytes - self.state_page_bytes) / self.state_page_bytes


@dataclass(frozen=True)
class BlockChoice:
    """The cache config after ``Platform.update_block_size_for_backend`` (vllm/platforms/
    interface.py): the attention block, the Mamba block and the padded state page."""

    block_size: int
    mamba_block_size: int  # the attention block in align mode, else max_model_len
    state_page_padded: int | None = None  # None: the state page is not padded
    #: ``cache_config.skip_page_size_padded`` (Phase 3, ``_align_heterogeneous_kv_block_size``):
    #: the shared page sliding-window layers pad to; None: no Phase 3 padding
    skip_page_size_padded: int | None = None


@dataclass(frozen=True)
class PoolAllocation:
    """What a backend that really allocates a KV cache pool holds for a planned config."""

    num_blocks: int
    bytes_per_block: int
    bytes_held: int
    #: the backend's own pool object, for its ``check_kv_cache_config`` (not compared)
    handle: Any = dataclasses.field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV cache group (``KVCacheGroupSpec``): a spec kind, its block and its layers."""

    kind: str  # spec kind of its layers, or "uniform_type" (UniformTypeKVCacheSpecs)
    block_size: int
    page_size_bytes: int  # the group spec's page; for "uniform_type", the sum over its layers
    layer_names: tuple[str, ...]
    bytes_per_block: int  # what one block id costs this group: the sum of its layers' pages
    blocks_per_request: int  # blocks one max_model_len request needs in this group


@dataclass(frozen=True)
class KVCacheTensorPlacement:
    """One ``KVCacheTensor`` of the pool: its layers, the bytes of the backing allocation, and
    where layer ``l``'s block ``b`` begins in it (``offset + l * layer_stride + b * block_stride``);
    ``page_shape`` is one layer's page as its views see it: heads, states (tokens) and bytes per
    cell (``num_heads``, ``num_states``, ``state_content_size_bytes``; vLLM 0.29+). Before 0.29 a
    tensor (``KVCacheTensor(size, shared_by)``) is its layers' alone: each at byte 0 (layer stride
    0), a block a page, and no page shape (None)."""

    layers: tuple[str, ...]
    size: int
    offset: int
    layer_stride: int
    block_stride: int
    page_shape: tuple[int, int, int] | None


@dataclass(frozen=True)
class KVCacheView:
    """One layer's KV cache as its kernel reads it (vLLM 0.29+, ``create_kv_cache_views``): the
    ``[B, H, N, C]`` view of the backing allocation (blocks, heads, states, cell content) in
    elements of ``dtype`` (the spec's; bytes, ``int8``, for a state layer, whose spec has none):
    its shape, strides and storage offset. Before 0.29 the shape is the attention backend's
    (``get_kv_cache_shape``), and a state layer has one view per state tensor (``<layer>[i]``)."""

    layer: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class MemoryCheck:
    """``get_kv_cache_configs`` + ``_check_enough_kv_cache_memory`` for one worker."""

    bytes_per_block: int
    num_blocks: int  # available // bytes_per_block, or the override; includes the null block
    needed_bytes: int  # bytes_per_block * sum of blocks_per_request over groups
    available_bytes: int  # what the check sees: available - bytes_per_block (null block)
    admission: str  # "ok" or vLLM's exact error text
    max_model_len_estimate: int  # largest max_model_len that fits `available_bytes` (0: none)
    #: ``get_max_concurrency_for_kv_cache_config``: num_blocks / blocks one request needs (0: none)
    max_concurrency: float = 0.0
    #: the ``max_model_len`` ``_auto_fit_max_model_len`` left (``max_model_len = -1``); None: no auto-fit
    max_model_len: int | None = None
    #: the text ``_auto_fit_max_model_len`` logged ("": no auto-fit, or it raised)
    auto_fit: str = ""


@dataclass(frozen=True)
class KVPlan:
    """Everything a backend decides about one scenario, as plain values."""

    scenario: str
    unify_policy: str
    block_size: int
    kernel_block_size: int
    kernel_blocks_per_block: int
    attn_bytes_per_token_per_layer: int
    indexer_bytes_per_token_per_layer: int
    state_bytes_per_layer: int
    page_size_bytes: int
    state_padding_pct: float
    kv_cache_groups: int
    group_size: int
    bytes_per_block: int
    kv_bytes_per_token: int
    blocks_per_request: int
    num_blocks: int
    max_concurrency: float
    one_sequence_tokens: int
    one_sequence_bytes: int
    needed_bytes: int
    available_bytes: int
    admission: str
    max_model_len_estimate: int
    group_kinds: tuple[str, ...] = ()
    #: ``max_model_len = -1``: the length ``_auto_fit_max_model_len`` chose (0: no auto-fit)
    auto_fit_max_model_len: int = 0
    #: ... and the text it logged ("": no auto-fit)
    auto_fit_message: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["group_kinds"] = list(self.group_kinds)
        for name in _ONLY_WHEN_SET:  # absent from the records (goldens) of plans without auto-fit
            if not d[name]:
                del d[name]
        return d

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


#: :class:`KVPlan` fields :meth:`KVPlan.to_dict` leaves out while they hold their default.
_ONLY_WHEN_SET = ("auto_fit_max_model_len", "auto_fit_message")
