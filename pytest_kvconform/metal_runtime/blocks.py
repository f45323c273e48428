"""Logical → kernel block-size translation (vllm-metal ``attention/impls/sdpa.py``).

The Metal kernels exist only for kernel blocks of 8, 16 and 32 tokens. A larger logical block
(hybrid models get 160, 400, 544, 2768, ...) is served by viewing every logical block as
``ratio = block_size // kernel_block_size`` consecutive kernel blocks: the cache is reshaped
without a copy and each block-table entry ``b`` becomes ``b*ratio + arange(ratio)``. Slot mappings
need no translation: ``b*BS + off == (b*ratio + off//kbs)*kbs + off%kbs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mlx.core as mx

#: Kernel block sizes, searched largest first (vllm-metal ``_KERNEL_BLOCK_SIZES``).
KERNEL_BLOCK_SIZES: tuple[int, ...] = (32, 16, 8)


def pick_kernel_block_size(block_size: int) -> int:
    """The largest kernel block size dividing ``block_size``; ``ValueError`` if none does."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"Cache block_size={block_size!r} must be a positive integer")
    for kbs in KERNEL_BLOCK_SIZES:
        if block_size % kbs == 0:
            return kbs
    raise ValueError(
        f"Cache block_size={block_size} is not divisible by any supported kernel block size "
        f"{KERNEL_BLOCK_SIZES}. Adjust --block-size (must be a multiple of 8)."
    )


def expand_block_rows(rows: Sequence[Sequence[int]], block_size: int) -> tuple[list[list[int]], int]:
    """Pure-Python form of :func:`build_block_tables`: (expanded rows, kernel block size)."""
    kbs = pick_kernel_block_size(block_size)
    ratio = block_size // kbs
    width = max((len(r) for r in rows), default=0)
    out = []
    for row in rows:
        padded = [int(b) for b in row] + [0] * (width - len(row))  # zero-pad first, then expand
        out.append([b * ratio + j for b in padded for j in range(ratio)])
    return out, kbs


def build_block_tables(rows: Sequence[Sequence[int]], block_size: int) -> tuple[mx.array, int]:
    """Block tables in kernel-block units: ``(int32 [num_seqs, max_blocks*ratio], kernel_block_size)``.

    Rows are zero-padded to the longest one first; the padding block 0 is expanded like any
    other entry (it is never dereferenced by the kernel, pagedattention.metal).
    """
    import mlx.core as mx

    expanded, kbs = expand_block_rows(rows, block_size)
    if not expanded:
        return mx.zeros((0, 0), dtype=mx.int32), kbs
    return mx.array(expanded, dtype=mx.int32), kbs


def reshape_cache_for_kernel(cache: mx.array, kernel_block_size: int) -> mx.array:
    """View ``[NB, BS, H, D]`` as ``[NB*ratio, kbs, H, D]`` (a reshape of a contiguous array: no copy)."""
    if cache.ndim != 4:
        raise ValueError(f"expected a cache of shape [num_blocks, block_size, heads, dim], got {cache.shape}")
    nb, bs, h, d = cache.shape
    if bs % kernel_block_size:
        raise ValueError(f"cache block_size={bs} is not a multiple of kernel block size {kernel_block_size}")
    return cache.reshape(nb * (bs // kernel_block_size), kernel_block_size, h, d)
