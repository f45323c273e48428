"""The planning calls as vLLM 0.33 spells them (``vllm/v1/core/kv_cache_planning.py``).

0.33 moved the planning functions out of ``kv_cache_utils``, groups the whole model once with
``get_global_kv_cache_groups`` and plans through a ``KVCacheConfigBuilder``
(``vllm/v1/core/kv_cache_config_builder.py``), which several functions take first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .runtime import vllm_runtime


def _builder(config: Any) -> Any:
    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder

    return get_kv_cache_config_builder(config)


def groups(config: Any, specs: Mapping[str, Any]) -> list[Any]:
    """``get_global_kv_cache_groups(vllm_config, [specs])``."""
    return list(vllm_runtime().fn("get_global_kv_cache_groups")(config, [dict(specs)]))


def kv_cache_config(config: Any, specs: Mapping[str, Any], available: int) -> Any:
    """``get_kv_cache_configs`` for one worker, with the global groups it takes in 0.33."""
    rt = vllm_runtime()
    fn = rt.fn("get_kv_cache_configs")
    return fn(config, [dict(specs)], [available], groups(config, specs))[0]


def pool_bytes_per_block(config: Any, kv_cache_groups: list[Any]) -> int:
    """``_pool_bytes_per_block_from_builder``."""
    return int(
        vllm_runtime().fn("_pool_bytes_per_block_from_builder")(_builder(config), config, kv_cache_groups)
    )


def max_memory_usage_bytes(config: Any, kv_cache_groups: list[Any]) -> int:
    """``_max_memory_usage_bytes_from_groups(builder, ...)``."""
    fn = vllm_runtime().fn("_max_memory_usage_bytes_from_groups")
    return int(fn(_builder(config), config, kv_cache_groups))


def estimate_max_model_len(config: Any, kv_cache_groups: list[Any], available: int) -> int:
    """``_estimate_max_model_len_from_groups(builder, ...)``."""
    fn = vllm_runtime().fn("_estimate_max_model_len_from_groups")
    return int(fn(_builder(config), config, kv_cache_groups, available))
