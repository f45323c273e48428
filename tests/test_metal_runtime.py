"""Tests of the MLX paged-attention runtime (``pytest_kvconform.metal_runtime``).

Expected values come from the float64 dense oracle fed with the contiguous K/V that were written
into the paged cache, from vllm-metal's source and tests (vllm-project/vllm-metal @ 211a1e4, cited
by file and function, or by PR as ``vllm-metal#N``), or from first principles (element counts times
element sizes).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

mx = pytest.importorskip("mlx.core")

from pytest_kvconform.metal_runtime import (  # noqa: E402
    KERNEL_BLOCK_SIZES,
    KVPool,
    attention_layer,
    build_block_tables,
    dense_attention,
    mla_layer,
    paged_attention,
    paged_attention_logical,
    pick_kernel_block_size,
    reshape_and_cache,
    reshape_cache_for_kernel,
    state_layer,
)

# (atol, rtol) of vllm-metal's kernel parity checks (e.g. TOLS in tools/spec_window_parity.py).
TOL = {"bfloat16": (3e-2, 2e-2), "float16": (1.5e-2, 2e-2), "float32": (1e-3, 1e-3)}
MX = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


# --------------------------------------------------------------------------- helpers


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` and back to float32, so the oracle sees what the cache holds."""
    return np.array(mx.array(x.astype(np.float32)).astype(MX[dtype]).astype(mx.float32))


