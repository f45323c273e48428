"""Paged-attention decode benchmarks: the selected backend's kernel, else the bundled MLX runtime.

A backend with a ``paged_attention`` method (the signature of
:func:`pytest_kvconform.metal_runtime.paged_attention`) is timed with its own kernel; any other
backend (``metal`` included: its kernel *is* the bundled runtime) with ``pytest_kvconform.metal_runtime``.
``extra_info["implementation"]`` says which.

Shape: 8 sequences x 2048 tokens, 32 query heads, 8 KV heads, head_dim 128,
fp32 (the fastest dtype of MLX on CPU, ``notes/environment.md`` §2). Paged runs at kernel
blocks 8/16/32 and at the translated logical blocks 160 and 400; the dense baseline is
``mx.fast.scaled_dot_product_attention`` on the same K/V, contiguous and head-major.
``extra_info`` records the K/V bytes read and the effective GB/s (K/V bytes / min time).

The cases run only with ``--benchmark-only`` (skipped otherwise): the glibc allocator is tuned
first (``tune_cpu_allocator``, for paged and dense alike) and pytest-benchmark takes several
rounds (one round under ``--benchmark-disable``). No timing is asserted; every case checks its
output against the dense result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
np = pytest.importorskip("numpy")

from pytest_kvconform import metal_runtime  # noqa: E402
from pytest_kvconform.metal_runtime import (  # noqa: E402
    build_block_tables,
    reshape_cache_for_kernel,
    tune_cpu_allocator,
)

pytestmark = pytest.mark.kvconform_benchmark

B, CTX, HQ, HKV, D = 8, 2048, 32, 8, 128
DTYPE = mx.float32
KV_BYTES = 2 * B * CTX * HKV * D * 4  # K and V, fp32: 128 MiB


def kernel(backend: Any) -> tuple[Callable[..., mx.array], str]:
    """The selected backend's paged-attention kernel where it has one, else the bundled runtime's."""
    own = getattr(backend, "paged_attention", None)
    if callable(own):
        return own, f"backend {backend.name}"
    return metal_runtime.paged_attention, "bundled MLX runtime"


@pytest.fixture(scope="module")
def data() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((B, CTX, HKV, D), dtype=np.float32)
    values = rng.standard_normal((B, CTX, HKV, D), dtype=np.float32)
    query = rng.standard_normal((B, HQ, D), dtype=np.float32)
    dense_k = mx.array(np.ascontiguousarray(keys.transpose(0, 2, 1, 3)))  # [B, Hkv, L, D]
    dense_v = mx.array(np.ascontiguousarray(values.transpose(0, 2, 1, 3)))
    q = mx.array(query)
    mx.eval(dense_k, dense_v, q)
    return {"keys": keys, "values": values, "q": q, "dense_k": dense_k, "dense_v": dense_v, "scale": D**-0.5}


def paged_cache(data: dict[str, Any], block_size: int) -> tuple[mx.array, mx.array, list[list[int]]]:
    """Scatter each sequence's blocks over a shuffled pool with a few spare blocks."""
    per_seq = -(-CTX // block_size)  # the last block of 160/400 is partly filled
    num_blocks = B * per_seq + 4
    ids = np.random.default_rng(block_size).permutation(num_blocks)[: B * per_seq].reshape(B, per_seq)
    caches = []
    for name in ("keys", "values"):
        tokens = np.zeros((B, per_seq * block_size, HKV, D), dtype=np.float32)
        tokens[:, :CTX] = data[name]
        cache = np.zeros((num_blocks, block_size, HKV, D), dtype=np.float32)
        cache[ids.reshape(-1)] = tokens.reshape(B * per_seq, block_size, HKV, D)
        caches.append(mx.array(cache))
    mx.eval(*caches)
    return caches[0], caches[1], ids.tolist()


def run(benchmark: Any, fn: Callable[[], mx.array]) -> mx.array:
    def call() -> mx.array:
        out = fn()
        mx.eval(out)
        return out

    if benchmark.disabled:
        return benchmark.pedantic(call, rounds=1, iterations=1)
    tune_cpu_allocator()
    call()  # warm-up
    return benchmark.pedantic(call, rounds=7, iterations=1, warmup_rounds=0)


def record(benchmark: Any, kind: str, block_size: int | None) -> None:
    info = benchmark.extra_info
    info.update(
        kind=kind,
        block_size=block_size,
        kv_bytes_read=KV_BYTES,
        shape=f"B{B}xL{CTX} Hq{HQ} Hkv{HKV} D{D} f32",
    )
    stats = getattr(benchmark, "stats", None)
    if stats is not None and getattr(stats, "stats", None) is not None:
        info["gb_per_s"] = round(KV_BYTES / stats.stats.min / 1e9, 3)


def dense(data: dict[str, Any]) -> mx.array:
    q = data["q"][:, :, None, :]  # [B, Hq, 1, D]
    out = mx.fast.scaled_dot_product_attention(q, data["dense_k"], data["dense_v"], scale=data["scale"])
    return out.reshape(B, HQ, D)


@pytest.fixture(scope="module")
def reference(data: dict[str, Any]) -> np.ndarray:
    out = dense(data)
    mx.eval(out)
    return np.array(out)


def test_bench_dense_sdpa(benchmark: Any, data: dict[str, Any], reference: np.ndarray) -> None:
    out = run(benchmark, lambda: dense(data))
    record(benchmark, "dense-sdpa", None)
    np.testing.assert_allclose(np.array(out), reference, atol=1e-5)


@pytest.mark.parametrize("block_size", [8, 16, 32, 160, 400])
def test_bench_paged_decode(
    benchmark: Any, kv_backend: Any, data: dict[str, Any], reference: np.ndarray, block_size: int
) -> None:
    paged_attention, implementation = kernel(kv_backend)
    k_cache, v_cache, rows = paged_cache(data, block_size)
    table, kbs = build_block_tables(rows, block_size)  # translation outside the timed call
    k_cache, v_cache = reshape_cache_for_kernel(k_cache, kbs), reshape_cache_for_kernel(v_cache, kbs)
    seq_lens = mx.array([CTX] * B, dtype=mx.int32)
    cu = mx.arange(B + 1, dtype=mx.int32)

    def call() -> mx.array:
        return paged_attention(
            data["q"], k_cache, v_cache, table, seq_lens, cu,
            block_size=kbs, scale=data["scale"], num_kv_heads=HKV,
        )  # fmt: skip

    out = run(benchmark, call)
    record(benchmark, "paged", block_size)
    benchmark.extra_info.update(kernel_block_size=kbs, implementation=implementation)
    np.testing.assert_allclose(np.array(out), reference, atol=1e-4, rtol=1e-4)
