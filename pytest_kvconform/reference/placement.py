"""Where each layer's pages sit in the pool: the ``KVCacheTensor`` placement of vLLM 0.29+
(``get_kv_cache_config_from_groups``, vllm/v1/core/kv_cache_utils.py; 0.33 moved it to
vllm/v1/core/kv_cache_planning.py) for a layer-outermost layout, the one the default preference
(LBNHC) and vLLM's CPU attention (LBHNC) resolve, and each layer's view of it; the one tensor
per layer slot of 0.23 to 0.28 (:func:`kv_cache_tensor_slots`) and, in 0.23 to 0.25, each layer's
view of it through its attention backend (:func:`kv_cache_views_by_backend`).

One backing allocation of ``bytes_per_block * num_blocks`` bytes holds every group; groups alias
it from byte 0 (a block id belongs to one group at a time). Within a group, the layers of one spec
(all of them, or, in a ``UniformTypeKVCacheSpecs`` group, those with equal specs) are one tensor:
its block stride is the layer's padded page, its layer stride ``num_blocks`` pages, and the next
tensor of the group begins where its layers end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..model import KVCacheTensorPlacement, KVCacheView
from ..rejections import Rejected
from .dtypes import DTYPE_SIZE
from .grouping import GroupSpec
from .specs import AttentionSpec, KVCacheSpec, MambaSpec


def page_shape(spec: KVCacheSpec) -> tuple[int, int, int]:
    """A page as its layer's views see it (``num_heads``, ``num_states``, ``state_content_size_bytes``):
    an attention page is its KV heads (or head slots) by its block's tokens; a state page is one
    cell of the whole unpadded state (``MambaSpec``: one head, one state)."""
    if isinstance(spec, AttentionSpec):
        return (spec.num_head_slots or spec.num_kv_heads, spec.block_size, spec.state_content_size_bytes)
    return (1, 1, spec.real_page_size_bytes)


def _placed(groups: Sequence[GroupSpec], num_blocks: int) -> list[tuple[KVCacheSpec, KVCacheTensorPlacement]]:
    """The tensors of a pool of ``num_blocks`` blocks, in group order, each with its layers' spec."""
    if not groups:
        return []
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
            tensors.append((spec, placed))
            offset += len(names) * layer_stride
    return tensors


def kv_cache_tensors(groups: Sequence[GroupSpec], num_blocks: int) -> tuple[KVCacheTensorPlacement, ...]:
    """The tensors of a pool of ``num_blocks`` blocks, in group order."""
    return tuple(placed for _, placed in _placed(groups, num_blocks))


def kv_cache_tensor_slots(groups: Sequence[GroupSpec], num_blocks: int) -> tuple[KVCacheTensorPlacement, ...]:
    """The tensors of a pool of ``num_blocks`` blocks before vLLM 0.29 (``get_kv_cache_config_from_groups``,
    vllm/v1/core/kv_cache_utils.py, 0.23 to 0.28: ``KVCacheTensor(size, shared_by)``): one tensor
    per layer slot, ``page * num_blocks`` bytes, shared by the slot's layer of every group (the
    groups' pages are one size), each of its layers at byte 0 with block ``b`` at ``b * page``;
    a lone ``UniformTypeKVCacheSpecs`` group has a tensor per layer of its own page. No layout yet
    (each backend's ``get_kv_cache_shape`` views it): ``page_shape`` is None."""
    if not groups:
        return ()
    if len(groups) > 1 and all(g.uniform_type for g in groups):
        raise Rejected("not_modelled", "several UniformTypeKVCacheSpecs groups (DeepSeek-V4's allocator)")
    if groups[0].uniform_type:
        slots = [
            ((name,), spec.page_size_bytes)
            for name, spec in zip(groups[0].layer_names, groups[0].specs, strict=True)
        ]
    else:
        page = groups[0].specs[0].page_size_bytes
        width = max(len(g.layer_names) for g in groups)
        slots = [
            (tuple(g.layer_names[i] for g in groups if i < len(g.layer_names)), page) for i in range(width)
        ]
    return tuple(
        KVCacheTensorPlacement(layers, page * num_blocks, 0, 0, page, None) for layers, page in slots
    )


#: The engine's layout (``resolve_kv_cache_layout``): the default preference's first, which the
#: GPU backends (FlashAttention, Triton, FlashInfer, the MLA backends) do not restrict.
LAYOUT = "LBNHC"
#: a layer-outermost layout -> the physical order of a page's axes, outermost first
#: (``KVCacheLayout.stride_order`` after L and B, vllm/v1/kv_cache_layout.py)
PAGE_ORDER = {"LBNHC": "NHC", "LBHNC": "HNC"}


