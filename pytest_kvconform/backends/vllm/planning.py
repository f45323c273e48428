"""Page unification, grouping, the pool plan and the admission check, answered by vLLM.

vLLM code (``P`` = ``vllm/v1/core/kv_cache_planning.py`` in 0.33, ``kv_cache_utils.py``
before): ``unify_kv_cache_spec_page_size``, ``get_kv_cache_groups`` (0.33:
``get_global_kv_cache_groups``), ``_get_kv_cache_bytes_per_block``, ``get_kv_cache_configs``
with its ``_check_enough_kv_cache_memory``, ``_max_memory_usage_bytes_from_groups``,
``_pool_bytes_per_block`` (0.33: ``_pool_bytes_per_block_from_builder``),
``_estimate_max_model_len_from_groups`` (all ``P``), ``get_max_concurrency_for_kv_cache_config``
(``kv_cache_utils.py``) and ``resolve_kv_cache_layout`` (v1/attention/backends/utils.py).
The release-specific calling conventions live in ``api_032`` / ``api_033``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...model import KVCacheGroup, MemoryCheck
from ...reference.specs import KVCacheSpec
from ...scenario import RuntimeSettings
from .config_view import VllmConfigView, spec_level_config
from .runtime import UnsupportedByVllmError, vllm_runtime
from .specs import from_vllm_spec, spec_kind, to_vllm_spec


def unify_page_sizes(specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """``unify_kv_cache_spec_page_size`` (vLLM's only policy: ``pad-to-max``). Its
    ``NotImplementedError`` propagates with vLLM's text."""
    unify = vllm_runtime().fn("unify_kv_cache_spec_page_size")
    unified = unify({name: to_vllm_spec(s) for name, s in specs.items()})
    return {name: from_vllm_spec(v, specs[name]) for name, v in unified.items()}


def _resolve_layout(config: VllmConfigView, vllm_specs: Mapping[str, Any]) -> None:
    """``resolve_kv_cache_layout`` with the default layout preference (no backend declares one)."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

    names = [layout.name for layout in get_supported_kv_cache_layouts([])]
    resolve_kv_cache_layout(config, [names], list(vllm_specs.values()))


def _groups(config: VllmConfigView, vllm_specs: Mapping[str, Any]) -> list[Any]:
    _resolve_layout(config, vllm_specs)
    return vllm_runtime().planning.groups(config, vllm_specs)


def _group_blocks_per_request(config: VllmConfigView, spec: Any) -> int:
    """Blocks one request needs in a group, as ``_max_memory_usage_bytes_from_groups`` counts them."""
    if spec_kind(spec) == "uniform_type":
        return int(spec.max_memory_usage_pages(config))
    return -(-int(spec.max_memory_usage_bytes(config)) // int(spec.page_size_bytes))


def kv_cache_groups(specs: Mapping[str, KVCacheSpec], rt: RuntimeSettings) -> list[KVCacheGroup]:
    """vLLM's KV cache groups, as neutral groups; a group's ``bytes_per_block`` is
    ``_get_kv_cache_bytes_per_block([group], layout)``."""
    config = spec_level_config(rt)
    groups = _groups(config, {name: to_vllm_spec(s) for name, s in specs.items()})
    layout = config.cache_config.get_resolved_kv_cache_layout()
    bytes_per_block = vllm_runtime().fn("_get_kv_cache_bytes_per_block")
    return [
        KVCacheGroup(
            kind=spec_kind(g.kv_cache_spec),
            block_size=int(g.kv_cache_spec.block_size),
            page_size_bytes=int(g.kv_cache_spec.page_size_bytes),
            layer_names=tuple(g.layer_names),
            bytes_per_block=int(bytes_per_block([g], layout)),
            blocks_per_request=_group_blocks_per_request(config, g.kv_cache_spec),
        )
        for g in groups
    ]


@dataclass(frozen=True)
class PoolPlan:
    """One worker's planned pool: the memory check and vLLM's max concurrency."""

    memory: MemoryCheck
    max_concurrency: float  # 0.0 when no KVCacheConfig could be planned


def plan_pool(specs: Mapping[str, KVCacheSpec], rt: RuntimeSettings) -> PoolPlan:
    """``get_kv_cache_configs`` for one worker, with the pieces :class:`MemoryCheck` reports."""
    api = vllm_runtime().planning
    config = spec_level_config(rt)
    vllm_specs = {name: to_vllm_spec(s) for name, s in specs.items()}
    groups = _groups(config, vllm_specs)
    if not groups:
        raise UnsupportedByVllmError("no KV cache groups (attention-free): nothing to plan")
    bpb = api.pool_bytes_per_block(config, groups)
    # get_kv_cache_configs replaces the memory by override * bytes_per_block, then reserves
    # the null block for the check; this is the value its admission check sees.
    available = (
        rt.kv_cache_memory_bytes if rt.num_gpu_blocks_override is None else rt.num_gpu_blocks_override * bpb
    )
    check = available - bpb
    needed = api.max_memory_usage_bytes(config, groups)
    estimate = api.estimate_max_model_len(config, groups, check) if check > 0 else 0
    try:
        kv_config = api.kv_cache_config(config, vllm_specs, rt.kv_cache_memory_bytes)
        admission = "ok"
    except ValueError as exc:
        admission = str(exc)
        # num_blocks does not depend on max_model_len: plan again at one token to read it.
        short = spec_level_config(dataclasses.replace(rt, max_model_len=1))
        try:
            kv_config = api.kv_cache_config(short, vllm_specs, rt.kv_cache_memory_bytes)
        except ValueError:
            kv_config = None  # "No available memory": not even one block beyond the null block
    if kv_config is None:
        num_blocks, concurrency = available // bpb, 0.0
    else:
        num_blocks = int(kv_config.num_blocks)
        concurrency = float(vllm_runtime().fn("get_max_concurrency_for_kv_cache_config")(config, kv_config))
    memory = MemoryCheck(
        bytes_per_block=bpb, num_blocks=num_blocks, needed_bytes=needed, available_bytes=check,
        admission=admission, max_model_len_estimate=estimate,
    )  # fmt: skip
    return PoolPlan(memory, concurrency)


def check_memory(specs: Mapping[str, KVCacheSpec], rt: RuntimeSettings) -> MemoryCheck:
    """Plan one worker's pool with ``get_kv_cache_configs`` and record its admission check:
    ``admission`` is ``"ok"`` or the exact ``ValueError`` text of ``_check_enough_kv_cache_memory``."""
    return plan_pool(specs, rt).memory


def estimate_max_model_len(specs: Mapping[str, KVCacheSpec], rt: RuntimeSettings, available: int) -> int:
    """``_estimate_max_model_len_from_groups`` for ``available`` bytes (0: not one token fits)."""
    config = spec_level_config(rt)
    groups = _groups(config, {name: to_vllm_spec(s) for name, s in specs.items()})
    return vllm_runtime().planning.estimate_max_model_len(config, groups, available)
