"""Which vLLM ``Platform`` configures the engine: an explicit choice, never the test host's.

vLLM resolves ``vllm.platforms.current_platform`` once per process from the host, and every
module keeps a reference to that one object. On a CPU host it is ``CpuPlatform``, whose
``check_and_update_config`` (vllm/platforms/cpu.py) rewrites every ``VllmConfig`` from the
host's CPU features: a float32 SSM state on AVX-512 BF16 hosts, block 128 when the user gave
none, block 16 and no prefix caching for MLA, no async scheduling. :func:`platform_scope`
makes that one object behave as the chosen platform class while the adapter builds and
plans a config (it swaps the object's class and restores it after), and records every
setting the platform's hooks changed as a :class:`HookChange`, naming the hook.

The default, :func:`neutral_platform`, is vLLM core's ``Platform`` interface
(vllm/platforms/interface.py): ``check_and_update_config`` changes nothing and
``update_block_size_for_backend`` runs its three phases, with the hybrid KV cache manager
that the CUDA, ROCm and CPU platforms all declare (``support_hybrid_kv_cache``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .runtime import LOCK, vllm_runtime

NEUTRAL = "neutral"

#: Settings a platform hook may change that size the KV cache (``config.<path>``).
SIZING_SETTINGS = (
    "cache_config.block_size",
    "cache_config.user_specified_block_size",
    "cache_config.cache_dtype",
    "cache_config.mamba_cache_dtype",
    "cache_config.mamba_ssm_cache_dtype",
    "cache_config.mamba_cache_mode",
    "cache_config.mamba_block_size",
    "cache_config.mamba_page_size_padded",
    "cache_config.enable_prefix_caching",
    "cache_config.kv_cache_memory_bytes",
    "cache_config.num_gpu_blocks_override",
    "scheduler_config.max_num_batched_tokens",
    "scheduler_config.async_scheduling",
    "scheduler_config.enable_chunked_prefill",
    "scheduler_config.disable_hybrid_kv_cache_manager",
    "parallel_config.tensor_parallel_size",
    "parallel_config.decode_context_parallel_size",
    "model_config.dtype",
    "model_config.max_model_len",
)


@dataclass(frozen=True)
class HookChange:
    """One setting a platform hook changed behind the scenario's back."""

    hook: str  # e.g. "CpuPlatform.check_and_update_config"
    setting: str  # e.g. "cache_config.mamba_ssm_cache_dtype"
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"{self.hook} set {self.setting}: {self.before!r} -> {self.after!r}"


@dataclass
class HookLog:
    """What the platform's hooks changed inside one :func:`platform_scope`."""

    platform: str
    changes: list[HookChange] = field(default_factory=list)


def read_setting(config: Any, path: str) -> Any:
    obj: Any = config
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, int | float | str | bool) else str(obj)


def snapshot(config: Any) -> dict[str, Any]:
    """The settings of :data:`SIZING_SETTINGS` (what a hook changed behind the scenario's back)."""
    return {path: read_setting(config, path) for path in SIZING_SETTINGS}


_SCALAR = (int, float, str, bool, type(None))


def config_snapshot(config: Any) -> dict[str, Any]:
    """Every value of a ``VllmConfig``, by path (``scheduler_config.max_num_seqs``): the fields of
    its config dataclasses, recursively, and of their string-keyed tables; another object is
    recorded by its type. What a hook's second run must leave unchanged, whatever it is."""
    import enum

    out: dict[str, Any] = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, _SCALAR):
            out[path] = obj
        elif isinstance(obj, enum.Enum):
            out[path] = str(obj)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            if id(obj) in seen:
                return
            seen.add(id(obj))
            for f in dataclasses.fields(obj):
                name = f"{path}.{f.name}" if path else f.name
                try:
                    value = getattr(obj, f.name, None)
                except Exception as exc:  # a field that refuses to be read whole (Gemma 4's per-layer ones)
                    out[name] = f"<{type(exc).__name__}>"
                else:
                    walk(value, name)
        elif isinstance(obj, list | tuple) and all(isinstance(x, _SCALAR) for x in obj):
            out[path] = tuple(obj)
        elif isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
            for key, value in obj.items():
                walk(value, f"{path}[{key}]")
        else:
            out[path] = type(obj).__qualname__

    walk(config, "")
    return out