def kv_cache_views(
    groups: Sequence[GroupSpec], num_blocks: int, layout: str = LAYOUT
) -> tuple[KVCacheView, ...]:
    """Each layer's ``[B, H, N, C]`` view (``create_kv_cache_views``, vllm/v1/kv_cache_interface.py,
    0.29+) over the tensors of :func:`kv_cache_tensors`: block ``b`` of layer ``l`` at ``offset +
    l * layer_stride + b * block_stride`` bytes; within a page the layout orders H, N and C
    (``compute_layout_strides``: C innermost, 1 byte). An attention layer's view is in its
    dtype (strides and offset divided by its size); a state layer's stays in bytes. The kernel
    block is the block (``MultipleOf`` backends split none)."""
    views = []
    for spec, t in _placed(groups, num_blocks):
        heads, states, content = t.page_shape
        extent = {"H": heads, "N": states, "C": content}
        strides, step = {}, 1
        for axis in reversed(PAGE_ORDER[layout]):
            strides[axis], step = step, step * extent[axis]
        dtype = spec.dtype if isinstance(spec, AttentionSpec) else "int8"
        item = DTYPE_SIZE[dtype]
        shape = (num_blocks, heads, states, content // item)
        stride = (t.block_stride // item, strides["H"] // item, strides["N"] // item, 1)
        views += [
            KVCacheView(name, dtype, shape, stride, (t.offset + i * t.layer_stride) // item)
            for i, name in enumerate(t.layers)
        ]
    return tuple(views)


def _contiguous(shape: tuple[int, ...], block_stride: int) -> tuple[int, ...]:
    """Row-major strides of ``shape``, the first (the block's) replaced by ``block_stride``."""
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return (block_stride, *reversed(strides[:-1]))


def kv_cache_views_by_backend(groups: Sequence[GroupSpec], num_blocks: int) -> tuple[KVCacheView, ...]:
    """Each layer's KV cache in vLLM 0.23 to 0.25, as ``GPUModelRunner._reshape_kv_cache_tensors``
    (vllm/v1/worker/gpu_model_runner.py, 0.23) views its tensor of :func:`kv_cache_tensor_slots`
    (every layer at byte 0; a block a page, a padded page too, ``torch.as_strided``):

    * an attention layer through its backend's ``get_kv_cache_shape`` and
      ``get_kv_cache_stride_order`` (NHD: as is): FlashAttention's and Triton's
      ``(num_blocks, 2, block_size, kv_heads, head_size)``, an int8 or fp8 ``*_per_token_head``
      head wider by its fp32 scale (Triton); an MLA latent and a DSA indexer key ``(num_blocks,
      block_size, head_size)`` in their dtype. Other packed formats (TurboQuant, nvfp4,
      UltraQuant, int4, fp8_ds_mla) have shapes of their own backends: not modelled;
    * a state layer as one view per state tensor, ``(num_blocks, *shape)`` in its dtype, each
      beginning where the previous one ends, named ``<layer>[i]``.

    The kernel block is the block (``MultipleOf`` backends split none). 0.26 to 0.28 view otherwise
    (``attention_kv_cache_bhnc``): the caller does not ask them."""
    views = []
    for group in groups:
        for name, spec in zip(group.layer_names, group.specs, strict=True):
            if isinstance(spec, MambaSpec):
                offset = 0
                for i, (state, dtype) in enumerate(zip(spec.shapes, spec.dtypes, strict=True)):
                    item, shape = DTYPE_SIZE[dtype], (num_blocks, *state)
                    stride = _contiguous(shape, spec.page_size_bytes // item)
                    views.append(KVCacheView(f"{name}[{i}]", dtype, shape, stride, offset // item))
                    offset += math.prod(state) * item
                continue
            assert isinstance(spec, AttentionSpec)
            item = DTYPE_SIZE[spec.dtype]
            plain = spec.num_head_slots is None and spec.state_content_bytes is None
            # int8/fp8 *_per_token_head: each of K and V one fp32 scale per head wider
            per_token_head = spec.state_content_bytes == 2 * spec.head_size * item + 8
            if spec.is_mla and plain:  # a latent, or a DSA indexer key
                shape: tuple[int, ...] = (num_blocks, spec.block_size, spec.head_size)
            elif not spec.is_mla and spec.head_size_v in (None, spec.head_size) and (plain or per_token_head):
                shape = (
                    num_blocks,
                    2,
                    spec.block_size,
                    spec.num_kv_heads,
                    spec.state_content_size_bytes // 2 // item,
                )
            else:
                raise Rejected("not_modelled", f"the KV cache shape of {spec.kind} pages of "
                               f"{spec.state_content_size_bytes} B per head before vLLM 0.29")  # fmt: skip
            stride = _contiguous(shape, spec.page_size_bytes // item)
            views.append(KVCacheView(name, spec.dtype, shape, stride, 0))
    return tuple(views)
