"""Where each layer's pages sit in the pool: the ``KVCacheTensor`` placement of vLLM 0.32+
(``get_kv_cache_config_from_groups``, vllm/v1/core/kv_cache_utils.py; 0.33 moved it to
vllm/v1/core/kv_cache_planning.py) for a layer-outermost layout, the one the default preference
(LBNHC) and vLLM's CPU attention (LBHNC) resolve.

One backing allocation of ``bytes_per_block * num_blocks`` bytes holds every group; groups alias
it from byte 0 (a block id belongs to one group at a time). Within a group, the layers of one spec
(all of them, or, in a ``UniformTypeKVCacheSpecs`` group, those with equal specs) are one tensor:
its block stride is the layer's padded page, its layer stride ``num_blocks`` pages, and the next
tensor of the group begins where its layers end.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..model import KVCacheTensorPlacement
from .grouping import GroupSpec
from .specs import AttentionSpec, KVCacheSpec


def page_shape(spec: KVCacheSpec) -> tuple[int, int, int]:
    """A page as its layer's views see it (``num_heads``, ``num_states``, ``state_content_size_bytes``):
    an attention page is its KV heads (or head slots) by its block's tokens; a state page is one
    cell of the whole unpadded state (``MambaSpec``: one head, one state)."""
    if isinstance(spec, AttentionSpec):
        return (spec.num_head_slots or spec.num_kv_heads, spec.block_size, spec.state_content_size_bytes)
    return (1, 1, spec.real_page_size_bytes)


def kv_cache_tensors(groups: Sequence[GroupSpec], num_blocks: int) -> tuple[KVCacheTensorPlacement, ...]:
    """The tensors of a pool of ``num_blocks`` blocks, in group order."""
    if not groups:
        return ()
    bytes_per_block = max(sum(spec.page_size_bytes for spec in g.specs) for g in groups)
    size = bytes_per_block * num_blocks
    tensors = []
    for group in groups:
        by_spec: dict[KVCacheSpec, list[str]] = {}
        if group.uniform_type:
            for name, spec in zip(group.layer_names, group.specs, strict=True):
                by_spec.setdefault(spec, []).append(name)
        else:
            by_spec[group.specs[0]] = list(group.layer_names)
        offset = 0
        for spec, names in by_spec.items():
            block_stride = spec.page_size_bytes  # the padded page
            layer_stride = block_stride * num_blocks
            placed = KVCacheTensorPlacement(
                tuple(names), size, offset, layer_stride, block_stride, page_shape(spec)
            )
            tensors.append(placed)
            offset += len(names) * layer_stride
    return tuple(tensors)