def diff(hook: str, before: dict[str, Any], after: dict[str, Any]) -> list[HookChange]:
    """What changed from ``before`` to ``after`` (a setting added or removed included)."""
    keys = [*before, *(k for k in after if k not in before)]
    return [HookChange(hook, k, before.get(k), after.get(k)) for k in keys if before.get(k) != after.get(k)]


@functools.cache
def neutral_platform(kernel_block_alignment: int = 16) -> type:
    """vLLM core's ``Platform`` interface, as a concrete class for offline sizing.

    Its attention backends are vLLM's own (:mod:`.attention`) at the scenario's kernel block
    alignment; one class per alignment.
    """
    from vllm.platforms.interface import Platform, PlatformEnum

    from .attention import base_for, qualname, refuse_unserved

    class NeutralPlatform(Platform):
        """``Platform``'s own config hooks. Its enum is CPU only so that the layers pick kernels
        this CPU build of vLLM has (MoE experts, GDN ops): a kernel sizes no cache, and the CPU
        platform's config hooks, which do, are not run. Tensors live on ``meta``."""

        _enum = PlatformEnum.CPU
        device_name = "kvconform-neutral"
        device_type = "cpu"
        dispatch_key = "CPU"
        kvconform_neutral = True
        kernel_block_alignment = 16

        @classmethod
        def support_hybrid_kv_cache(cls) -> bool:
            return True  # the hybrid KV cache manager of the GPU engine

        @classmethod
        def get_mla_prefill_backend_cls(cls, mla_selector_config: Any) -> Any:
            """The CPU build's MLA prefill kernel (``Platform``'s default is FlashAttention's)."""
            from vllm.platforms.cpu import CpuPlatform

            return CpuPlatform.get_mla_prefill_backend_cls(mla_selector_config)

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return 1  # read by kernel impls at construction; sizes nothing

        @classmethod
        def import_kernels(cls) -> None:
            """Sizing runs no kernel (the host platform loaded its own, :mod:`.runtime`)."""

        @classmethod
        def get_attn_backend_cls(
            cls, selected_backend: Any, attn_selector_config: Any, num_heads: Any = None
        ) -> str:
            base = base_for(attn_selector_config.kv_cache_dtype, attn_selector_config.use_mla)
            refuse_unserved(base, cls.kernel_block_alignment, attn_selector_config)
            return qualname(base, cls.kernel_block_alignment)

    NeutralPlatform.__module__ = __name__
    NeutralPlatform.__qualname__ = "NeutralPlatform"
    NeutralPlatform.kernel_block_alignment = kernel_block_alignment
    return NeutralPlatform


def is_neutral(platform: type) -> bool:
    return bool(getattr(platform, "kvconform_neutral", False))


def resolve_platform(platform: type | str | None) -> type:
    """A platform class from a class, ``"neutral"``/None, or ``"package.module:Class"``."""
    if platform is None or platform == NEUTRAL:
        return neutral_platform()
    if isinstance(platform, str):
        import importlib

        module_name, _, attr = platform.partition(":")
        if not attr:
            raise ValueError(f"platform {platform!r}: expected 'neutral' or 'package.module:ClassName'")
        vllm_runtime()
        return getattr(importlib.import_module(module_name), attr)
    return platform


def platform_name(platform: type | str | None) -> str:
    """How reports name a platform (a class, ``"package.module:Class"`` or neutral); no import."""
    if platform is None or platform == NEUTRAL or getattr(platform, "__qualname__", "") == "NeutralPlatform":
        return "neutral (vllm.platforms.interface.Platform defaults)"
    if isinstance(platform, type):
        return f"{platform.__module__}.{platform.__qualname__}"
    return str(platform)


#: The hook whose changes are departures: ``update_block_size_for_backend`` changes the block size
#: by the sizing rules themselves, which the suites compare with the reference.
_HOOKS = ("check_and_update_config",)