class Case:
    """Random contiguous K/V per sequence, written into a paged cache via slot mapping."""

    def __init__(
        self,
        seq_lens: list[int],
        q_lens: list[int],
        *,
        hq: int = 8,
        hkv: int = 2,
        d: int = 16,
        block_size: int = 16,
        dtype: str = "float32",
        seed: int = 0,
        spare_blocks: int = 3,
    ) -> None:
        rng = np.random.default_rng(seed)
        self.seq_lens, self.q_lens, self.hq, self.hkv, self.d = seq_lens, q_lens, hq, hkv, d
        self.block_size, self.dtype = block_size, dtype
        self.keys = [rounded(rng.standard_normal((n, hkv, d)), dtype) for n in seq_lens]
        self.values = [rounded(rng.standard_normal((n, hkv, d)), dtype) for n in seq_lens]
        self.query = rounded(rng.standard_normal((sum(q_lens), hq, d)), dtype)
        self.cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        need = [-(-n // block_size) for n in seq_lens]
        self.num_blocks = sum(need) + spare_blocks
        ids = rng.permutation(self.num_blocks)  # blocks scattered over the pool
        self.rows, start = [], 0
        for n in need:
            self.rows.append([int(b) for b in ids[start : start + n]])
            start += n
        shape = (self.num_blocks, block_size, hkv, d)
        self.k_cache = mx.zeros(shape, dtype=MX[dtype])
        self.v_cache = mx.zeros(shape, dtype=MX[dtype])
        for s, n in enumerate(seq_lens):
            slots = [self.rows[s][t // block_size] * block_size + t % block_size for t in range(n)]
            self.k_cache, self.v_cache = reshape_and_cache(
                mx.array(self.keys[s]).astype(MX[dtype]),
                mx.array(self.values[s]).astype(MX[dtype]),
                self.k_cache,
                self.v_cache,
                np.array(slots, dtype=np.int64),
            )
        self.scale = d**-0.5

    def table(self) -> np.ndarray:
        width = max(len(r) for r in self.rows)
        return np.array([r + [0] * (width - len(r)) for r in self.rows], dtype=np.int32)

    def paged(self, **kw: object) -> np.ndarray:
        fn = paged_attention if self.block_size in KERNEL_BLOCK_SIZES else None
        q = mx.array(self.query).astype(MX[self.dtype])
        if fn is None:
            out = paged_attention_logical(
                q, self.k_cache, self.v_cache, self.rows, self.seq_lens, self.cu,
                scale=self.scale, num_kv_heads=self.hkv, **kw,
            )  # fmt: skip
        else:
            out = paged_attention(
                q, self.k_cache, self.v_cache, self.table(), self.seq_lens, self.cu,
                block_size=self.block_size, scale=self.scale, num_kv_heads=self.hkv, **kw,
            )  # fmt: skip
        assert out.dtype == MX[self.dtype]
        assert out.shape == (sum(self.q_lens), self.hq, self.d)
        return np.array(out.astype(mx.float32))

    def dense(self, **kw: object) -> np.ndarray:
        return dense_attention(self.query, self.keys, self.values, self.cu, scale=self.scale, **kw)

    def check(self, **kw: object) -> np.ndarray:
        out = self.paged(**kw)
        atol, rtol = TOL[self.dtype]
        np.testing.assert_allclose(out, self.dense(**kw), atol=atol, rtol=rtol)
        return out


# --------------------------------------------------------------------------- import hygiene


def test_package_import_does_not_import_mlx() -> None:
    code = (
        "import sys, pytest_kvconform.metal_runtime as m; "
        "m.pick_kernel_block_size(16); print('mlx' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- translation (vllm-metal sdpa.py)


@pytest.mark.parametrize(
    ("block_size", "kernel", "ratio"),
    [
        (160, 32, 5),
        (544, 32, 17),
        (144, 16, 9),
        (48, 16, 3),
        (24, 8, 3),
        (1808, 16, 113),
        (16, 16, 1),
        (8, 8, 1),
    ],
)
def test_pick_kernel_block_size(block_size: int, kernel: int, ratio: int) -> None:
    assert KERNEL_BLOCK_SIZES == (32, 16, 8)
    assert pick_kernel_block_size(block_size) == kernel
    assert block_size // kernel == ratio


@pytest.mark.parametrize("block_size", [7, 12, 100, 4])
def test_pick_kernel_block_size_rejects(block_size: int) -> None:
    with pytest.raises(ValueError, match=rf"block_size={block_size}\b.*\(32, 16, 8\)"):
        pick_kernel_block_size(block_size)


def test_build_block_tables_expands_after_padding() -> None:
    table, kbs = build_block_tables([[0, 2], [1]], 160)  # vllm-metal sdpa.py, _build_block_tables example
    assert kbs == 32
    assert table.dtype == mx.int32
    assert table.tolist() == [[0, 1, 2, 3, 4, 10, 11, 12, 13, 14], [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]]


def test_build_block_tables_kernel_sizes_only_pad() -> None:
    table, kbs = build_block_tables([[3, 1], [2]], 16)
    assert (table.tolist(), kbs) == ([[3, 1], [2, 0]], 16)
    empty, kbs = build_block_tables([], 400)
    assert empty.shape == (0, 0) and kbs == 16
    with pytest.raises(ValueError, match="block_size=7"):
        build_block_tables([[0]], 7)


def test_reshape_cache_for_kernel_is_a_view_of_the_same_tokens() -> None:
    cache = mx.arange(3 * 160 * 2 * 64, dtype=mx.float32).reshape(3, 160, 2, 64)
    kernel = reshape_cache_for_kernel(cache, 32)
    assert kernel.shape == (15, 32, 2, 64)  # vllm-metal sdpa_forward's zero-copy reshape
    # token t of logical block b is token t % 32 of kernel block b*5 + t // 32
    for b, t in [(0, 0), (1, 37), (2, 159)]:
        assert mx.array_equal(kernel[b * 5 + t // 32, t % 32], cache[b, t])


# --------------------------------------------------------------------------- reshape_and_cache


def test_reshape_and_cache_writes_slots_and_skips_negative() -> None:
    nb, bs, h, d = 4, 8, 2, 4
    kc = mx.zeros((nb, bs, h, d))
    vc = mx.zeros((nb, bs, h, d))
    key = mx.arange(3 * h * d, dtype=mx.float32).reshape(3, h, d) + 1
    value = -key
    kc2, vc2 = reshape_and_cache(key, value, kc, vc, np.array([9, -1, 31], dtype=np.int64))
    k = np.array(kc2)
    assert np.array_equal(k[1, 1], np.array(key[0]))  # slot 9 = block 1, offset 1
    assert np.array_equal(k[3, 7], np.array(key[2]))  # slot 31 = block 3, offset 7
    assert np.count_nonzero(k) == 2 * h * d  # the -1 token went nowhere
    assert np.array_equal(np.array(vc2), -k)
    assert np.count_nonzero(np.array(kc)) == 0  # inputs are not modified


def test_reshape_and_cache_rejects_out_of_range_slot() -> None:
    kc = mx.zeros((2, 8, 1, 4))
    tok = mx.ones((2, 1, 4))
    with pytest.raises(ValueError, match=r"slot_mapping\[1\]=16 is out of range.*2 blocks x 8 tokens"):
        reshape_and_cache(tok, tok, kc, kc, np.array([3, 16]))


def test_slot_mapping_is_not_translated() -> None:
    """A write at ``b*160 + off`` lands at kernel block ``b*5 + off//32``, offset ``off % 32``."""
    kc = mx.zeros((2, 160, 1, 4))
    tok = mx.full((1, 1, 4), 7.0)
    kc, _ = reshape_and_cache(tok, tok, kc, kc, np.array([160 + 100]))
    assert float(reshape_cache_for_kernel(kc, 32)[5 + 3, 4, 0, 0]) == 7.0


# --------------------------------------------------------------------------- paged vs dense


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_matches_dense(dtype: str, block_size: int) -> None:
    Case([1, 37, 64, 100], [1, 1, 1, 1], block_size=block_size, dtype=dtype).check()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_mixed_prefill_and_decode_matches_dense(dtype: str) -> None:
    # decode rows first, then prefill rows (a fresh prompt and a chunked continuation)
    Case([50, 33, 20, 70], [1, 1, 20, 9], dtype=dtype, seed=1).check()


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2), (8, 1), (12, 4)])
def test_gqa_grouping(hq: int, hkv: int) -> None:
    case = Case([40, 9], [1, 5], hq=hq, hkv=hkv, seed=2)
    out = case.check()
    # contiguous grouping: query heads sharing a KV head with identical queries agree
    if hq > hkv:
        case.query[:, 1] = case.query[:, 0]
        out = case.paged()
        np.testing.assert_array_equal(out[:, 1], out[:, 0])


def test_gqa_rejects_indivisible_heads() -> None:
    case = Case([10], [1], hq=6, hkv=4)
    with pytest.raises(ValueError, match="num_query_heads=6 must be a positive multiple of num_kv_heads=4"):
        case.paged()


@pytest.mark.parametrize("window", [1, 5, 16, 200])
def test_sliding_window(window: int) -> None:
    case = Case([60, 45, 12], [1, 7, 12], seed=3)
    out = case.check(sliding_window=window)
    if window < 45:
        assert not np.allclose(out, case.dense())  # the window really cut something


def test_window_of_one_returns_own_value() -> None:
    """With ``sliding_window=1`` each row attends only itself (pagedattention.metal): out = v[eff-1]."""
    case = Case([30], [4], hq=2, hkv=2, seed=4)
    out = case.paged(sliding_window=1)
    expected = case.values[0][26:30]  # rows at positions 26..29, one KV head per query head
    np.testing.assert_allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sinks(dtype: str) -> None:
    case = Case([48, 19], [1, 6], dtype=dtype, seed=5)
    sinks = mx.array(np.linspace(-2.0, 3.0, case.hq).astype(np.float32))
    out = case.check(sinks=sinks, sliding_window=8)
    assert not np.allclose(out, case.dense(sliding_window=8), atol=1e-3)


def test_large_sink_scales_output_towards_zero() -> None:
    """A sink logit far above every score leaves only ``exp(s-sink)/...`` weight: output -> 0."""
    case = Case([20], [1], seed=6)
    out = case.paged(sinks=mx.full((case.hq,), 60.0, dtype=mx.float32))
    assert np.abs(out).max() < 1e-12


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("window", [-1, 7])
def test_batched_decode_of_ragged_lengths_matches_dense(dtype: str, window: int) -> None:
    """Decode rows of different lengths share one padded gather (masked padding keys) and come
    back in packed order, although the batch is formed longest first."""
    case = Case([90, 100, 95, 99], [1, 1, 1, 1], block_size=8, dtype=dtype, seed=14)  # one batch
    case.check(sliding_window=window)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("window", [-1, 5])
def test_decode_ignores_unwritten_slots_of_attended_blocks(window: int, block_size: int) -> None:
    """The decode path copies whole blocks: slots outside ``[lo, seq_len)`` (the tail of the last
    block, the head of the first under a window, spare blocks) may hold anything, NaN and inf
    included, and never reach the output."""
    case = Case([37, 64, 20, 9, 33], [1, 1, 1, 1, 1], block_size=block_size, seed=18)
    bs = case.block_size
    written = np.zeros(case.num_blocks * bs, dtype=bool)
    for s, n in enumerate(case.seq_lens):
        written[[case.rows[s][t // bs] * bs + t % bs for t in range(n)]] = True
    keep = mx.array(written.reshape(case.num_blocks, bs, 1, 1))
    case.k_cache = mx.where(keep, case.k_cache, mx.array(np.nan, dtype=mx.float32))
    case.v_cache = mx.where(keep, case.v_cache, mx.array(np.inf, dtype=mx.float32))
    assert np.isfinite(case.check(sliding_window=window)).all()


def test_batched_decode_with_sinks_and_gqa_matches_dense() -> None:
    seq_lens = [int(n) for n in np.random.default_rng(15).integers(1, 300, size=12)]
    case = Case(seq_lens, [1] * 12, hq=8, hkv=2, block_size=32, seed=15)
    case.check(sinks=mx.array(np.linspace(-1.0, 2.0, 8).astype(np.float32)))


@pytest.mark.parametrize(
    ("hkv", "d", "dtype"),
    [
        (4, 128, "float32"),  # 2 KiB of keys a token: four 512 B pieces and a spare one
        (8, 128, "bfloat16"),  # the same in bf16: 256-element pieces
        (2, 96, "float32"),  # 768 B: three 256 B pieces, no spare
        (1, 24, "float16"),  # 48 B: too small to split, whole token rows
    ],
)
def test_decode_key_rows_in_pieces_match_dense(hkv: int, d: int, dtype: str) -> None:
    """The decode path copies each token's keys in pieces of at most 512 B, with a spare piece
    when a token's keys fill a multiple of 2 KiB; the scores see exactly the token's keys."""
    case = Case([70, 61, 53], [1, 1, 1], hq=2 * hkv, hkv=hkv, d=d, block_size=8, dtype=dtype, seed=21)
    case.check()


def test_batched_prefill_rows_of_similar_shape_match_dense() -> None:
    """Prefill sequences of similar shape are padded to the longest (padding rows are dropped)."""
    Case([60, 64, 50, 70, 9], [3, 4, 1, 0, 9], seed=16).check()
    Case([60, 64, 50, 70, 9], [3, 4, 1, 0, 9], seed=16).check(sliding_window=5)


def test_batches_split_by_memory_bound_match_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a tiny batch-memory bound every sequence is its own batch; the result is unchanged."""
    from pytest_kvconform.metal_runtime import attention

    case = Case([90, 100, 95, 99, 40], [1, 1, 1, 1, 3], seed=17)
    expected = case.check()
    monkeypatch.setattr(attention, "_BATCH_BYTES", 1)
    np.testing.assert_allclose(case.check(), expected, atol=1e-6, rtol=1e-6)


def test_cpu_exp_matches_numpy() -> None:
    """The whole-array exp used for the softmax weights on the CPU (``exp(x)`` for ``x <= 0``)."""
    from pytest_kvconform.metal_runtime.attention import _exp_nonpositive

    x = np.concatenate([-np.geomspace(1e-8, 80.0, 4001), [0.0, -87.0]]).astype(np.float32)
    got = np.array(_exp_nonpositive(mx.array(x)))
    np.testing.assert_allclose(got, np.exp(x.astype(np.float64)), rtol=5e-6, atol=0)
    edge = np.array(_exp_nonpositive(mx.array(np.array([-np.inf, -1000.0, -100.0], dtype=np.float32))))
    np.testing.assert_array_equal(edge, [0.0, 0.0, 0.0])


def test_rejects_bad_metadata() -> None:
    case = Case([10, 4], [1, 5])
    with pytest.raises(ValueError, match="seq_len=4 < q_len=5"):
        case.paged()
    case = Case([10], [1])
    q = mx.array(case.query)
    with pytest.raises(ValueError, match="block_size=24 is not a kernel block size"):
        paged_attention(q, case.k_cache, case.v_cache, case.table(), [10], [0, 1], block_size=24, scale=1.0,
                        num_kv_heads=2)  # fmt: skip
    with pytest.raises(ValueError, match="dtypes must match"):
        paged_attention(q.astype(mx.float16), case.k_cache, case.v_cache, case.table(), [10], [0, 1],
                        block_size=16, scale=1.0, num_kv_heads=2)  # fmt: skip
    with pytest.raises(ValueError, match="needs 2 blocks"):
        paged_attention(q, case.k_cache, case.v_cache, case.table(), [20], [0, 1], block_size=16, scale=1.0,
                        num_kv_heads=2)  # fmt: skip


@pytest.mark.parametrize(("logical", "kernel"), [(160, 32), (400, 16)])
def test_translated_block_size_matches_kernel_block(logical: int, kernel: int) -> None:
    assert pick_kernel_block_size(logical) == kernel
    seq_lens, q_lens = [logical + 37, 2 * logical + 1, 9], [1, 3, 9]
    big = Case(seq_lens, q_lens, block_size=logical, seed=7, spare_blocks=2)
    small = Case(seq_lens, q_lens, block_size=kernel, seed=7, spare_blocks=2)
    out_big = big.check(sliding_window=300)
    out_small = small.check(sliding_window=300)
    np.testing.assert_allclose(out_big, out_small, atol=1e-6, rtol=1e-6)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    num_seqs=st.integers(1, 3),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([8, 16]),
    block_size=st.sampled_from([8, 16, 32, 24, 48]),
    window=st.sampled_from([-1, 1, 3, 20]),
    use_sinks=st.booleans(),
)
def test_property_paged_matches_dense(
    data: st.DataObject,
    num_seqs: int,
    hkv: int,
    group: int,
    d: int,
    block_size: int,
    window: int,
    use_sinks: bool,
) -> None:
    seq_lens = [data.draw(st.integers(1, 70)) for _ in range(num_seqs)]
    q_lens = [data.draw(st.integers(0, min(n, 6))) for n in seq_lens]
    if sum(q_lens) == 0:
        q_lens[0] = 1
    case = Case(seq_lens, q_lens, hq=hkv * group, hkv=hkv, d=d, block_size=block_size, seed=sum(seq_lens))
    sinks = mx.array(np.linspace(-1, 1, hkv * group).astype(np.float32)) if use_sinks else None
    case.check(sliding_window=window, sinks=sinks)


# --------------------------------------------------------------------------- KV pool


def test_pool_bytes_from_allocation() -> None:
    layers = [
        attention_layer(4, 64, "bfloat16"),
        attention_layer(2, 128, "float32"),
        mla_layer(512, 64, "bfloat16"),
    ]
    pool = KVPool(layers, num_blocks=10, block_size=16)
    # first principles: K+V = 2*bs*H*D*itemsize; MLA latent = bs*(rank+rope)*itemsize (1x)
    expected = 2 * 16 * 4 * 64 * 2 + 2 * 16 * 2 * 128 * 4 + 16 * 576 * 2
    assert pool.bytes_per_block() == expected
    assert pool.bytes_held() == 10 * pool.bytes_per_block()
    assert pool.caches[0]["k"].shape == (10, 16, 4, 64)
    assert set(pool.caches[2]) == {"latent"}
    assert KVPool.num_blocks_for_budget(10 * expected + expected - 1, expected) == 10
    assert KVPool.num_blocks_for_budget(-5, expected) == 0


def test_pool_state_slots() -> None:
    """Qwen3.5-0.8B GDN state: conv (3, 6144) bf16 + recurrent (16,128,128) fp32 = 1,085,440 B.

    The recurrent state is fp32 in vllm-metal (vllm-metal#243, #579).
    """
    gdn = state_layer((3, 6144), "bfloat16", (16, 128, 128), "float32")
    pool = KVPool(
        [attention_layer(2, 256, "bfloat16"), gdn, gdn], num_blocks=3, block_size=32, num_state_slots=2
    )
    assert pool.caches[1]["recurrent"].dtype == mx.float32
    assert pool.caches[1]["conv"].dtype == mx.bfloat16
    assert pool.state_bytes_per_slot() == 2 * 1_085_440
    assert pool.bytes_held() == 3 * pool.bytes_per_block() + 2 * pool.state_bytes_per_slot()
    assert pool.bytes_per_block() == 2 * 32 * 2 * 256 * 2


def test_one_sequence_bytes_notes_vector() -> None:
    """vllm-metal#229 test: L=4, H=4, D=64, fp16, max_model_len 2048, block 400 -> 2*4*2400*4*64*2."""
    layers = [attention_layer(4, 64, "float16")] * 4
    assert KVPool.one_sequence_bytes(2048, 400, layers) == 2 * 4 * 2400 * 4 * 64 * 2
    mla = [mla_layer(512, 64, "bfloat16")] * 2
    assert KVPool.one_sequence_bytes(100, 16, mla) == 2 * 112 * 576 * 2  # one latent, no V
    gdn = state_layer((3, 6144), "bfloat16", (16, 128, 128), "float32")
    assert KVPool.one_sequence_bytes(10, 544, [attention_layer(2, 256, "bfloat16"), gdn]) == (
        2 * 544 * 2 * 256 * 2 + 1_085_440
    )


def fill_and_attend(
    pool: KVPool, layer: int, n_tokens: int, rows: list[int], hq: int, q_tail: int = 1
) -> None:
    """Write ``n_tokens`` into one layer through slot mapping, then attend and compare with dense."""
    lay = pool.layers[layer]
    dtype, bs = lay.dtype, pool.block_size
    rng = np.random.default_rng(n_tokens)
    keys = rounded(rng.standard_normal((n_tokens, lay.num_kv_heads, lay.head_dim)), dtype)
    values = rounded(rng.standard_normal((n_tokens, lay.num_kv_heads, lay.head_dim)), dtype)
    slots = np.array([rows[t // bs] * bs + t % bs for t in range(n_tokens)], dtype=np.int64)
    caches = pool.caches[layer]
    caches["k"], caches["v"] = reshape_and_cache(
        mx.array(keys).astype(MX[dtype]), mx.array(values).astype(MX[dtype]), caches["k"], caches["v"], slots
    )
    query = rounded(rng.standard_normal((q_tail, hq, lay.head_dim)), dtype)
    cu = [0, q_tail]
    scale = lay.head_dim**-0.5
    out = paged_attention_logical(
        mx.array(query).astype(MX[dtype]), caches["k"], caches["v"], [rows], [n_tokens], cu,
        scale=scale, num_kv_heads=lay.num_kv_heads,
    )  # fmt: skip
    atol, rtol = TOL[dtype]
    ref = dense_attention(query, [keys], [values], cu, scale=scale)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), ref, atol=atol, rtol=rtol)


def test_pool_sized_by_one_sequence_bytes_holds_max_model_len() -> None:
    layers = [attention_layer(2, 16, "float32"), attention_layer(2, 16, "float32")]
    budget = KVPool.one_sequence_bytes(100, 24, layers)
    per_block = KVPool(layers, 1, 24).bytes_per_block()
    blocks = KVPool.num_blocks_for_budget(budget, per_block)
    assert blocks == 5  # cdiv(100, 24)
    pool = KVPool(layers, blocks, 24)
    assert pool.capacity_tokens >= 100
    fill_and_attend(pool, 1, 100, [4, 0, 3, 1, 2], hq=4, q_tail=3)


def test_granite_block_400_needs_aligned_estimate() -> None:
    """vllm-project/vllm-metal#229: Granite 4.0-H at block 400, max_model_len 2048.

    The un-aligned estimate (2048 tokens of bytes) buys 5 blocks = 2000 tokens, so a full
    sequence cannot be written; the aligned one (2400 tokens) buys 6 blocks and the sequence fits.
    """
    from pytest_kvconform.metal_runtime import layers_from_scenario
    from pytest_kvconform.scenario import load_scenario

    layers = layers_from_scenario(load_scenario("granite-4.0-h-tiny"), include_state=False)
    assert [(x.kind, x.num_kv_heads, x.head_dim, x.dtype) for x in layers] == [
        ("attention", 4, 128, "bfloat16")
    ] * 4
    per_block = KVPool(layers, 1, 400).bytes_per_block()
    assert per_block // 400 == 8192  # scenario expect kv_bytes_per_token = 2*4*4*128*2

    old = KVPool.num_blocks_for_budget(2048 * per_block // 400, per_block)
    assert old == 5
    small = KVPool(layers, old, 400)
    assert small.capacity_tokens == 2000 < 2048
    with pytest.raises(ValueError, match="out of range"):
        fill_and_attend(small, 0, 2048, [0, 1, 2, 3, 4, 5], hq=8)

    aligned = KVPool.num_blocks_for_budget(KVPool.one_sequence_bytes(2048, 400, layers), per_block)
    assert aligned == 6
    pool = KVPool(layers, aligned, 400)
    assert pool.bytes_held() == 6 * per_block
    fill_and_attend(pool, 3, 2048, [5, 2, 0, 4, 1, 3], hq=8, q_tail=2)


def test_pool_from_scenario_gdn_state_is_fp32() -> None:
    from pytest_kvconform.scenario import load_scenario

    pool = KVPool.from_scenario(load_scenario("qwen3.5-0.8b"), num_blocks=2, block_size=544, scale_layers=6)
    kinds = [x.kind for x in pool.layers]
    assert kinds == ["attention"] + ["state"] * 3  # 6 SDPA + 18 GDN layers, scaled by 6
    assert pool.state_bytes_per_slot() == 3 * 1_085_440  # 3*6144*2 + 16*128*128*4 per GDN layer
    assert pool.bytes_per_block() == 544 * 2 * 2 * 256 * 2  # attn 1-token page 2*2*256*2 = 2048 B
