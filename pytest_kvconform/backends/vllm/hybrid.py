"""Hybrid attention + state block alignment and state shapes, answered by vLLM.

vLLM code: ``Platform._align_hybrid_block_size`` (vllm/platforms/interface.py) of the chosen
platform class, on the scenario's offline ``VllmConfig``, and the model class's
``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``
(vllm/model_executor/models/*.py).
"""

from __future__ import annotations

import functools
from typing import Any

from ...model import HybridAlignment
from ...scenario import RuntimeSettings, Scenario
from .attention import CPU_BUILD_LACKS
from .offline import CACHES, config_json, vllm_config
from .platform import HookChange, current_log, is_neutral
from .private import private
from .runtime import UnsupportedByVllmError, vllm_runtime


@functools.cache
def kernel_block_backend(alignment: int, kv_cache_dtype: str = "auto") -> type:
    """An attention backend whose only kernel block size is ``MultipleOf(alignment)``.

    Its ``customize_spec`` is the one of the backend that serves ``kv_cache_dtype``: Triton's
    for ``*_per_token_head`` (its scales add 8 B per head), else the identity of vLLM's
    ``AttentionBackend``. FlashInfer (``nvfp4``) cannot be imported on a CPU build.
    """
    from vllm.v1.attention.backend import AttentionBackend, MultipleOf

    base: type = AttentionBackend
    if kv_cache_dtype.endswith("_per_token_head"):
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

        base = TritonAttentionBackend
    elif kv_cache_dtype in CPU_BUILD_LACKS:
        raise UnsupportedByVllmError("cpu_build", CPU_BUILD_LACKS[kv_cache_dtype])

    def sizes(kv_cache_spec: Any = None) -> list[Any]:
        return [MultipleOf(alignment)]

    def name() -> str:
        return f"KVCONFORM_MULTIPLE_OF_{alignment}"

    return type(
        f"KVConformMultipleOf{alignment}{base.__name__}", (base,),
        {"get_supported_kernel_block_sizes": staticmethod(sizes), "get_name": staticmethod(name)},
    )  # fmt: skip


def _model_class(config: Any) -> Any:
    from vllm.model_executor.models import ModelRegistry

    model_cls, _ = ModelRegistry.resolve_model_cls(
        config.model_config.architecture, model_config=config.model_config
    )
    return model_cls


def _mamba_page_bytes(config: Any) -> int:
    """The unpadded state page, as ``_align_hybrid_block_size`` computes it."""
    kci = vllm_runtime().kv_cache_interface
    model_cls = _model_class(config)
    if hasattr(model_cls, "get_mamba_specs_from_config"):
        return max(int(s.page_size_bytes) for s in model_cls.get_mamba_specs_from_config(config))
    spec = kci.MambaSpec(
        shapes=model_cls.get_mamba_state_shape_from_config(config),
        dtypes=model_cls.get_mamba_state_dtype_from_config(config), block_size=-1,
    )  # fmt: skip
    return int(spec.page_size_bytes)


def state_shapes(scenario: Scenario, platform: type) -> tuple[tuple[int, ...], ...]:
    """``<ModelClass>.get_mamba_state_shape_from_config`` for the scenario's model."""
    config = vllm_config(scenario, platform)
    shapes = _model_class(config).get_mamba_state_shape_from_config(config)
    return tuple(tuple(int(d) for d in s) for s in shapes)


#: (config.json, runtime) -> (result, hook changes) on the neutral platform, whose hooks read
#: nothing of the host. Other platforms (vLLM's CPU platform reads the CPU's features) are not cached.
_ALIGNMENTS: dict[tuple[str, RuntimeSettings], tuple[HybridAlignment | None, list[HookChange]]] = {}
CACHES.append(_ALIGNMENTS)


def align_hybrid_block_size(scenario: Scenario, platform: type) -> HybridAlignment | None:
    """``<platform>._align_hybrid_block_size(vllm_config, backend)`` on the scenario's model, with
    a backend whose smallest kernel block is the scenario's ``kernel_block_alignment``. None when
    vLLM does not treat the model as hybrid. Call it inside ``platform_scope(platform)``."""
    model, rt = scenario.model, scenario.runtime
    if model is None or not model.is_hybrid:
        return None
    if not is_neutral(platform):
        return _align(scenario, platform)
    key = (config_json(scenario), rt)
    log = current_log()
    if key not in _ALIGNMENTS:
        seen = len(log.changes) if log is not None else 0
        result = _align(scenario, platform)
        _ALIGNMENTS[key] = (result, log.changes[seen:] if log is not None else [])
    elif log is not None:  # the cached result's hook changes still belong to this call
        log.changes.extend(_ALIGNMENTS[key][1])
    return _ALIGNMENTS[key][0]


def _align(scenario: Scenario, platform: type) -> HybridAlignment | None:
    from vllm.platforms import current_platform

    rt = scenario.runtime
    config = vllm_config(scenario, platform)
    if not config.model_config.is_hybrid:
        return None
    # the mode vLLM settled on: the scenario's, or its default where the scenario leaves it unset
    if getattr(config.cache_config, "mamba_cache_mode", "none") == "align" and rt.extra_block_alignment != 1:
        raise UnsupportedByVllmError(
            "constructed_layers",
            "the prefill checkpoint alignment comes from constructed Mamba layers "
            "(get_mamba_prefill_checkpoint_alignment); a config-only model has none",
        )
    state = _mamba_page_bytes(config)
    backend = kernel_block_backend(rt.kernel_block_alignment, rt.kv_cache_dtype)
    private("_align_hybrid_block_size")  # Phase 2 alone: a private hook of Platform
    type(current_platform)._align_hybrid_block_size(config, backend)
    cache = config.cache_config
    block, padded = int(cache.block_size), cache.mamba_page_size_padded
    page = int(padded) if padded is not None else state  # vLLM leaves it None when already equal
    per_token, rest = divmod(page, block)
    if state == 0 or rest:  # what vLLM left is not an aligned hybrid: the very bug to catch, not a gap
        raise RuntimeError(
            f"Platform._align_hybrid_block_size left block {block} with a page of {page} B that the block "
            f"does not divide (state page {state} B)"
        )
    return HybridAlignment(
        block_size=block, attn_page_bytes_per_token=per_token, state_page_bytes=state,
        page_size_bytes=page, state_page_padded_bytes=None if padded is None else int(padded),
        min_block_size=state / per_token,
    )  # fmt: skip