@functools.cache
def _observed(platform_cls: type) -> type:
    """``platform_cls`` with its config hooks recording what they change."""

    def recording(name: str) -> classmethod:
        original = getattr(platform_cls, name)

        def hook(cls: type, vllm_config: Any) -> None:
            before = snapshot(vllm_config)
            original(vllm_config)
            log = current_log()
            if log is not None:
                log.changes.extend(diff(f"{platform_cls.__qualname__}.{name}", before, snapshot(vllm_config)))

        return classmethod(hook)

    return type(platform_cls.__name__, (platform_cls,), {name: recording(name) for name in _HOOKS})


_LOGS: list[HookLog] = []


def _clear_platform_caches() -> None:
    """vLLM caches the attention backend class per selector config, not per platform."""
    from .private import private

    selector, cached = private("_cached_get_attn_backend")
    cached.cache_clear()
    mamba = getattr(selector, "_cached_get_mamba_attn_backend", None)  # not in every release
    if mamba is not None:
        mamba.cache_clear()


@contextlib.contextmanager
def platform_scope(platform_cls: type) -> Iterator[HookLog]:
    """``current_platform`` behaves as ``platform_cls`` inside; the host's afterwards.

    Holds the process-wide vLLM lock. Environment variables a hook sets (the CPU platform sets
    ``LD_PRELOAD``, ``VLLM_WORKER_MULTIPROC_METHOD`` ...) are restored on exit.
    """
    with LOCK:
        vllm_runtime()
        import vllm.platforms

        current = vllm.platforms.current_platform
        host = type(current)
        log = HookLog(platform_name(platform_cls))
        environ = dict(os.environ)
        current.__class__ = _observed(platform_cls)
        _clear_platform_caches()
        _LOGS.append(log)
        try:
            yield log
        finally:
            _LOGS.pop()
            current.__class__ = host
            _clear_platform_caches()
            if dict(os.environ) != environ:
                os.environ.clear()
                os.environ.update(environ)


#: A setting a platform's config hook may change -> the ``[runtime]`` key that says the same
RUNTIME_OF_SETTING = {
    "cache_config.block_size": "block_size",
    "cache_config.cache_dtype": "kv_cache_dtype",
    "cache_config.mamba_cache_dtype": "mamba_cache_dtype",
    "cache_config.mamba_ssm_cache_dtype": "mamba_ssm_cache_dtype",
    "cache_config.mamba_cache_mode": "mamba_cache_mode",
    "cache_config.kv_cache_memory_bytes": "kv_cache_memory_bytes",
    "cache_config.num_gpu_blocks_override": "num_gpu_blocks_override",
    "scheduler_config.max_num_batched_tokens": "max_num_batched_tokens",
    "scheduler_config.async_scheduling": "max_concurrent_batches",
    "parallel_config.tensor_parallel_size": "tensor_parallel_size",
    "parallel_config.decode_context_parallel_size": "decode_context_parallel_size",
    "model_config.max_model_len": "max_model_len",
}


def scenario_after(scenario: Any, changes: list[HookChange]) -> Any:
    """``scenario`` with what a platform's ``check_and_update_config`` changed, where the scenario
    format can say it: a block size it sets is a ``--block-size`` (Phase 1 then keeps it), async
    scheduling one more batch in flight than the pipeline's stages (``max_concurrent_batches``).
    Other changes (a padded Mamba page, the hybrid
    manager switched off) have no scenario key; the backend keeps them as departures."""
    runtime: dict[str, Any] = {}
    for change in changes:
        key = RUNTIME_OF_SETTING.get(change.setting)
        if key is None or change.after is None:
            continue
        value = change.after
        if key == "max_concurrent_batches":  # VllmConfig.max_concurrent_batches (V2 runner, or PP 1)
            pp = scenario.runtime.pipeline_parallel_size
            value = pp + 1 if value else pp
        elif key == "block_size":
            runtime["user_specified_block_size"] = True
        runtime[key] = value
    return scenario.with_runtime(**runtime) if runtime else scenario


