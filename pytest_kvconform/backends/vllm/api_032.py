"""The planning calls as vLLM up to 0.32 spells them (``vllm/v1/core/kv_cache_utils.py``).

Delete this module (and its name in ``runtime.py``) when vLLM 0.32 is no longer supported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .runtime import vllm_runtime


def groups(config: Any, specs: Mapping[str, Any]) -> list[Any]:
    """``get_kv_cache_groups(vllm_config, specs)``."""
    return list(vllm_runtime().fn("get_kv_cache_groups")(config, dict(specs)))


def kv_cache_config(config: Any, specs: Mapping[str, Any], available: int) -> Any:
    """``get_kv_cache_configs`` for one worker (it groups the layers itself)."""
    return vllm_runtime().fn("get_kv_cache_configs")(config, [dict(specs)], [available])[0]


def pool_bytes_per_block(config: Any, kv_cache_groups: list[Any]) -> int:
    """``_pool_bytes_per_block`` (its signature changed in 0.29 and 0.32: ``compat``)."""
    from .compat import pool_bytes_per_block

    return pool_bytes_per_block(config, kv_cache_groups)


def max_memory_usage_bytes(config: Any, kv_cache_groups: list[Any]) -> int:
    """``_max_memory_usage_bytes_from_groups``."""
    return int(vllm_runtime().fn("_max_memory_usage_bytes_from_groups")(config, kv_cache_groups))


def estimate_max_model_len(config: Any, kv_cache_groups: list[Any], available: int) -> int:
    """``_estimate_max_model_len_from_groups``."""
    fn = vllm_runtime().fn("_estimate_max_model_len_from_groups")
    return int(fn(config, kv_cache_groups, available))
