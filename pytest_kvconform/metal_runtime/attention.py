"""Paged KV writes and paged attention on MLX, following vllm-metal's kernel contract.

The contract is that of vllm-project/vllm-metal @ 211a1e4: ``paged_attention_primitive`` and
``reshape_and_cache`` in ``vllm_metal/metal/paged_ops.cpp``, the kernels in
``vllm_metal/metal/kernels_v2/pagedattention.metal``, and the caller ``sdpa_forward`` in
``vllm_metal/attention/impls/sdpa.py``.

Layouts (``paged_attention_primitive``): ``query [T, Hq, D]`` packs all query rows of all
sequences (decode rows and prefill rows alike) with segment boundaries ``cu_seqlens_q``;
``key_cache``/``value_cache`` are ``[num_blocks, block_size, Hkv, D]`` (token-major, as vLLM
allocates them); ``seq_lens`` counts *all* KV tokens of a sequence including this step's queries.

How it runs: for each sequence we gather exactly the KV rows it attends to, head-major
(``[Hkv, L, D]``) in one ``take`` over the flat ``[NB*BS*Hkv, D]`` view (the gather also does the
token→head transpose), then compute in fp32 with contiguous GQA grouping: query head ``h`` uses
KV head ``h // (Hq // Hkv)``. Pure decode rows and window-only decode need no mask (the gathered
range is exactly the attended range); prefill rows get a causal/window mask. The sink is a
denominator-only logit and the denominator carries the kernel's ``+1e-6`` (pagedattention.metal).
"""

from __future__ import annotations

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
    need = -(-lens // block_size)
    for s in range(num_seqs):
        if need[s] > table.shape[1]:
            raise ValueError(
                f"sequence {s}: seq_len={int(lens[s])} needs {int(need[s])} blocks of {block_size}, "
                f"block_tables has {table.shape[1]} columns"
            )
        used = table[s, : need[s]]
        if used.size and (used.min() < 0 or used.max() >= nb):
            raise ValueError(f"sequence {s}: block ids {used.tolist()} out of range for {nb} cache blocks")
    if sinks is not None and (sinks.ndim != 1 or sinks.shape[0] != hq or sinks.dtype != mx.float32):
        raise ValueError(
            f"sinks must be float32 [{hq}] (one per query head), got {sinks.dtype} {sinks.shape}"
        )
    if t == 0:
        return mx.zeros((0, hq, d), dtype=query.dtype)

    group = hq // hkv
    flat_k = key_cache.reshape(nb * bs * hkv, d)
    flat_v = value_cache.reshape(nb * bs * hkv, d)
    table_mx = mx.array(table.astype(np.int32))
    # flat row of (block b, offset o, head h) in the [NB*BS*Hkv, D] view: b*BS*Hkv + (o*Hkv + h)
    in_block = (mx.arange(block_size, dtype=mx.int32)[None, None, :] * hkv) + mx.arange(hkv, dtype=mx.int32)[
        :, None, None
    ]
    sink_g = None if sinks is None else sinks.reshape(hkv, group, 1, 1)
    outs = []
    for s in range(num_seqs):
        q0, q1 = int(cu[s]), int(cu[s + 1])
        rows = q1 - q0
        if rows == 0:
            continue
        seq_len = int(lens[s])
        first_eff = seq_len - rows + 1
        lo = max(0, first_eff - sliding_window) if sliding_window > 0 else 0
        b0, b1 = lo // block_size, -(-seq_len // block_size)
        rows_idx = table_mx[s, b0:b1][None, :, None] * (block_size * hkv) + in_block  # [Hkv, nblk, BS]
        rows_idx = rows_idx.reshape(hkv, (b1 - b0) * block_size)
        first = lo - b0 * block_size
        length = seq_len - lo
        if first or length != rows_idx.shape[1]:
            rows_idx = rows_idx[:, first : first + length]
        idx = rows_idx.reshape(-1)
        k = mx.take(flat_k, idx, axis=0).reshape(hkv, length, d).astype(mx.float32)
        v = mx.take(flat_v, idx, axis=0).reshape(hkv, length, d).astype(mx.float32)
        # [rows, Hq, D] -> [Hkv, G*rows, D]: row-block g*rows + r is query head h*G+g at row r.
        q = query[q0:q1].astype(mx.float32) * scale
        q = q.reshape(rows, hkv, group, d).transpose(1, 2, 0, 3).reshape(hkv, group * rows, d)
        if rows == 1:
            out_1 = _decode_rows(q, k, v, None if sink_g is None else sink_g.reshape(hkv, 1, group))
            outs.append(out_1.reshape(1, hq, d))
            continue
        scores = (q @ k.swapaxes(-1, -2)).reshape(hkv, group, rows, length)
        if rows > 1:
            eff = mx.arange(first_eff, seq_len + 1, dtype=mx.int32)[:, None]
            key_pos = mx.arange(lo, seq_len, dtype=mx.int32)[None, :]
            mask = key_pos < eff
            if sliding_window > 0:
                mask = mask & (key_pos >= eff - sliding_window)
            scores = mx.where(mask, scores, mx.array(-mx.inf, dtype=mx.float32))
        m = scores.max(axis=-1, keepdims=True)
        if sink_g is not None:
            m = mx.maximum(m, sink_g)
        e = mx.exp(scores - m)
        denom = e.sum(axis=-1, keepdims=True) + _DENOM_EPS
        if sink_g is not None:
            denom = denom + mx.exp(sink_g - m)
        o = (e.reshape(hkv, group * rows, length) @ v).reshape(hkv, group, rows, d)
        o = o / denom
        outs.append(o.transpose(2, 0, 1, 3).reshape(rows, hq, d))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    return out.astype(query.dtype)


def _decode_rows(q: mx.array, k: mx.array, v: mx.array, sink: mx.array | None) -> mx.array:
    """One query row per head, every gathered key attended: ``[Hkv, G, D]``.

    Scores are formed as ``K @ q^T`` (``[Hkv, L, G]``): with the reference BLAS of the CPU wheel
    this streams K once instead of once per query head (measured in docs/metal-runtime.md).
    """
    scores = k @ mx.contiguous(q.swapaxes(-1, -2))  # [Hkv, L, G]
    m = scores.max(axis=1, keepdims=True)
    if sink is not None:
        m = mx.maximum(m, sink)
    e = mx.exp(scores - m)
    denom = e.sum(axis=1, keepdims=True) + _DENOM_EPS
    if sink is not None:
        denom = denom + mx.exp(sink - m)
    return (e.swapaxes(-1, -2) @ v) / denom.swapaxes(-1, -2)


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

    Written in float64 numpy, independent of the paged path: GQA by ``np.repeat`` over heads, an
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
        k = np.repeat(k, hq // hkv, axis=1)  # [L, Hq, D]
        v = np.repeat(v, hq // hkv, axis=1)
        logits = np.einsum("rhd,thd->hrt", q, k) * scale  # [Hq, rows, L]
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
        out[cu[s] : cu[s + 1]] = np.einsum("hrt,thd->rhd", w / denom, v)
    return out.astype(np.float32)
