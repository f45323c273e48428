"""The ``VllmConfig`` the spec-level rules hand to vLLM: a real one, seen through a view.

vLLM's KV planning reads ``model_config`` (``max_model_len``, ``original_max_model_len``, in
0.33 ``supports_kv_cache_grouping`` and, with speculative decoding, ``hf_config``) and
``max_concurrent_batches``. For per-spec rules that have no model, :class:`VllmConfigView`
replaces just those two on a real ``VllmConfig()`` built from the runtime settings; every
other attribute (cache, scheduler and parallel configs, the layout, the config builder) is
vLLM's own. Speculative decoding needs a model: a spec-level config has none, so vLLM's
``num_prefill_lookahead_tokens`` is 0 there.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from ...scenario import RuntimeSettings


@dataclass
class ModelConfigStandIn:
    """What KV planning reads from ``ModelConfig`` (and ``kv_cache_dtype_str_to_dtype``)."""

    max_model_len: int
    dtype: Any = None
    hf_config: Any = None
    #: vLLM 0.33's config builder asks whether the model class owns the grouping; a
    #: spec-level check has no model class, so vLLM's default grouping applies.
    supports_kv_cache_grouping: bool = False
    #: ``max_model_len = -1``: ``original_max_model_len`` is -1 and ``get_kv_cache_configs``
    #: auto-fits (``max_model_len`` holds the derived length until then)
    auto_fit: bool = False
    #: the model's decoder layers, which pipeline stages split (``get_pp_indices``)
    num_hidden_layers: int = 0

    @property
    def original_max_model_len(self) -> int:
        return -1 if self.auto_fit else self.max_model_len

    def get_total_num_hidden_layers(self) -> int:
        return self.num_hidden_layers


class VllmConfigView:
    """A real ``VllmConfig`` with ``model_config`` and ``max_concurrent_batches`` replaced.

    Every other attribute is the wrapped config's. ``max_in_flight_tokens`` runs vLLM's
    own property on this view, so it multiplies the replaced ``max_concurrent_batches``
    by the real ``scheduler_config.max_num_batched_tokens``.
    """

    def __init__(self, base: Any, model_config: Any, *, max_concurrent_batches: int) -> None:
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "model_config", model_config)
        object.__setattr__(self, "max_concurrent_batches", max_concurrent_batches)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("model_config", "max_concurrent_batches"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._base, name, value)

    @property
    def max_in_flight_tokens(self) -> int:
        prop = inspect.getattr_static(type(self._base), "max_in_flight_tokens")
        return int(prop.fget(self))


def base_config(rt: RuntimeSettings) -> Any:
    """A fresh ``VllmConfig()`` (no model) with the runtime's cache, scheduler and parallel settings."""
    from vllm.config import CacheConfig, SchedulerConfig

    from .platform import config_without_model

    cache = CacheConfig(
        block_size=rt.block_size if rt.user_specified_block_size else None,
        num_gpu_blocks_override=rt.num_gpu_blocks_override,
        enable_prefix_caching=rt.mamba_cache_mode in ("align", "all"),
    )  # fmt: skip
    cache.mamba_cache_mode = rt.mamba_cache_mode  # what MambaSpec.max_memory_usage_bytes reads
    scheduler = SchedulerConfig(
        max_model_len=rt.max_model_len, is_encoder_decoder=False,
        max_num_batched_tokens=rt.max_num_batched_tokens,
        **({"disable_hybrid_kv_cache_manager": True} if rt.disable_hybrid_kv_cache_manager else {}),
    )  # fmt: skip
    return config_without_model(
        cache_config=cache, scheduler_config=scheduler, parallel_config=parallel_config(rt)
    )


def parallel_config(rt: RuntimeSettings) -> Any:
    """``ParallelConfig`` of the runtime's tensor, pipeline and decode-context parallel sizes."""
    from vllm.config import ParallelConfig

    tp, dcp = rt.tensor_parallel_size, rt.decode_context_parallel_size
    return ParallelConfig(
        tensor_parallel_size=tp,
        pipeline_parallel_size=rt.pipeline_parallel_size,
        decode_context_parallel_size=dcp,
    )


def spec_level_config(rt: RuntimeSettings, num_hidden_layers: int = 0) -> VllmConfigView:
    """The config the spec-level functions hand to vLLM for ``rt`` (and a model of
    ``num_hidden_layers`` decoder layers, for pipeline stages)."""
    model = ModelConfigStandIn(
        max_model_len=rt.max_model_len,
        auto_fit=rt.auto_fit_max_model_len,
        num_hidden_layers=num_hidden_layers,
    )
    return VllmConfigView(
        base_config(rt),
        model,
        max_concurrent_batches=rt.max_concurrent_batches,
    )  # fmt: skip
