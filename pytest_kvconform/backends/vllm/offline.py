"""A real ``VllmConfig`` for a scenario, built offline: no weights, no tokenizer, no hub.

:func:`build_vllm_config` is the public entry point (a plugin's tests can hand the result to
their own platform's hooks); inside the adapter :func:`vllm_config` builds it under the
chosen platform (:func:`~.platform.platform_scope`), whose ``check_and_update_config`` runs
in ``VllmConfig.__post_init__`` as in the engine.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import copy
import dataclasses
import functools
import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...scenario import Scenario
from .attention import CPU_BUILD_LACKS
from .config_view import parallel_config
from .configs import QWEN35, hf_config_dict, qwen35_model_class_importable
from .platform import (
    HookChange,
    current_log,
    host_has_triton,
    platform_scope,
    read_setting,
    resolve_platform,
    triton_answer,
    triton_probe,
)
from .private import private
from .runtime import UnsupportedByVllmError

_CONFIG_ROOT: list[Path] = []

#: the device the engine's config names (``--device``, ``DeviceConfig``) inside a backend's scope:
#: ``cpu``, or a plugin's own device type where its hooks act only on that (vllm-ascend: ``npu``)
ENGINE_DEVICE: contextvars.ContextVar[str] = contextvars.ContextVar("kvconform_engine_device", default="cpu")


@contextlib.contextmanager
def engine_device(device: str) -> Iterator[None]:
    """Inside, the configs built name ``device`` (:data:`ENGINE_DEVICE`)."""
    token = ENGINE_DEVICE.set(device)
    try:
        yield
    finally:
        ENGINE_DEVICE.reset(token)


#: Caches of answers on the neutral platform (one per geometry); tests that fake the host clear them.
CACHES: list[Any] = []


def clear_caches() -> None:
    """Forget every cached config, alignment and engine view."""
    for cache in CACHES:
        (cache.cache_clear if hasattr(cache, "cache_clear") else cache.clear)()


def config_json(scenario: Scenario) -> str:
    """The scenario's config.json text (sorted keys: one text per geometry): the model's own file
    when the scenario was read from one (``kvconform plan path/to/config.json``,
    :mod:`pytest_kvconform.hf_config`), so that vLLM reads what the reader read; else the one its
    architecture's writer spells (:mod:`.configs`)."""
    source = Path(scenario.source)
    if source.name == "config.json" and source.is_file():
        own = json.loads(source.read_text(encoding="utf-8"))
        _own_config_gap(own)
        return json.dumps(own, sort_keys=True)
    return json.dumps(hf_config_dict(scenario), sort_keys=True)


def _own_config_gap(config: dict[str, Any]) -> None:
    """What of a model's own config.json this CPU build cannot build (the writer's config of the
    same KV geometry leaves both out): fp8-quantized weights, whose linear layers need a GPU
    ScaledMM kernel, and a multimodal model class, which imports torchvision (removed by the CPU
    install)."""
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8":
        raise UnsupportedByVllmError(
            "cpu_build", "fp8 weights (quantization_config): no ScaledMM kernel in a CPU build of vLLM"
        )
    arch = (config.get("architectures") or [""])[0]
    if arch.endswith("ForConditionalGeneration") and not qwen35_model_class_importable():
        raise UnsupportedByVllmError(
            "cpu_build", f"{arch}: its model class imports torchvision, which this install lacks"
        )


