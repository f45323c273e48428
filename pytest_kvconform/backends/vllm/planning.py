"""Page unification, grouping, the pool plan and the admission check, answered by vLLM.

vLLM code (``P`` = ``vllm/v1/core/kv_cache_planning.py`` in 0.33, ``kv_cache_utils.py``
before): ``unify_kv_cache_spec_page_size``, ``get_kv_cache_groups`` (0.33:
``get_global_kv_cache_groups``), ``_get_kv_cache_bytes_per_block``, ``get_kv_cache_configs``
and the admission check it runs, ``_check_enough_kv_cache_memory``, ``_pool_bytes_per_block``
(0.33: ``_pool_bytes_per_block_from_builder``), ``_estimate_max_model_len_from_groups`` (all
``P``), ``get_max_concurrency_for_kv_cache_config`` (``kv_cache_utils.py``) and
``resolve_kv_cache_layout`` (v1/attention/backends/utils.py). The release-specific calling
conventions live in :mod:`.api`.

Each function takes the ``VllmConfig`` to plan with and vLLM's own spec objects: the
scenario's real config and the specs its model's layers reported (end to end), or, for a
per-rule check on the reference's specs, :func:`~.config_view.spec_level_config` and the
converted specs (:func:`neutral_inputs`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...model import KVCacheGroup, KVCacheTensorPlacement, KVCacheView, MemoryCheck
from ...reference.specs import KVCacheSpec
from ...rejections import rejection_kind
from ...scenario import RuntimeSettings
from .api import group_bytes_per_block, resolve_layout
from .config_view import spec_level_config
from .private import private
from .runtime import dtype_name, vllm_runtime
from .specs import from_vllm_spec, spec_kind, to_vllm_spec


def neutral_inputs(
    specs: Mapping[str, KVCacheSpec], rt: RuntimeSettings, num_hidden_layers: int = 0
) -> tuple[Any, dict[str, Any]]:
    """The spec-level config for ``rt`` (a model of ``num_hidden_layers``) and ``specs`` as vLLM
    spec objects."""
    return spec_level_config(rt, num_hidden_layers), {name: to_vllm_spec(s) for name, s in specs.items()}


def unify_page_sizes(specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """``unify_kv_cache_spec_page_size`` (vLLM's only policy: ``pad-to-max``). Its
    ``NotImplementedError`` propagates with vLLM's text."""
    unify = vllm_runtime().fn("unify_kv_cache_spec_page_size")
    unified = unify({name: to_vllm_spec(s) for name, s in specs.items()})
    return {name: from_vllm_spec(v, specs[name]) for name, v in unified.items()}


def _groups(config: Any, vllm_specs: Mapping[str, Any]) -> list[Any]:
    resolve_layout(config, vllm_specs)
    return vllm_runtime().planning.groups(config, vllm_specs)


def _group_blocks_per_request(config: Any, spec: Any) -> int:
    """Blocks one request needs in a group, as ``_max_memory_usage_bytes_from_groups`` counts them."""
    if spec_kind(spec) == "uniform_type":
        return int(spec.max_memory_usage_pages(config))
    return -(-int(spec.max_memory_usage_bytes(config)) // int(spec.page_size_bytes))


def kv_cache_groups(config: Any, vllm_specs: Mapping[str, Any]) -> list[KVCacheGroup]:
    """vLLM's KV cache groups, as neutral groups; a group's ``bytes_per_block`` is
    ``_get_kv_cache_bytes_per_block([group], layout)``."""
    groups = _groups(config, vllm_specs)
    return [
        KVCacheGroup(
            kind=spec_kind(g.kv_cache_spec),
            block_size=int(g.kv_cache_spec.block_size),
            page_size_bytes=int(g.kv_cache_spec.page_size_bytes),
            layer_names=tuple(g.layer_names),
            bytes_per_block=group_bytes_per_block(config, g),
            blocks_per_request=_group_blocks_per_request(config, g.kv_cache_spec),
        )
        for g in groups
    ]


@dataclass
class _AdmissionSeen:
    """What ``_check_enough_kv_cache_memory`` was called with, and what it said."""

    calls: list[tuple[int, int, int, str]] = field(default_factory=list)  # available, needed, estimate, text

    def pick(self, worker: int) -> None:
        """Keep the one call the engine reports of several workers' (in worker order): the first
        refusal, else ``worker``'s."""
        refused = [c for c in self.calls if c[3] != "ok"]
        self.calls = refused[:1] or [self.calls[worker]]


@contextlib.contextmanager
def _watch_admission() -> Iterator[_AdmissionSeen]:
    """Record vLLM's own admission check inside ``get_kv_cache_configs`` (its available bytes,
    needed bytes, estimate and error text) and let the planning go on to the ``KVCacheConfig``."""
    module, original = private("_check_enough_kv_cache_memory")
    seen = _AdmissionSeen()

    def check(available: int, get_needed: Any, max_model_len: int, estimate: Any) -> None:
        needed = int(get_needed())  # vLLM asks only when memory is left; the plan reports it anyway
        length = int(estimate(available)) if available > 0 else 0
        try:
            original(available, lambda: needed, max_model_len, lambda _: length)
            text = "ok"
        except ValueError as exc:
            text = str(exc)
        seen.calls.append((int(available), needed, length, text))

    module._check_enough_kv_cache_memory = check
    try:
        yield seen
    finally:
        module._check_enough_kv_cache_memory = original


@dataclass
class _AutoFitSeen:
    """What ``_auto_fit_max_model_len`` left: the length, the text it logged, its error text."""

    max_model_len: int | None = None
    message: str = ""
    error: str = ""


class _LogRecorder:
    """Stands in for the planning module's ``logger`` while auto-fit runs: keeps the
    "Auto-fit max_model_len" text (``info_once`` would log it once per process)."""

    def __init__(self, logger: Any, seen: _AutoFitSeen) -> None:
        self._logger, self._seen = logger, seen

    def info_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        text = msg % args if args else msg
        if text.startswith("Auto-fit max_model_len"):
            self._seen.message = text

    info = info_once

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


@contextlib.contextmanager
def _watch_auto_fit() -> Iterator[_AutoFitSeen]:
    """Run vLLM's own ``_auto_fit_max_model_len`` inside ``get_kv_cache_configs`` (when the
    config's ``original_max_model_len`` is -1), recording the length it leaves and its log text;
    its "Cannot auto-fit" ``ValueError`` is recorded and the planning goes on at the derived
    length, so the admission check and the pool are still seen."""
    module, original = private("_auto_fit_max_model_len")
    private("logger")
    seen = _AutoFitSeen()

    def auto_fit(*args: Any) -> None:
        config = next(a for a in args if hasattr(a, "model_config"))
        logger = module.logger
        module.logger = _LogRecorder(logger, seen)
        try:
            original(*args)
            seen.max_model_len = int(config.model_config.max_model_len)
        except ValueError as exc:
            seen.error = str(exc)
        finally:
            module.logger = logger

    module._auto_fit_max_model_len = auto_fit
    try:
        yield seen
    finally:
        module._auto_fit_max_model_len = original


def check_memory(config: Any, vllm_specs: Mapping[str, Any], available_memory: int) -> MemoryCheck:
    """``get_kv_cache_configs`` as vLLM plans it, each worker with ``available_memory`` bytes (one
    per pipeline stage, holding that stage's layers: ``api.pipeline_stages``): the bytes per
    block (``_pool_bytes_per_block``), and from its own admission check the bytes it sees, the
    bytes needed, the estimate and the text (``"ok"`` or the exact ``ValueError`` message);
    ``num_blocks`` and the max concurrency of the ``KVCacheConfig`` it returns. Of several
    workers: the first the admission check refuses, else the one whose pool bytes per block
    set everyone's ``num_blocks`` (the largest)."""
    api = vllm_runtime().planning
    groups = _groups(config, vllm_specs)
    workers = api.pipeline_stages(config, vllm_specs)
    if not groups:  # EngineCore._initialize_kv_caches: no KV cache, no probe, 0 bytes per worker
        return _attention_free_check(config, workers)
    bpb = api.pool_bytes_per_block(config, groups)
    no_block = False
    derived = config.model_config.max_model_len  # auto-fit changes it: restored below
    try:
        with _watch_admission() as seen, _watch_auto_fit() as fit:
            try:
                kv_configs = api.kv_cache_configs(config, workers, available_memory)
                binding = 0
                if len(workers) > 1:  # the worker whose bytes per block set everyone's num_blocks
                    pools = [api.pool_bytes_per_block(config, c.kv_cache_groups) for c in kv_configs]
                    binding, bpb = pools.index(max(pools)), max(pools)
                    seen.pick(binding)
                kv_config = kv_configs[binding]
            except ValueError as exc:  # vLLM refuses: no memory for one block beyond the null block
                if rejection_kind(exc) != "not_enough_memory":
                    raise
                kv_config = None
                seen.pick(0)
            except ZeroDivisionError:
                # Before 0.29 (no null block reserved) a pool of less than one block passes the
                # "No available memory" test and plans 0 blocks; get_kv_cache_configs then fails
                # shrinking the tensors (tensor.size % 0). The engine stops earlier: its admission
                # check, recorded here, refused (one request needs at least one block).
                if seen.calls and seen.calls[-1][3] == "ok":
                    raise
                kv_config, no_block = None, True
        return _memory_check(config, kv_config, bpb, seen, fit, no_block)
    finally:
        config.model_config.max_model_len = derived


def _attention_free_check(config: Any, workers: list[dict[str, Any]]) -> MemoryCheck:
    """What vLLM plans for a model without KV cache groups: ``get_kv_cache_configs`` with 0 bytes
    (its admission check does not run; auto-fit logs and keeps the length), and no capacity
    computed (``EngineCore`` calls ``update_kv_cache_capacity`` only for groups): 0.0 here."""
    api = vllm_runtime().planning
    derived = config.model_config.max_model_len
    try:
        with _watch_admission() as seen, _watch_auto_fit() as fit:
            kv_config = api.kv_cache_configs(config, workers, 0)[0]
    finally:
        config.model_config.max_model_len = derived
    if seen.calls:
        raise RuntimeError("get_kv_cache_configs ran its admission check for a model without KV cache groups")
    return MemoryCheck(
        bytes_per_block=0, num_blocks=int(kv_config.num_blocks), needed_bytes=0, available_bytes=0,
        admission="ok", max_model_len_estimate=0, max_concurrency=0.0,
        max_model_len=fit.max_model_len if fit.message else None, auto_fit=fit.message,
    )  # fmt: skip


def _memory_check(
    config: Any, kv_config: Any, bpb: int, seen: _AdmissionSeen, fit: _AutoFitSeen, no_block: bool
) -> MemoryCheck:
    """The :class:`MemoryCheck` of one watched ``get_kv_cache_configs`` (at the length auto-fit left)."""
    rt = vllm_runtime()
    if len(seen.calls) != 1:  # the planner this backend watches is not the one it knows
        raise RuntimeError(
            f"vLLM {rt.version} ran _check_enough_kv_cache_memory {len(seen.calls)} times for one worker "
            "(get_kv_cache_configs; the vllm backend expects once)"
        )
    available, needed, estimate, admission = seen.calls[0]
    if fit.error:  # vLLM stops at auto-fit: the engine reports that, not the check at the derived length
        admission = fit.error
    if no_block or kv_config is None:  # the engine stops before it has a pool
        num_blocks, concurrency = 0, 0.0
    else:
        num_blocks = int(kv_config.num_blocks)
        concurrency = float(rt.fn("get_max_concurrency_for_kv_cache_config")(config, kv_config))
    return MemoryCheck(
        bytes_per_block=bpb, num_blocks=num_blocks, needed_bytes=needed, available_bytes=available,
        admission=admission, max_model_len_estimate=estimate, max_concurrency=concurrency,
        max_model_len=fit.max_model_len if fit.message else None, auto_fit=fit.message,
    )  # fmt: skip


def estimate_max_model_len(config: Any, vllm_specs: Mapping[str, Any], available: int) -> int:
    """``_estimate_max_model_len_from_groups`` for ``available`` bytes (0: not one token fits)."""
    return vllm_runtime().planning.estimate_max_model_len(config, _groups(config, vllm_specs), available)


def fill_spec_registry() -> None:
    """vLLM's registry of spec types, filled as its planner fills it once per process
    (``KVCacheSpecRegistry._ensure_registered``, vllm/v1/kv_cache_spec_registry.py: the built-in
    types, then the platform's ``register_custom_kv_cache_specs``). Where the platform's hook
    raises, the registry is emptied again and the error raised: the planner's next call runs the
    hook again, so the rule that plans reports the error instead of planning without the hook."""
    from vllm.v1 import kv_cache_spec_registry as registry

    try:
        registry.KVCacheSpecRegistry.check_kv_cache_spec_registry({})
    except Exception:
        registry._REGISTRY_KVCACHESPEC_LIST.clear()
        getattr(registry, "_REGISTRY_ROLE_MANAGERS", {}).clear()  # 0.30+
        raise


def kv_cache_config(config: Any, vllm_specs: Mapping[str, Any], available_memory: int) -> Any:
    """vLLM's own ``KVCacheConfig`` for one worker with ``available_memory`` bytes
    (``get_kv_cache_configs``), whether or not one max-length request fits in it (its
    admission check is recorded, not raised: a pool of a few blocks is asked on purpose)."""
    resolve_layout(config, vllm_specs)
    derived = config.model_config.max_model_len  # auto-fit (max_model_len = -1) fits it to these blocks
    try:
        with _watch_admission():
            return vllm_runtime().planning.kv_cache_config(config, vllm_specs, available_memory)
    finally:
        config.model_config.max_model_len = derived


def kv_cache_views(kv_config: Any, layout: Any, kernel_block_sizes: list[int]) -> tuple[KVCacheView, ...]:
    """vLLM's ``allocate_kv_cache`` (vllm/v1/worker/utils.py, 0.29+) of ``kv_config`` on the
    ``meta`` device: each layer's view, as the runner binds it before any kernel-block remapping."""
    import torch
    from vllm.v1.worker.utils import allocate_kv_cache

    views = allocate_kv_cache(kv_config, torch.device("meta"), layout, kernel_block_sizes)
    return tuple(_view(name, v) for name, v in views.items())


def _view(name: str, t: Any) -> KVCacheView:
    return KVCacheView(name, dtype_name(t.dtype), tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))


def kv_cache_views_by_runner(
    config: Any, kv_config: Any, kernel_block_sizes: list[int], backends: Mapping[str, type]
) -> tuple[KVCacheView, ...]:
    """vLLM's ``GPUModelRunner._allocate_kv_cache_tensors`` and ``_reshape_kv_cache_tensors``
    (vllm/v1/worker/gpu_model_runner.py, before 0.29) of ``kv_config`` on the ``meta`` device:
    each layer through its attention backend (``backends``: the one its layer was built with),
    grouped per KV cache group and backend as the runner's ``initialize_attn_backend`` groups
    them. A state layer's views are ``<layer>[i]``."""
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup

    attn_groups = []
    for group_id, group in enumerate(kv_config.kv_cache_groups):
        by_backend: dict[tuple[Any, Any], list[str]] = {}
        for name in group.layer_names:
            spec = group.kv_cache_spec
            spec = spec.kv_cache_specs[name] if spec_kind(spec) == "uniform_type" else spec
            by_backend.setdefault((backends[name], spec), []).append(name)
        attn_groups.append([AttentionGroup(backend, names, spec, group_id)
                            for (backend, spec), names in by_backend.items()])  # fmt: skip

    class Runner:
        """The runner's state its allocation reads, and the runner's own methods."""

        device, runner_only_attn_layers = torch.device("meta"), frozenset()
        _kv_cache_spec_attn_group_iterator = GPUModelRunner._kv_cache_spec_attn_group_iterator
        _update_hybrid_attention_mamba_layout = GPUModelRunner._update_hybrid_attention_mamba_layout

    runner = Runner()
    runner.kv_cache_config, runner.attn_groups = kv_config, attn_groups  # type: ignore[attr-defined]
    runner.cache_config = config.cache_config  # type: ignore[attr-defined]
    raw = GPUModelRunner._allocate_kv_cache_tensors(runner, kv_config)  # type: ignore[arg-type]
    caches = GPUModelRunner._reshape_kv_cache_tensors(runner, raw, kernel_block_sizes)  # type: ignore[arg-type]
    views = []
    for name, cache in caches.items():
        if isinstance(cache, list):  # a state layer's state tensors
            views += [_view(f"{name}[{i}]", t) for i, t in enumerate(cache)]
        else:
            views.append(_view(name, cache))
    return tuple(views)


def tensor_placements(kv_config: Any) -> tuple[KVCacheTensorPlacement, ...]:
    """A ``KVCacheConfig``'s ``kv_cache_tensors`` (0.29+: ``KVCacheTensor(size, layers,
    layer_stride, block_stride, offset)``), each with its first layer's page as the views see it
    (the spec's ``num_heads``, ``num_states``, ``state_content_size_bytes``). Before 0.29,
    ``KVCacheTensor(size, shared_by)``: a tensor of its layers alone, each at byte 0, its block
    ``size / num_blocks`` bytes, with no page shape."""
    specs = {}
    for group in kv_config.kv_cache_groups:
        for name in group.layer_names:
            spec = group.kv_cache_spec
            specs[name] = spec.kv_cache_specs[name] if spec_kind(spec) == "uniform_type" else spec
    placements = []
    for t in kv_config.kv_cache_tensors:
        if not hasattr(t, "layer_stride"):
            page = int(t.size) // kv_config.num_blocks
            placements.append(KVCacheTensorPlacement(tuple(t.shared_by), int(t.size), 0, 0, page, None))
            continue
        spec = specs[t.layers[0]]
        shape = (int(spec.num_heads), int(spec.num_states), int(spec.state_content_size_bytes))
        placements.append(KVCacheTensorPlacement(
            tuple(t.layers), int(t.size), int(t.offset), int(t.layer_stride), int(t.block_stride), shape,
        ))  # fmt: skip
    return tuple(placements)
