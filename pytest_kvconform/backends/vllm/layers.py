"""The specs the model's own layers report, on the model vLLM builds: no weights, ``meta`` tensors.

The engine's order (vLLM 0.32/0.33): the ``VllmConfig`` runs the platform's
``check_and_update_config``; the worker builds the model (every attention and Mamba layer
registers itself in ``compilation_config.static_forward_context``); the platform's
``update_block_size_for_backend`` runs its three phases over those layers' backends (and
``VllmConfig.validate_block_size`` checks the block they finalised); then
``GPUModelRunner.get_kv_cache_spec`` (vllm/v1/worker/gpu_model_runner.py) asks each layer for its
``get_kv_cache_spec`` and the backend's ``customize_spec``. :func:`build_engine_specs` does exactly
that, with the model class instantiated under ``torch.device("meta")`` (nothing is allocated)
and a tensor-parallel group of the scenario's size on one process (layers read only its size).
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...model import BlockChoice
from ...provenance import Participation, participation
from ...scenario import Scenario
from .api import mla_prefill_missing, non_ssm_backends, resolve_layout
from .offline import vllm_config
from .platform import HookChange, config_snapshot, config_without_model, diff, is_neutral
from .runtime import LOCK, UnsupportedByVllmError, vllm_runtime
from .worker import WorkerSteps


@dataclass(frozen=True)
class EngineSpecs:
    """One scenario as the worker sees it after loading the model."""

    config: Any  # the VllmConfig, after update_block_size_for_backend
    specs: dict[str, Any]  # layer name -> vLLM KVCacheSpec (the worker's get_kv_cache_spec)
    choice: BlockChoice
    backends: tuple[type, ...]  # the distinct non-SSM attention backends, in layer order
    worker: Any  # the worker that answered (:mod:`.worker`), built without a device
    #: a new worker on the same config and model, asked its specs (the engine initialises a
    #: worker's KV cache once: each allocation gets its own)
    fresh_worker: Callable[[], Any]
    #: whose code computed what the engine hands out later (:func:`~pytest_kvconform.provenance.credit`):
    #: "block_size" (the config's hooks and ``update_block_size_for_backend``), "layer_specs"
    credits: dict[str, list[Participation]] = field(default_factory=dict)


#: GPU-only libraries a model's layers import that a CPU build of vLLM does not ship: building a
#: model that imports one is an offline gap (``cpu_build``); any other failure is a crash
GPU_ONLY_MODULES = frozenset(
    {
        "cutlass",
        "nvidia_cutlass_dsl",
        "cuda",
        "flashinfer",
        "deep_gemm",
        "triton",
        "flash_attn",
        "vllm_flash_attn",
        "fla",
    }
)

_DISTRIBUTED: list[str] = []


def _ensure_distributed() -> None:
    """A one-process gloo world with model parallel groups of size 1 (built once). It is built
    under a config without a model (:func:`~.platform.config_without_model`, never the plugin's
    platform), so that vLLM also creates the expert-parallel group MoE layers ask for
    (``initialize_model_parallel`` skips it for a dense model)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if _DISTRIBUTED:
        return
    folder = Path(tempfile.mkdtemp(prefix="kvconform-dist-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    init_file = folder / "init"
    if not ps.model_parallel_is_initialized():
        with set_current_vllm_config(config_without_model()):
            ps.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{init_file}",
                backend="gloo",
            )  # fmt: skip
            ps.initialize_model_parallel(1, 1)
    _DISTRIBUTED.append(str(init_file))


@contextlib.contextmanager
def parallel_groups(tensor_parallel_size: int, decode_context_parallel_size: int = 1) -> Iterator[None]:
    """Layers built inside see a TP group of ``tensor_parallel_size`` (rank 0) and a DCP group of
    ``decode_context_parallel_size``: sizing reads the group sizes only, nothing communicates."""
    from vllm.distributed import parallel_state as ps

    _ensure_distributed()
    groups = [(ps.get_tp_group(), tensor_parallel_size)]
    if hasattr(ps, "get_dcp_group"):
        groups.append((ps.get_dcp_group(), decode_context_parallel_size))
    saved = [(g, g.world_size, g.rank_in_group) for g, _ in groups]
    try:
        for group, size in groups:
            group.world_size, group.rank_in_group = size, 0
        yield
    finally:
        for group, size, rank in saved:
            group.world_size, group.rank_in_group = size, rank


def _model_class(config: Any) -> Any:
    from vllm.model_executor.models import ModelRegistry

    model_cls, _ = ModelRegistry.resolve_model_cls(
        config.model_config.architecture, model_config=config.model_config
    )
    return model_cls


def build_drafter(config: Any) -> None:
    """The MTP drafter's model, built as ``SpecDecodeBaseProposer._get_model``
    (vllm/v1/spec_decode/llm_base_proposer.py, 0.23 ... 0.33) builds it from the worker's
    ``load_model``, after the target: ``speculative_config.draft_model_config``'s MTP architecture
    on the worker's config, under ``set_model_tag("eagle_head")``. Its attention layers register in
    the config's forward context next to the target's, so ``get_kv_cache_spec`` reports them. The
    proposer's own config differs only in the attention backend it re-selects (None here as in the
    target's) and a speculative ``kv_cache_dtype`` (never set offline). Call under ``meta`` and
    the config's scope; ngram (no model) and no speculation build nothing."""
    spec = config.speculative_config
    if spec is None or spec.method != "mtp" or spec.draft_model_config is None:
        return
    from vllm.compilation.backends import set_model_tag
    from vllm.model_executor.models import ModelRegistry

    draft = spec.draft_model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(draft.architecture, model_config=draft)
    with set_model_tag("eagle_head"):
        model_cls(vllm_config=config, prefix="")


def _hand_model(worker: Any, hooks: Any, steps: WorkerSteps, model: Any) -> None:
    """The worker's own ``load_model``, or the profile's ``hooks.load_model(worker, model)``
    (``model``: vLLM's layers on ``meta``, or None where the runner builds its own)."""
    if steps.load_model == "own":
        worker.load_model()
    else:
        hooks.load_model(worker, model)


def _load_model(worker: Any, config: Any, hooks: Any, steps: WorkerSteps) -> Any:
    """The worker's ``load_model`` as ``steps`` say: its own or the profile's hook
    (``hooks.load_model(worker, None)``), its runner building the model it builds (None), or
    vLLM's model on ``meta``, as ``GPUModelRunner.load_model`` builds it with its drafter,
    handed to ``hooks.load_model(worker, model)`` (returned)."""
    import torch
    from vllm.utils.torch_utils import set_default_torch_dtype

    if steps.load_model != "vllm_layers":
        _hand_model(worker, hooks, steps, None)
        return None
    try:
        # DefaultModelLoader.load_model builds it under the model's dtype, which the layers'
        # attention-backend selection reads (torch.get_default_dtype())
        with set_default_torch_dtype(config.model_config.dtype), torch.device("meta"), hooks.building_model():
            model = _model_class(config)(vllm_config=config, prefix="")
            build_drafter(config)
        _hand_model(worker, hooks, steps, model)
    except ImportError as exc:  # only a GPU library a CPU build lacks; anything else crashes
        if (exc.name or "").partition(".")[0] not in GPU_ONLY_MODULES:
            raise
        raise UnsupportedByVllmError(
            "cpu_build", f"{config.model_config.architecture} imports {exc.name}, which this CPU build lacks"
        ) from exc
    return model


def build_engine_specs(scenario: Scenario, platform: type, hooks: Any) -> EngineSpecs:
    """In the engine's order (``UniProcExecutor._init_executor``: the worker, its device, its
    model, then ``update_block_size_for_backend``): the worker
    (``hooks.make_worker(config, distributed_init_method)``; ``hooks``: the backend) built
    without a device, the model's layers on ``meta``, ``update_block_size_for_backend``, then the
    worker's ``get_kv_cache_spec`` (:mod:`.worker`). A plugin's worker may prepare the config its
    model is built under, as its ``init_device`` and ``load_model`` would (tpu-inference's sets
    the ``quant_config`` that carries its runner's mesh); the model is built inside
    ``hooks.building_model()`` and then handed to ``hooks.load_model(worker, model)``, as the
    worker's ``load_model`` would leave it with its runner.

    Call inside ``platform_scope(platform)``. Pieces that cannot run offline raise
    :class:`UnsupportedByVllmError` naming them.
    """
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform

    vllm_runtime()
    make_worker, steps = hooks.make_worker, hooks.worker_steps()
    rt = scenario.runtime
    plugin = hooks.plugin_code()
    with participation(plugin) as block_credit:
        config = vllm_config(scenario, platform)
    # vLLM's own platforms build vLLM's MLA prefill backend; a plugin's may bring its own
    vllm_platform = is_neutral(platform) or platform.__module__.startswith("vllm.")
    missing = mla_prefill_missing() if config.model_config.use_mla and vllm_platform else None
    if missing and steps.load_model == "vllm_layers":
        raise UnsupportedByVllmError("cpu_build", f"{config.model_config.architecture}: {missing}")
    groups = parallel_groups(rt.tensor_parallel_size, rt.decode_context_parallel_size)
    with LOCK, set_current_vllm_config(config), groups:
        worker = make_worker(config, f"file://{_DISTRIBUTED[0]}")
        model = _load_model(worker, config, hooks, steps)
        platform_cls = type(current_platform)
        backends = non_ssm_backends(platform_cls, config)
        with participation(plugin) as more_block_credit:
            platform_cls.update_block_size_for_backend(config)
        # The engine validates the finished block size (EngineCore._initialize_kv_caches runs it
        # after planning, at the smallest group's block: the one the hooks finalised unless a
        # group keeps a smaller own block). Before 0.27 it refuses an align-mode block above
        # max_num_batched_tokens (AssertionError).
        config.validate_block_size()
        with participation(plugin) as specs_credit:
            specs = worker.get_kv_cache_spec()
        # EngineCore._initialize_kv_caches resolves the layout from what the workers' backends
        # support (get_supported_kv_cache_layouts) before it plans the pool (0.29+)
        resolve_layout(config, specs, worker)

    def fresh_worker() -> Any:
        with (
            LOCK,
            set_current_vllm_config(config),
            parallel_groups(rt.tensor_parallel_size, rt.decode_context_parallel_size),
        ):
            new = make_worker(config, f"file://{_DISTRIBUTED[0]}")
            _hand_model(new, hooks, steps, model)
            new.get_kv_cache_spec()
            return new

    cache = config.cache_config
    mamba_block = cache.mamba_block_size if cache.mamba_block_size is not None else rt.max_model_len
    padded, shared = cache.mamba_page_size_padded, getattr(cache, "skip_page_size_padded", None)
    choice = BlockChoice(int(cache.block_size), int(mamba_block), padded, shared)
    credits = {"block_size": block_credit + more_block_credit, "layer_specs": specs_credit}
    return EngineSpecs(config, dict(specs), choice, backends, worker, fresh_worker, credits)


def rerun_hooks(engine: EngineSpecs, scenario: Scenario) -> dict[str, list[HookChange]]:
    """What each config hook changes when it runs a second time on an engine it already
    configured: ``check_and_update_config`` on the built config, ``update_block_size_for_backend``
    after the model's layers exist. Both must change nothing of the whole config
    (:func:`~.platform.config_snapshot`; vllm-gaudi#1708: re-running the first rescaled
    Granite-4.0-H-small's padded Mamba page from 2,162,688 B to 2,621,440 B).

    The hooks run on a copy of ``engine``'s config (the built layers shared, not copied: they
    hold vLLM parameters that do not deep-copy), so the engine keeps planning with what its
    build configured. Call inside ``platform_scope(platform)``."""
    import copy

    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform

    layers = engine.config.compilation_config.static_forward_context
    config = copy.deepcopy(engine.config, {id(layer): layer for layer in layers.values()})
    platform_cls = type(current_platform)
    changes = {}
    rt = scenario.runtime
    groups = parallel_groups(rt.tensor_parallel_size, rt.decode_context_parallel_size)
    with LOCK, set_current_vllm_config(config), groups:
        for hook in ("update_block_size_for_backend", "check_and_update_config"):
            before = config_snapshot(config)
            getattr(platform_cls, hook)(config)
            after = config_snapshot(config)
            changes[hook] = diff(f"{platform_cls.__qualname__}.{hook} (second run)", before, after)
    return changes


__all__ = ["EngineSpecs", "build_engine_specs", "parallel_groups", "rerun_hooks"]
