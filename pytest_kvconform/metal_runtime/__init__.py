"""A paged-attention runtime on MLX following the vllm-metal kernel contract.

On Apple Silicon it runs on the Metal GPU; on Linux it runs on the CPU through ``mlx[cpu]``.
The contract (layouts, slot mapping, causal/window/sink semantics, block-size translation)
is vllm-metal's (vllm-project/vllm-metal @ 211a1e4: ``vllm_metal/attention/impls/sdpa.py``
``_pick_kernel_block_size``/``_build_block_tables``/``sdpa_forward``, ``vllm_metal/metal/paged_ops.cpp``
and ``vllm_metal/metal/kernels_v2/pagedattention.metal``); the code here is our own.

Importing this package does not import mlx: the names below are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from .blocks import KERNEL_BLOCK_SIZES, pick_kernel_block_size

_LAZY = {
    "build_block_tables": "blocks",
    "reshape_cache_for_kernel": "blocks",
    "reshape_and_cache": "attention",
    "paged_attention": "attention",
    "paged_attention_logical": "attention",
    "dense_attention": "attention",
    "DTYPE_TOLERANCES": "attention",
    "KVPool": "pool",
    "PoolLayer": "pool",
    "attention_layer": "pool",
    "mla_layer": "pool",
    "state_layer": "pool",
    "layers_from_scenario": "pool",
    "tune_cpu_allocator": "cpu_tuning",
}

__all__ = ["KERNEL_BLOCK_SIZES", "pick_kernel_block_size", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