def config_without_model(**kwargs: Any) -> Any:
    """A ``VllmConfig`` without a model (spec-level rules, the process group's bootstrap), built
    under vLLM core's neutral ``Platform``: a plugin's ``check_and_update_config`` expects a model
    (tpu-inference's reads ``model_config.runner_type``) and never sees one of these."""
    from vllm.config import VllmConfig

    with platform_scope(neutral_platform()):
        return VllmConfig(**kwargs)


#: A host kind -> what vLLM's CPU feature probes (``torch.cpu._is_*_supported``) answer.
_AVX512, _BF16, _AMX = "_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"
CPU_FEATURES: dict[str, dict[str, bool]] = {
    "avx2": {_AVX512: False, _BF16: False, _AMX: False},
    "avx512_bf16": {_AVX512: True, _BF16: True, _AMX: False},
    "avx512_bf16_amx": {_AVX512: True, _BF16: True, _AMX: True},
}


def host_answers() -> tuple[tuple[tuple[str, bool], ...], frozenset[tuple[str, str]]]:
    """What the host would tell a platform's hooks now, as far as this backend knows: the CPU
    feature probes (faked or not) and the environment (less pytest's per-test variable). Part of
    the key an engine is reused under, so a host faked another way builds its own."""
    cpu = vllm_runtime().torch.cpu
    names = (_AVX512, _BF16, _AMX)
    probes = tuple((name, bool(getattr(cpu, name)())) for name in names if hasattr(cpu, name))
    env = frozenset((k, v) for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST")
    return probes, env


@contextlib.contextmanager
def cpu_probes(features: str) -> Iterator[None]:
    """The ``torch.cpu`` feature probes answer as ``features`` (``native``: untouched). vLLM's
    kernels are loaded before any scope (:mod:`.runtime`), so no kernel is chosen by the fake."""
    if features == "native":
        yield
        return
    cpu = vllm_runtime().torch.cpu
    saved = {name: getattr(cpu, name) for name in CPU_FEATURES[features]}
    try:
        for name, answer in CPU_FEATURES[features].items():
            setattr(cpu, name, lambda answer=answer: answer)
        yield
    finally:
        for name, probe in saved.items():
            setattr(cpu, name, probe)


#: The modules whose ``HAS_TRITON`` decides the model runner: ``VllmConfig.use_v2_model_runner``
#: and, from vLLM 0.33, ``Worker.__init__``'s check of that choice
TRITON_READERS = ("vllm.config.vllm", "vllm.v1.worker.gpu_worker")


def host_has_triton(platform: type, device_has_triton: bool = True) -> bool:
    """Whether ``platform``'s host has Triton: a GPU engine's, vLLM core's or a plugin's, does
    (unless its profile says its device has none); vLLM's CPU build has none."""
    return device_has_triton and platform.__module__ != "vllm.platforms.cpu"


def triton_answer() -> bool:
    """What ``HAS_TRITON`` answers now where the model runner is chosen (inside a backend's scope:
    its :func:`triton_probe`)."""
    return bool(importlib.import_module(TRITON_READERS[0]).HAS_TRITON)


@contextlib.contextmanager
def triton_probe(present: bool) -> Iterator[None]:
    """``HAS_TRITON`` answers ``present`` where the model runner is chosen (:data:`TRITON_READERS`),
    whatever this host has: a GPU engine's host has Triton (its V2 model runner default decides
    the batches a pipeline keeps in flight), vLLM's CPU build and some plugins' device hosts have
    none (``VllmBackend.has_triton``)."""
    modules = [m for m in map(importlib.import_module, TRITON_READERS) if hasattr(m, "HAS_TRITON")]
    saved = [module.HAS_TRITON for module in modules]
    try:
        for module in modules:
            module.HAS_TRITON = present
        yield
    finally:
        for module, value in zip(modules, saved, strict=True):
            module.HAS_TRITON = value


def current_log() -> HookLog | None:
    """The log of the innermost :func:`platform_scope`, if any."""
    return _LOGS[-1] if _LOGS else None
