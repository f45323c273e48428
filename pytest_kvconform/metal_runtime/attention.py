"""Paged KV writes and paged attention on MLX, following vllm-metal's kernel contract.

The contract is that of vllm-project/vllm-metal @ 211a1e4: ``paged_attention_primitive`` and
``reshape_and_cache`` in ``vllm_metal/metal/paged_ops.cpp``, the kernels in
``vllm_metal/metal/kernels_v2/pagedattention.metal``, and the caller ``sdpa_forward`` in
``vllm_metal/attention/impls/sdpa.py``.

Layouts (``paged_attention_primitive``): ``query [T, Hq, D]`` packs all query rows of all
sequences (decode rows and prefill rows alike) with segment boundaries ``cu_seqlens_q``;
``key_cache``/``value_cache`` are ``[num_blocks, block_size, Hkv, D]`` (token-major, as vLLM
allocates them); ``seq_lens`` counts *all* KV tokens of a sequence including this step's queries.

How it runs: sequences of similar shape are batched (all decode rows of a uniform step form one
batch). The compute is fp32 with contiguous GQA grouping (query head ``h`` uses KV head
``h // (Hq // Hkv)``) on MLX's BLAS matmuls.

* Decode batches (one query row per sequence, :func:`_attend_decode`): one ``take`` copies the
  tokens of the whole blocks covering each sequence's attended range in 512 B pieces (copy speed)
  and one 3-D transpose makes ``[Hkv, D, 16]`` key tiles, so ``Q.K^T`` runs per tile in BLAS's
  axpy form (twice as fast on the CPU's reference BLAS as the dot form of ``q @ K^T``, which dense
  SDPA uses). Keys outside ``[lo, seq_len)`` are masked, so unwritten slots never matter. V is
  gathered head-major (``[n, Hkv, L, D]``) by one ``take`` from the flat ``[NB*BS*Hkv, D]`` view.
* Other batches (prefill rows, :func:`_attend_group`): one ``take`` per cache gathers exactly the
  KV rows each sequence attends to, head-major, and the scores are ``q @ K^T`` with a
  causal/window mask; shorter sequences are padded and their padding keys masked.

The sink is a denominator-only logit and the denominator carries the kernel's ``+1e-6``
(pagedattention.metal).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from .blocks import KERNEL_BLOCK_SIZES, build_block_tables, reshape_cache_for_kernel

#: (atol, rtol) per dtype, as vllm-metal's kernel parity checks use them (``TOLS`` in
#: tools/spec_window_parity.py).
DTYPE_TOLERANCES: dict[str, tuple[float, float]] = {
    "bfloat16": (3e-2, 2e-2),
    "float16": (1.5e-2, 2e-2),
    "float32": (1e-3, 1e-3),
}
_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
_DENOM_EPS = 1e-6  # the kernel's 1/(l + 1e-6)


def _dtype_name(dtype: Any) -> str:
    for name, dt in _DTYPES.items():
        if dtype == dt:
            return name
    raise ValueError(f"unsupported dtype {dtype}; the paged KV cache accepts float16, bfloat16, float32")


def _host_ints(x: Any, what: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


# --------------------------------------------------------------------------- cache writes


def reshape_and_cache(
    key: mx.array,
    value: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    slot_mapping: Any,
) -> tuple[mx.array, mx.array]:
    """Write token ``i`` of ``key``/``value [N, Hkv, D]`` to flat slot ``slot_mapping[i]``.

    ``slot = block_id * block_size + offset`` on the *logical* cache ``[NB, BS, Hkv, D]``
    (vllm-metal ``reshape_and_cache``). Negative slots are padding and are skipped. Unlike
    vllm-metal's kernel, which has no upper-bound check (an out-of-range slot is an out-of-bounds
    device write), a slot ``>= num_blocks * block_size`` raises ``ValueError``. Returns the new
    caches; rebind them.
    """
    if key_cache.shape != value_cache.shape or key_cache.ndim != 4:
        raise ValueError(
            f"key/value caches must share a 4-D shape, got {key_cache.shape} and {value_cache.shape}"
        )
    nb, bs, h, d = key_cache.shape
    if key.shape != value.shape or key.ndim != 3 or tuple(key.shape[1:]) != (h, d):
        raise ValueError(f"key/value must be [N, {h}, {d}] like the cache, got {key.shape} and {value.shape}")
    slots = _host_ints(slot_mapping, "slot_mapping").reshape(-1)
    if slots.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slots.shape[0]} entries for {key.shape[0]} tokens")
    capacity = nb * bs
    bad = np.nonzero(slots >= capacity)[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"slot_mapping[{i}]={int(slots[i])} is out of range for a cache of {nb} blocks x {bs} tokens "
            f"({capacity} slots); vllm-metal's reshape_and_cache has no bound check, "
            "this runtime refuses the write"
        )
    keep = np.nonzero(slots >= 0)[0]
    if keep.size == 0:
        return key_cache, value_cache
    rows = mx.array(slots[keep].astype(np.int32))
    src = mx.array(keep.astype(np.int32)) if keep.size != slots.size else None
    out = []
    for new, cache in ((key, key_cache), (value, value_cache)):
        vals = new.astype(cache.dtype)
        if src is not None:
            vals = mx.take(vals, src, axis=0)
        flat = cache.reshape(capacity, h, d)
        flat[rows] = vals
        out.append(flat.reshape(nb, bs, h, d))
    return out[0], out[1]


# --------------------------------------------------------------------------- paged attention


def _validate_common(
    query: mx.array, num_kv_heads: int, seq_lens: np.ndarray, cu: np.ndarray, sliding_window: int
) -> tuple[int, int, int]:
    if query.ndim != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got {query.shape}")
    t, hq, _ = query.shape
    if num_kv_heads <= 0 or hq % num_kv_heads:
        raise ValueError(
            f"num_query_heads={hq} must be a positive multiple of num_kv_heads={num_kv_heads} "
            "(contiguous GQA grouping h_kv = h_q // (Hq/Hkv))"
        )
    s = seq_lens.shape[0]
    if cu.shape != (s + 1,) or cu[0] != 0 or cu[-1] != t or np.any(np.diff(cu) < 0):
        raise ValueError(
            f"cu_seqlens_q must be [num_seqs+1] non-decreasing from 0 to num_tokens={t}, got {cu.tolist()}"
        )
    q_lens = np.diff(cu)
    short = np.nonzero(seq_lens < q_lens)[0]
    if short.size:
        i = int(short[0])
        raise ValueError(
            f"sequence {i}: seq_len={int(seq_lens[i])} < q_len={int(q_lens[i])}; seq_lens must include "
            "the query tokens (the Metal kernel leaves such rows unwritten)"
        )
    if sliding_window == 0 or sliding_window < -1:
        raise ValueError(f"sliding_window must be -1 (off) or >= 1, got {sliding_window}")
    return t, hq, s


def paged_attention(
    query: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_tables: Any,
    seq_lens: Any,
    cu_seqlens_q: Any,
    *,
    block_size: int,
    scale: float,
    num_kv_heads: int,
    sliding_window: int = -1,
    sinks: mx.array | None = None,
) -> mx.array:
    """Packed varlen decode+prefill attention over a paged cache with kernel blocks of 8/16/32.

    Row ``r`` of sequence ``s`` (``q_len = cu[s+1]-cu[s]``, ``pos = r - cu[s]``) attends key
    ``t`` iff ``t < eff`` with ``eff = seq_lens[s] - q_len + pos + 1``, and with a window also
    ``t >= eff - sliding_window``. Returns ``[T, Hq, D]`` in the query dtype.
    """
    if block_size not in KERNEL_BLOCK_SIZES:
        raise ValueError(
            f"block_size={block_size} is not a kernel block size {KERNEL_BLOCK_SIZES}; "
            "translate larger logical blocks with paged_attention_logical"
        )
    if key_cache.ndim != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"caches must share a [NB, BS, Hkv, D] shape, got {key_cache.shape}, {value_cache.shape}"
        )
    nb, bs, hkv, d = key_cache.shape
    if bs != block_size:
        raise ValueError(f"cache block dimension {bs} != block_size={block_size}")
    if hkv != num_kv_heads:
        raise ValueError(f"cache has {hkv} KV heads but num_kv_heads={num_kv_heads}")
    name = _dtype_name(key_cache.dtype)
    if query.dtype != key_cache.dtype or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"query/key/value dtypes must match the cache ({name}); got {query.dtype}, {value_cache.dtype}"
        )
    lens = _host_ints(seq_lens, "seq_lens").reshape(-1)
    cu = _host_ints(cu_seqlens_q, "cu_seqlens_q").reshape(-1)
    t, hq, num_seqs = _validate_common(query, num_kv_heads, lens, cu, sliding_window)
    if query.shape[2] != d:
        raise ValueError(f"query head_dim {query.shape[2]} != cache head_dim {d}")
    table = _host_ints(block_tables, "block_tables")
    if table.ndim != 2 or table.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks], got shape {table.shape}")
    _validate_table(table, lens, block_size, nb)
    if sinks is not None and (sinks.ndim != 1 or sinks.shape[0] != hq or sinks.dtype != mx.float32):
        raise ValueError(
            f"sinks must be float32 [{hq}] (one per query head), got {sinks.dtype} {sinks.shape}"
        )
    if t == 0:
        return mx.zeros((0, hq, d), dtype=query.dtype)

    q_lens = np.diff(cu)
    lo = np.zeros_like(lens)
    if sliding_window > 0:  # the first row of a sequence reaches back furthest
        lo = np.maximum(0, lens - q_lens + 1 - sliding_window)
    active = np.nonzero(q_lens > 0)[0]
    flat_k = key_cache.reshape(nb * bs * hkv, d)
    flat_v = value_cache.reshape(nb * bs * hkv, d)
    sink = None if sinks is None else sinks.reshape(1, hkv, hq // hkv, 1, 1)
    outs, rows_done = [], []
    for group in _groups(active, q_lens, lens - lo, num_heads=hq, kv_row_floats=hkv * d):
        if int(q_lens[group].max()) == 1:  # decode rows only
            out = _attend_decode(
                query, key_cache, flat_v, table, lens, cu, lo, group,
                scale=scale, sink=None if sinks is None else sinks.reshape(1, hkv, hq // hkv, 1),
            )  # fmt: skip
            token_rows = cu[group]
        else:
            out, token_rows = _attend_group(
                query, flat_k, flat_v, table, lens, cu, lo, group,
                num_kv_heads=hkv, block_size=bs, scale=scale, window=sliding_window, sink=sink,
            )  # fmt: skip
        outs.append(out)
        rows_done.append(token_rows)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    # ``token_rows[i]`` is the packed query row that output row ``i`` belongs to (-1: padding)
    where = np.concatenate(rows_done)
    if where.shape[0] != t or np.any(where != np.arange(t)):
        pick = np.empty(t, dtype=np.int32)
        kept = np.nonzero(where >= 0)[0]
        pick[where[kept]] = kept
        out = mx.take(out, mx.array(pick), axis=0)
    return out.astype(query.dtype)


def _row_indices(idx: np.ndarray, num_rows: int) -> mx.array:
    """``idx`` flattened as ``take`` indices into ``num_rows`` rows: int32 where they fit."""
    return mx.array(idx.reshape(-1).astype(np.int32 if num_rows < 2**31 else np.int64))


def _validate_table(table: np.ndarray, lens: np.ndarray, block_size: int, nb: int) -> None:
    """Every sequence's used block-table entries exist and lie in ``[0, nb)`` (first offender raises)."""
    need = -(-lens // block_size)
    wide = np.nonzero(need > table.shape[1])[0]
    if wide.size:
        s = int(wide[0])
        raise ValueError(
            f"sequence {s}: seq_len={int(lens[s])} needs {int(need[s])} blocks of {block_size}, "
            f"block_tables has {table.shape[1]} columns"
        )
    used = np.arange(table.shape[1])[None, :] < need[:, None]
    bad = np.nonzero(np.any(used & ((table < 0) | (table >= nb)), axis=1))[0]
    if bad.size:
        s = int(bad[0])
        ids = table[s, : need[s]].tolist()
        raise ValueError(f"sequence {s}: block ids {ids} out of range for {nb} cache blocks")


#: A sequence joins a padded batch if its query rows and its KV range are at least this
#: fraction of the batch's longest (so padding wastes at most 1/4 of any row's work).
_PAD_FRACTION = 0.75
#: Upper bound on the fp32 temporaries of one batch (gathered K, its transposed tiles, V and the
#: scores): larger batches are split, so peak memory stays bounded for long or many sequences.
_BATCH_BYTES = 256 << 20


def _groups(
    active: np.ndarray, q_lens: np.ndarray, kv_lens: np.ndarray, *, num_heads: int, kv_row_floats: int
) -> list[np.ndarray]:
    """Batches of sequences of similar shape (decode rows together), padding bounded by ``_PAD_FRACTION``.

    Each batch takes the longest remaining sequence (query rows first, then keys) and every other
    one whose rows and keys lie in ``[_PAD_FRACTION * max, max]``, at most as many as keep the
    batch's K (twice: the decode path's copied rows, a spare piece adding at most a quarter, and
    tiles), V and scores (``L * 4 * (3.25 * Hkv * D + Hq * R)`` bytes a sequence) within
    ``_BATCH_BYTES``. Equal shapes keep their order, so a uniform decode step is one batch in
    packed order.
    """
    q, kv = q_lens[active], kv_lens[active]
    rest = active[np.lexsort((-kv, -q))]  # stable
    groups = []
    while rest.size:
        r_max, l_max = int(q_lens[rest[0]]), int(kv_lens[rest[0]])
        rq, rkv = q_lens[rest], kv_lens[rest]
        fits = (rq <= r_max) & (rq >= _PAD_FRACTION * r_max) & (rkv <= l_max) & (rkv >= _PAD_FRACTION * l_max)
        per_seq = l_max * (13 * kv_row_floats + 4 * num_heads * r_max)
        chosen = rest[fits]
        step = max(1, _BATCH_BYTES // per_seq)
        groups.extend(chosen[i : i + step] for i in range(0, chosen.size, step))
        rest = rest[~fits]
    return groups


def _attend_group(
    query: mx.array,
    flat_k: mx.array,
    flat_v: mx.array,
    table: np.ndarray,
    lens: np.ndarray,
    cu: np.ndarray,
    lo: np.ndarray,
    group: np.ndarray,
    *,
    num_kv_heads: int,
    block_size: int,
    scale: float,
    window: int,
    sink: mx.array | None,
) -> tuple[mx.array, np.ndarray]:
    """Attention for the ``n`` sequences of ``group`` at once, padded to ``R`` query rows and ``L`` keys.

    One ``take`` per cache gathers every sequence's attended keys head-major, ``[n, Hkv, L, D]``,
    straight from the flat ``[NB*BS*Hkv, D]`` view (the gather also transposes tokens to heads).
    The scores then use the BLAS forms of ``mx.fast.scaled_dot_product_attention`` on CPU:
    ``q [n,Hkv,G,R,D] @ K^T [n,Hkv,1,D,L]`` and ``P @ V [n,Hkv,1,L,D]``, G broadcast. Returns
    ``[n*R, Hq, D]`` float32 rows and, per row, its packed query row (-1 for a padding row).
    """
    hkv, d = num_kv_heads, int(flat_k.shape[1])
    t, hq = int(query.shape[0]), int(query.shape[1])
    group_size = hq // hkv
    n = int(group.shape[0])
    r_lens, kv_lens = cu[group + 1] - cu[group], lens[group] - lo[group]
    r_max, l_max = int(r_lens.max()), int(kv_lens.max())

    # host-side indices: key j of sequence i is token lo+j (padding repeats the last real key)
    j = np.arange(l_max)
    pos = lo[group][:, None] + np.minimum(j[None, :], kv_lens[:, None] - 1)  # [n, L]
    blocks = table[group[:, None], pos // block_size]
    rows = (blocks * block_size + pos % block_size) * hkv  # flat row of head 0
    idx = rows[:, None, :] + np.arange(hkv)[None, :, None]  # [n, Hkv, L]
    idx_mx = _row_indices(idx, flat_k.shape[0])
    k = mx.take(flat_k, idx_mx, axis=0).reshape(n, hkv, 1, l_max, d)
    v = mx.take(flat_v, idx_mx, axis=0).reshape(n, hkv, 1, l_max, d)
    if k.dtype != mx.float32:
        k, v = k.astype(mx.float32), v.astype(mx.float32)

    r = np.arange(r_max)
    token_rows = cu[group][:, None] + np.minimum(r[None, :], r_lens[:, None] - 1)  # [n, R]
    flat_rows = token_rows.reshape(-1)
    in_order = flat_rows.shape[0] == t and bool(np.all(flat_rows == np.arange(t)))
    q = query if in_order else mx.take(query, mx.array(flat_rows.astype(np.int32)), axis=0)
    q = q.astype(mx.float32) * scale
    if r_max == 1:
        q = q.reshape(n, hkv, group_size, 1, d)
    else:
        q = q.reshape(n, r_max, hkv, group_size, d).transpose(0, 2, 3, 1, 4)
    scores = q @ k.swapaxes(-1, -2)  # [n, Hkv, G, R, L]

    if r_max > 1 or int(kv_lens.min()) < l_max:  # decode rows of equal length need no mask
        scores = mx.where(_keep_mask(lens[group], lo[group], r_lens, kv_lens, window), scores, -mx.inf)

    e, denom = _softmax_parts(scores, sink)
    out = (e @ v) / denom  # [n, Hkv, G, R, D]
    if r_max > 1:
        out = out.transpose(0, 3, 1, 2, 4)
    token_rows = np.where(r[None, :] < r_lens[:, None], token_rows, -1)
    return out.reshape(n * r_max, hq, d), token_rows.reshape(-1)


#: Token tile of the decode path's transposed keys: one ``[D, 16]`` tile per (16 tokens, KV head).
#: ``q @ tile`` costs 27.5 ms for the benchmark's step at 16 tokens, 34.7 at 8 (one BLAS call per
#: tile); 32 gains 1 ms more and costs 5 ms more to transpose.
_KEY_TILE = 16
#: Largest piece the key copy hands to one ``memcpy``. glibc copies 4 KiB and more with ``rep
#: movsb``, which on the AMD EPYC measured here runs 3.7x slower when the destination lies 16 bytes
#: past the source modulo 4 KiB (24 against 6.5 ms for the benchmark's 64 MiB of keys); MLX's heap
#: addresses decide that, so a take of whole blocks was fast or slow by chance. Pieces of 512 B
#: cost the same as whole blocks without the penalty (1-2 KiB pieces cost twice as much).
_COPY_PIECE_BYTES = 512


def _gather_key_rows(cache: mx.array, blocks: np.ndarray) -> tuple[mx.array, int]:
    """The tokens of ``cache[blocks]`` as rows ``[len(blocks) * BS, W]`` whose first ``Hkv*D``
    columns are the token's keys; returns the rows and ``W``.

    Copied in pieces of at most ``_COPY_PIECE_BYTES``. A token's ``Hkv*D`` keys that fill a
    multiple of 2 KiB get one spare piece (``W > Hkv*D``): the tile transpose reads 16 rows at
    once, and rows a multiple of 4 KiB apart share one set of the L1 cache (16 rows at 4 KiB: 25
    against 9 ms to transpose the benchmark's keys; with the spare piece, 9 ms).
    """
    nb, bs, hkv, d = cache.shape
    row, size = hkv * d, cache.dtype.size
    piece = math.gcd(row, _COPY_PIECE_BYTES // size)
    if piece * size < _COPY_PIECE_BYTES // 4:  # odd head sizes: whole token rows
        piece = row
    per = row // piece
    spare = 1 if piece < row and (row * size) % 2048 == 0 else 0
    tokens = (blocks[:, None] * bs + np.arange(bs)[None, :]).reshape(-1)
    idx = tokens[:, None] * per + np.arange(per + spare)[None, :] % per
    idx_mx = _row_indices(idx, nb * bs * per)
    rows = mx.take(cache.reshape(nb * bs * per, piece), idx_mx, axis=0)
    return rows.reshape(tokens.shape[0], (per + spare) * piece), (per + spare) * piece


def _attend_decode(
    query: mx.array,
    key_cache: mx.array,
    flat_v: mx.array,
    table: np.ndarray,
    lens: np.ndarray,
    cu: np.ndarray,
    lo: np.ndarray,
    group: np.ndarray,
    *,
    scale: float,
    sink: mx.array | None,
) -> mx.array:
    """Attention for ``n`` decode rows (one query row per sequence); returns ``[n, Hq, D]`` float32.

    The scores come from key tiles: one ``take`` copies the tokens of the whole blocks that cover
    each sequence's attended range ``[lo, seq_len)`` (:func:`_gather_key_rows`, at plain copy
    speed), and one 3-D transpose turns each run of ``_KEY_TILE`` tokens into ``[Hkv, D, tile]``.
    Then ``q [n,1,Hkv,G,D] @ K_tile [n,nt,Hkv,D,tile]`` runs in BLAS's axpy form (a long
    independent inner loop over the tile's tokens) instead of the dot form of ``q @ K^T``, whose
    single accumulation chain per score makes it 1.5-2x as slow on the CPU's reference
    BLAS. Keys outside ``[lo, seq_len)`` (the head of the first block, the tail of the last,
    padding blocks of shorter sequences) are masked before the softmax, so whatever those slots
    hold never reaches the output. The values are gathered head-major per token as in
    :func:`_attend_group`, at the same columns, clamped to ``[lo, seq_len)``, so every weight
    multiplies a real value. ``P @ V`` is already in axpy form.
    """
    _, bs, hkv, d = key_cache.shape
    hq = int(query.shape[1])
    group_size = hq // hkv
    n = int(group.shape[0])
    g_lens, g_lo = lens[group], lo[group]
    first = g_lo // bs  # first block of each sequence
    count = -(-g_lens // bs) - first  # blocks covering [lo, seq_len)
    step = math.lcm(bs, _KEY_TILE) // bs  # whole tiles: round the block count up to it
    nblk = -(-int(count.max()) // step) * step
    l_max = nblk * bs
    k_idx = first[:, None] + np.minimum(np.arange(nblk)[None, :], count[:, None] - 1)
    blocks = table[group[:, None], k_idx].reshape(-1)  # [n*nblk], padding repeats the last block
    kr, width = _gather_key_rows(key_cache, blocks)  # [n*L, W]
    tiles = kr.reshape(n * l_max // _KEY_TILE, _KEY_TILE, width)[:, :, : hkv * d].swapaxes(1, 2)
    kt = mx.contiguous(tiles) if kr.dtype == mx.float32 else tiles.astype(mx.float32)
    kt = kt.reshape(n, l_max // _KEY_TILE, hkv, d, _KEY_TILE)

    q_rows = cu[group]  # the packed row of each sequence's query
    in_order = n == query.shape[0] and bool(np.all(q_rows == np.arange(n)))
    q = query if in_order else mx.take(query, mx.array(q_rows.astype(np.int32)), axis=0)
    q = (q.astype(mx.float32) * scale).reshape(n, 1, hkv, group_size, d)
    scores = (q @ kt).transpose(0, 2, 3, 1, 4).reshape(n, hkv, group_size, l_max)

    start = first * bs  # token position of column 0
    if np.any(start != g_lo) or np.any(start + l_max != g_lens):
        j = mx.arange(l_max, dtype=mx.int32).reshape(1, l_max)
        key_pos = mx.array(start.astype(np.int32)).reshape(n, 1) + j
        keep = (key_pos >= mx.array(g_lo.astype(np.int32)).reshape(n, 1)) & (
            key_pos < mx.array(g_lens.astype(np.int32)).reshape(n, 1)
        )
        scores = mx.where(keep.reshape(n, 1, 1, l_max), scores, -mx.inf)

    e, denom = _softmax_parts(scores, sink)

    pos = np.clip(start[:, None] + np.arange(l_max)[None, :], g_lo[:, None], g_lens[:, None] - 1)  # [n, L]
    rows = (table[group[:, None], pos // bs] * bs + pos % bs) * hkv
    idx = rows[:, None, :] + np.arange(hkv)[None, :, None]  # [n, Hkv, L]
    idx_mx = _row_indices(idx, flat_v.shape[0])
    v = mx.take(flat_v, idx_mx, axis=0).reshape(n, hkv, l_max, d)
    if v.dtype != mx.float32:
        v = v.astype(mx.float32)
    out = (e @ v) / denom  # [n, Hkv, G, D]
    return out.reshape(n, hq, d)


def _keep_mask(
    lens: np.ndarray, lo: np.ndarray, r_lens: np.ndarray, kv_lens: np.ndarray, window: int
) -> mx.array:
    """``[n, 1, 1, R, L]`` bool: row ``r`` may attend key ``j`` (token ``lo + j``) of its sequence.

    Causal: ``lo + j < eff`` with ``eff = seq_len - q_len + r + 1``; with a window also
    ``lo + j >= eff - window``. Padding keys (``j >= kv_len``) are masked; a padding row
    (``r >= q_len``, whose output is dropped) keeps key 0 so that no row is empty. Built
    lazily from per-sequence vectors, so no ``R x L`` array is formed on the host.
    """
    n, r_max, l_max = lens.shape[0], int(r_lens.max()), int(kv_lens.max())

    def col(a: np.ndarray) -> mx.array:
        return mx.array(a.astype(np.int32)).reshape(n, 1, 1)

    r = mx.arange(r_max, dtype=mx.int32).reshape(1, r_max, 1)
    j = mx.arange(l_max, dtype=mx.int32).reshape(1, 1, l_max)
    key_pos = col(lo) + j
    eff = col(lens - r_lens) + r + 1
    keep = (key_pos < eff) & (j < col(kv_lens))
    if window > 0:
        keep = keep & (key_pos >= eff - window)
    keep = keep | ((r >= col(r_lens)) & (j == 0))
    return keep.reshape(n, 1, 1, r_max, l_max)


#: MLX's own exp polynomial (``simd::exp`` in mlx/backend/cpu/simd/math.h): 2**f on [-1/2, 1/2].
_EXP2_POLY = (
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
    1.0,
)
_ROUND = 12582912.0  # 1.5 * 2**23: (y + _ROUND) - _ROUND rounds |y| < 2**22 to an integer


def _softmax_parts(scores: mx.array, sink: mx.array | None) -> tuple[mx.array, mx.array]:
    """The unnormalised weights and their denominator over the last axis, as the kernel forms
    them: the max (and the sink) subtracted, the sink added to the denominator only, plus
    ``_DENOM_EPS``."""
    m = scores.max(axis=-1, keepdims=True)
    if sink is not None:
        m = mx.maximum(m, sink)
    e = _exp_nonpositive(scores - m)
    denom = e.sum(axis=-1, keepdims=True) + _DENOM_EPS
    if sink is not None:
        denom = denom + mx.exp(sink - m)
    return e, denom


def _exp_nonpositive(x: mx.array) -> mx.array:
    """``exp(x)`` for float32 ``x <= 0`` (``-inf`` gives 0), as plain MLX ops on the CPU device.

    The softmax weights are ``exp(scores - max) <= 1``. On the CPU ``mx.exp`` evaluates MLX's
    polynomial one element at a time through libm ``fmaf``/``floorf`` calls (SIMD width 1 on
    x86 Linux): 8.5 ms for the 262k scores of the benchmark step. The same polynomial as
    whole-array ops takes 3.0 ms (docs/metal-runtime.md), with the same accuracy; below about
    ``-87.7`` it returns 0 instead of a subnormal, as MLX does below -88. Other devices keep
    ``mx.exp``.
    """
    if mx.default_device() != mx.cpu:
        return mx.exp(x)
    y = mx.maximum(x * 1.4426950408889634, -127.0)  # log2(e) * x, clamped: 2**-127 encodes as 0.0
    n = (y + _ROUND) - _ROUND
    f = y - n
    p = _EXP2_POLY[0]
    for c in _EXP2_POLY[1:]:
        p = p * f + c
    two_n = mx.view(mx.left_shift(n.astype(mx.int32) + 127, 23), mx.float32)  # exponent bits of 2**n
    return p * two_n


def paged_attention_logical(
    query: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_tables: Sequence[Sequence[int]],
    seq_lens: Any,
    cu_seqlens_q: Any,
    *,
    scale: float,
    num_kv_heads: int,
    sliding_window: int = -1,
    sinks: mx.array | None = None,
) -> mx.array:
    """:func:`paged_attention` on a cache with any logical block size (160, 400, 544, ...).

    ``block_tables`` are rows of *logical* block ids; the cache ``[NB, BS, Hkv, D]`` is viewed as
    kernel blocks and the rows are expanded exactly as vllm-metal's ``sdpa_forward`` does.
    """
    block_size = key_cache.shape[1]
    if isinstance(block_tables, (mx.array, np.ndarray)):
        rows = np.asarray(block_tables).tolist()
    else:
        rows = [[int(b) for b in r] for r in block_tables]
    table, kbs = build_block_tables(rows, block_size)
    if table.size == 0:
        table = mx.zeros((len(rows), 0), dtype=mx.int32)
    return paged_attention(
        query,
        reshape_cache_for_kernel(key_cache, kbs),
        reshape_cache_for_kernel(value_cache, kbs),
        table,
        seq_lens,
        cu_seqlens_q,
        block_size=kbs,
        scale=scale,
        num_kv_heads=num_kv_heads,
        sliding_window=sliding_window,
        sinks=sinks,
    )


# --------------------------------------------------------------------------- dense oracle


def _to_f64(x: Any) -> np.ndarray:
    if isinstance(x, mx.array):
        x = np.array(x.astype(mx.float32))
    return np.asarray(x, dtype=np.float64)


def dense_attention(
    query: Any,
    keys: Sequence[Any],
    values: Sequence[Any],
    cu_seqlens_q: Any,
    *,
    scale: float,
    sliding_window: int = -1,
    sinks: Any = None,
) -> np.ndarray:
    """Oracle: explicit per-sequence softmax over contiguous ``keys[s]``/``values[s] [L_s, Hkv, D]``.

    Written in float64 numpy, independent of the paged path: GQA by grouping query heads per KV head, an
    explicit boolean causal/window mask, the sink added to the denominator only, and the kernel's
    ``+1e-6`` (pagedattention.metal). ``L_s`` is the sequence length including its query rows. Returns
    float32 ``[T, Hq, D]``.
    """
    q_all = _to_f64(query)
    cu = [int(c) for c in np.asarray(cu_seqlens_q).reshape(-1)]
    hq = q_all.shape[1]
    sink = None if sinks is None else _to_f64(sinks).reshape(hq)
    out = np.zeros(q_all.shape, dtype=np.float64)
    for s in range(len(cu) - 1):
        q = q_all[cu[s] : cu[s + 1]]
        rows = q.shape[0]
        if rows == 0:
            continue
        k, v = _to_f64(keys[s]), _to_f64(values[s])
        seq_len, hkv = k.shape[0], k.shape[1]
        g = hq // hkv  # query head h attends with KV head h // g
        qg = q.reshape(rows, hkv, g, q.shape[-1])
        logits = np.einsum("rkgd,tkd->kgrt", qg, k, optimize=True).reshape(hq, rows, seq_len) * scale
        eff = seq_len - rows + np.arange(rows) + 1
        t = np.arange(seq_len)
        mask = t[None, :] < eff[:, None]
        if sliding_window > 0:
            mask &= t[None, :] >= (eff[:, None] - sliding_window)
        logits = np.where(mask[None], logits, -np.inf)
        m = logits.max(axis=-1, keepdims=True)
        if sink is not None:
            m = np.maximum(m, sink[:, None, None])
        w = np.exp(logits - m)
        denom = w.sum(axis=-1, keepdims=True) + _DENOM_EPS
        if sink is not None:
            denom = denom + np.exp(sink[:, None, None] - m)
        p = (w / denom).reshape(hkv, g, rows, seq_len)
        out[cu[s] : cu[s + 1]] = np.einsum("kgrt,tkd->rkgd", p, v, optimize=True).reshape(rows, hq, -1)
    return out.astype(np.float32)