def _config_dir(text: str) -> Path:
    """A folder holding only ``config.json``, one per distinct content, under a temp root."""
    if not _CONFIG_ROOT:
        root = Path(tempfile.mkdtemp(prefix="kvconform-vllm-configs-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _CONFIG_ROOT.append(root)
    folder = _CONFIG_ROOT[0] / hashlib.sha256(text.encode()).hexdigest()[:16]
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(text, encoding="utf-8")
    return folder


@functools.cache
def _model_config(text: str, dtype: str, max_model_len: int, platform: type) -> Any:
    """``ModelConfig`` for a generated config.json, one per platform (its checks run in it).

    The first one per architecture costs about 16 s (vLLM inspects the model class in a
    subprocess and caches the result under ``VLLM_CACHE_ROOT``).
    """
    from vllm.config import ModelConfig

    folder = str(_config_dir(text))
    return ModelConfig(
        model=folder, tokenizer=folder, skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len,
    )  # fmt: skip


CACHES.append(_model_config)


@functools.cache
def _default_prefix_caching(text: str, dtype: str, max_model_len: int, platform: type) -> bool:
    """``--enable-prefix-caching`` as ``vllm serve`` sets it when it is not given:
    ``EngineArgs._set_default_chunked_prefill_and_prefix_caching_args`` (vllm/engine/arg_utils.py,
    every release; ``ModelConfig.is_prefix_caching_supported``) on the scenario's ``ModelConfig``.
    ``CacheConfig.enable_prefix_caching`` itself defaults to True for every model, so a config
    built without this step would cache prefixes of hybrids that 0.23 ... 0.27 serve without."""
    from vllm.engine.arg_utils import EngineArgs

    model_config = _model_config(text, dtype, max_model_len, platform)
    private("_set_default_chunked_prefill_and_prefix_caching_args")
    args = EngineArgs(model=model_config.model, tokenizer=model_config.model, skip_tokenizer_init=True)
    args._set_default_chunked_prefill_and_prefix_caching_args(model_config)
    return bool(args.enable_prefix_caching)


CACHES.append(_default_prefix_caching)


def skip_layers(stated: tuple[str, ...], cache_dtype: str, model_config: Any) -> list[str]:
    """``--kv-cache-dtype-skip-layers`` as ``EngineArgs.create_engine_config`` (vllm/engine/
    arg_utils.py) leaves it: for ``turboquant_*`` (and ``ultraquant_4bit`` from 0.32) the union with
    vLLM's own ``TurboQuantConfig.get_boundary_skip_layers`` (a dense model's first and last two)."""
    if not (cache_dtype.startswith("turboquant_") or cache_dtype == "ultraquant_4bit"):
        return list(stated)
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    boundary = TurboQuantConfig.get_boundary_skip_layers(model_config)
    return sorted(set(stated) | set(boundary))


def _model_sliding_window(model_config: Any) -> int | None:
    """``CacheConfig.sliding_window`` as ``EngineArgs.create_engine_config`` sets it
    (vllm/engine/arg_utils.py, 0.32 and 0.33; 0.23 asks ``is_interleaved``, the same for every
    packaged model): the model's window unless ``layer_types`` interleave other layers with
    sliding ones. A model whose layers take no window of their own (Mistral-7B-v0.1: a
    ``sliding_window`` and no ``layer_types``) then slides on every layer (``Attention.__init__``)."""
    layer_types = getattr(model_config.hf_text_config, "layer_types", None)
    if layer_types is not None and any(kind != "sliding_attention" for kind in layer_types):
        return None
    return model_config.get_sliding_window()


def vllm_config(scenario: Scenario, platform: type) -> Any:
    """The scenario's ``VllmConfig``; call it inside ``platform_scope(platform)``. A setting the
    scenario leaves unset (``RuntimeSettings.unset``) is left unset to vLLM, whose own defaulting
    decides it: the prefix-caching default of ``EngineArgs`` and the model's config hook for
    ``mamba_cache_mode``, ``VllmConfig``'s async-scheduling default for ``max_concurrent_batches``."""
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig

    model, rt = scenario.model, scenario.runtime
    assert model is not None
    # A shallow copy per VllmConfig: the model's verify_and_update_config hooks (which also set
    # cache_config.mamba_block_size) run once per ModelConfig object (``config_updated``).
    text = config_json(scenario)
    requested = -1 if rt.auto_fit_max_model_len else rt.max_model_len  # -1: derive, then auto-fit
    model_config = copy.copy(_model_config(text, model.dtype, requested, platform))
    model_config.config_updated = False
    if model_config.max_model_len != rt.max_model_len:
        raise UnsupportedByVllmError(
            "offline_config",
            f"max_model_len = -1: vLLM derives {model_config.max_model_len} from the generated config, "
            f"not the scenario's max_position_embeddings {rt.max_model_len}",
        )
    pp = rt.pipeline_parallel_size
    # async scheduling adds a batch in flight: 2 at PP 1, pp + 1 on the V2 model runner, which
    # needs Triton as the backend's host answers it (platform.triton_probe); the V1 runner keeps pp
    batches = {1, 2} if pp == 1 else {pp, pp + 1} if triton_answer() else {pp}
    if "max_concurrent_batches" not in rt.unset and rt.max_concurrent_batches not in batches:
        raise UnsupportedByVllmError(
            "offline_config",
            f"max_concurrent_batches={rt.max_concurrent_batches} at pipeline parallel size {pp}: vLLM "
            f"derives it from the pipeline and async scheduling ({' or '.join(map(str, sorted(batches)))} "
            "here), which the offline config cannot set otherwise",
        )
    register_kv_cache_dtypes(rt.registered_kv_cache_dtypes)
    if rt.kv_cache_dtype == "ultraquant_4bit":  # also when every attention layer is a skip layer:
        # Platform._align_hybrid_block_size imports UltraQuantAttentionBackend for the dtype
        raise UnsupportedByVllmError("cpu_build", CPU_BUILD_LACKS[rt.kv_cache_dtype])
    if "mamba_cache_mode" in rt.unset:  # vLLM decides: the prefix-caching default, then the model's hook
        mode: dict[str, Any] = {
            "enable_prefix_caching": _default_prefix_caching(text, model.dtype, rt.max_model_len, platform)
        }
    else:  # vLLM 0.33 derives the mode from prefix caching (on: "align"); 0.32 reads the field.
        mode = {
            "enable_prefix_caching": rt.mamba_cache_mode in ("align", "all"),
            "mamba_cache_mode": rt.mamba_cache_mode,
        }
    cache = CacheConfig(
        # no --block-size: vLLM's default, then Phase 1 of update_block_size_for_backend
        block_size=rt.block_size if rt.user_specified_block_size else None,
        cache_dtype=rt.kv_cache_dtype, mamba_cache_dtype=rt.mamba_cache_dtype,
        mamba_ssm_cache_dtype=rt.mamba_ssm_cache_dtype, num_gpu_blocks_override=rt.num_gpu_blocks_override,
        kv_cache_memory_bytes=rt.kv_cache_memory_bytes,  # --kv-cache-memory-bytes: what the worker reports
        sliding_window=_model_sliding_window(model_config),
        **mode,
    )  # fmt: skip
    # the boundary layers EngineArgs.create_engine_config adds to --kv-cache-dtype-skip-layers
    stated = rt.kv_cache_dtype_skip_layers
    cache.kv_cache_dtype_skip_layers = skip_layers(stated, rt.kv_cache_dtype, model_config)
    # max_concurrent_batches: one more batch than the pipeline's stages with async scheduling;
    # unset: VllmConfig's default decides
    async_scheduling = None if "max_concurrent_batches" in rt.unset else rt.max_concurrent_batches == pp + 1
    scheduler = SchedulerConfig(
        max_model_len=rt.max_model_len, is_encoder_decoder=False,
        max_num_batched_tokens=rt.max_num_batched_tokens,
        async_scheduling=async_scheduling,
        **({"max_num_seqs": rt.max_num_seqs} if rt.max_num_seqs is not None else {}),
        # --disable-hybrid-kv-cache-manager; not stated: VllmConfig decides (the platform's support)
        **({"disable_hybrid_kv_cache_manager": True} if rt.disable_hybrid_kv_cache_manager else {}),
    )  # fmt: skip
    parallel = parallel_config(rt)
    with _assertions_unwrapped():
        config = VllmConfig(
            model_config=model_config, cache_config=cache, scheduler_config=scheduler,
            device_config=DeviceConfig(device=ENGINE_DEVICE.get()), parallel_config=parallel,
            speculative_config=speculative_config(scenario, model_config, parallel),
            additional_config=rt.additional_config_dict,
        )  # fmt: skip
    if getattr(model_config.hf_config, "kvconform_substitutes", None) in QWEN35:
        from vllm.model_executor.models.config import Qwen3_5ForConditionalGenerationConfig

        Qwen3_5ForConditionalGenerationConfig.verify_and_update_config(config)
    return config


def engine_defaults(scenario: Scenario, platform: type) -> Scenario:
    """The scenario with what vLLM sets for the settings it leaves unset: its ``VllmConfig`` built
    with them unset (:func:`vllm_config`), read back as vLLM left them before the platform's
    ``check_and_update_config`` (whose changes are the plan's next step). Call it inside
    ``platform_scope(platform)``."""
    from .runtime import installed_vllm_version

    model, rt = scenario.model, scenario.runtime
    assert model is not None and rt.unset
    log = current_log()
    seen = len(log.changes) if log is not None else 0
    config = vllm_config(scenario, platform)
    hooked = {c.setting: c.before for c in (log.changes[seen:] if log is not None else [])}

    def setting(path: str) -> Any:
        return hooked[path] if path in hooked else read_setting(config, path)

    vllm = f"vLLM {installed_vllm_version()}"
    values: dict[str, Any] = {}
    applied: list[str] = []
    if "mamba_cache_mode" in rt.unset:
        mode, cached = setting("cache_config.mamba_cache_mode"), setting("cache_config.enable_prefix_caching")
        why = (f"{vllm} set it: enable_prefix_caching {cached} "
               "(EngineArgs._set_default_chunked_prefill_and_prefix_caching_args), then the model's "
               "verify_and_update_config (MambaModelConfig)")  # fmt: skip
        if model.num_state_layers == 0:  # as the reference: a mode no layer reads
            mode, why = "none", f"no state layer: the mode sizes nothing ({vllm}'s mode: {mode})"
        values["mamba_cache_mode"] = mode
        applied.append(f"mamba_cache_mode = {mode!r}: {why}")
    if "max_concurrent_batches" in rt.unset:
        path = "scheduler_config.async_scheduling"
        scheduler = config.scheduler_config
        if path in hooked:  # VllmConfig's default is what the platform's hook found
            scheduler.async_scheduling, after = hooked[path], scheduler.async_scheduling
            batches = int(config.max_concurrent_batches)
            scheduler.async_scheduling = after
        else:
            batches = int(config.max_concurrent_batches)
        values["max_concurrent_batches"] = batches
        applied.append(
            f"max_concurrent_batches = {batches}: {vllm} set it: VllmConfig.max_concurrent_batches, "
            f"async_scheduling {setting(path)} (VllmConfig.__post_init__, async_scheduling is None)"
        )
    # built here, not by the reference's with_defaults: the answer is vLLM's (provenance)
    runtime = dataclasses.replace(rt, unset=(), **values)
    return dataclasses.replace(
        scenario, runtime=runtime, defaults_applied=(*scenario.defaults_applied, *applied)
    )


@contextlib.contextmanager
def _assertions_unwrapped() -> Iterator[None]:
    """A config validator's ``AssertionError`` as vLLM raised it: pydantic wraps whatever a
    validator raises in a ``ValidationError``, itself a ``ValueError`` (so a validator's
    ``ValueError`` reads as one already). Before 0.27 the DCP checks of
    ``ModelConfig.verify_with_parallel_config`` are assertions."""
    import pydantic

    try:
        yield
    except pydantic.ValidationError as exc:
        errors = exc.errors()
        if len(errors) == 1 and errors[0]["type"] == "assertion_error":
            error = errors[0].get("ctx", {}).get("error")
            raise AssertionError(str(error) if error is not None else errors[0]["msg"]) from exc
        raise


def register_kv_cache_dtypes(registered: tuple[tuple[str, str], ...]) -> None:
    """Register the scenario's plugin dtypes the way a platform does: ``register_kv_cache_dtype``
    (vllm/config/cache.py, vLLM 0.33) with a handler whose ``torch_dtype()`` is the named torch
    dtype and whose ``quant_mode()`` is ``KVQuantMode.NONE`` (a plain storage dtype)."""
    if not registered:
        return
    try:
        from vllm.config.cache import register_kv_cache_dtype
    except ImportError:
        raise UnsupportedByVllmError(
            "release_lacks", "this vLLM has no register_kv_cache_dtype (new in 0.33)"
        ) from None
    import torch
    from vllm.config.cache import get_kv_cache_dtype_handler
    from vllm.v1.kv_cache_interface import KVQuantMode

    for name, dtype in registered:
        torch_dtype = getattr(torch, dtype)
        handler = get_kv_cache_dtype_handler(name)
        if handler is not None and handler.torch_dtype() == torch_dtype:
            continue
        register_kv_cache_dtype(name)(type(f"KvconformDtype_{name}", (), {
            "name": name, "torch_dtype": lambda self, d=torch_dtype: d,
            "quant_mode": lambda self: KVQuantMode.NONE,
        }))  # fmt: skip


def speculative_config(scenario: Scenario, model_config: Any, parallel: Any) -> Any:
    """``SpeculativeConfig`` for drafters that need no second checkpoint: ``mtp`` (the model's
    own MTP modules; vLLM derives the draft config from the target's) and ``ngram``."""
    from vllm.config import SpeculativeConfig

    from ...reference.speculative import speculative_method

    method = speculative_method(scenario)
    if method is None:
        return None
    if method not in ("mtp", "ngram"):
        raise UnsupportedByVllmError(
            "draft_checkpoint", f"speculative method {method!r}: needs a draft checkpoint"
        )
    return SpeculativeConfig(
        method=method, num_speculative_tokens=scenario.runtime.num_speculative_tokens,
        target_model_config=model_config, target_parallel_config=parallel,
    )  # fmt: skip


def build_vllm_config(scenario: Scenario, platform: type | str | None = None) -> tuple[Any, list[HookChange]]:
    """The offline ``VllmConfig`` of ``scenario`` as ``platform`` configures it (default: vLLM
    core's neutral platform), and what that platform's ``check_and_update_config`` changed."""
    platform_cls = resolve_platform(platform)
    with platform_scope(platform_cls) as log, triton_probe(host_has_triton(platform_cls)):
        return vllm_config(scenario, platform_cls), list(log.changes)
