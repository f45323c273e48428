"""The worker's steps of the engine's start-up, offline: its ``get_kv_cache_spec`` and its
``determine_available_memory``, on a worker built without a device.

The engine (``EngineCore._initialize_kv_caches``, vllm/v1/engine/core.py) asks each worker for
``get_kv_cache_spec()`` and ``determine_available_memory()`` before it plans the pool. The worker
class is vLLM core's GPU worker (``vllm.v1.worker.gpu_worker:Worker``) by default, or a plugin's
(option ``worker=pkg.mod:Class``). What a worker may assume here (docs/plugins.md repeats it):

* it is constructed as ``Worker(vllm_config=config, local_rank=0, rank=0,
  distributed_init_method="file://...", is_driver_worker=True)`` inside the platform's scope, on
  the config the engine built (the platform's ``check_and_update_config`` ran), before the model,
  in the engine's order (``UniProcExecutor._init_executor``: the worker, then its model, then
  ``update_block_size_for_backend``); by ``get_kv_cache_spec`` the model's layers exist on the
  ``meta`` device (``compilation_config.static_forward_context``) and
  ``update_block_size_for_backend`` ran;
* ``init_device`` and ``load_model`` run as the engine runs them, short of a device and weights
  (:class:`WorkerSteps`, which the report's header names): a plugin's worker runs its own, and
  a runner that builds its own model (vllm-metal's, through mlx-lm) builds it from the
  config.json the harness writes, with none of vLLM's layers; vLLM core's GPU worker (and a
  subclass that keeps its ``init_device`` and ``load_model``) runs neither, as they need a CUDA
  device: the harness builds vLLM's layers on ``meta`` as ``GPUModelRunner.load_model`` would,
  and the worker gets :class:`RunnerStandIn` (vLLM's ``GPUModelRunner.get_kv_cache_spec`` over
  those layers, a ``profile_run()`` that does nothing), whose answers are vLLM core's; a plugin
  profile whose worker needs its device replaces ``init_device`` with its hook (its runner on
  the CPU) and gets vLLM's layers;
* ``cache_config.kv_cache_memory_bytes`` is the scenario's ``kv_cache_memory_bytes``
  (``--kv-cache-memory-bytes``), the engine's budget, which ``determine_available_memory`` returns
  (vLLM core's GPU worker does). The device's free memory (``init_snapshot.free_memory``; a
  profile's fake device, :func:`device_free_bytes`) is that budget, except in the budget check
  (``test_available_memory``), where the device has more free than the budget;
  ``randomize_dummy_inputs`` is False;
* the tensor-parallel group has the scenario's size and this worker is rank 0; nothing
  communicates;
* a plugin's worker is also asked ``initialize_from_config(kv_cache_config)`` with vLLM's own
  ``KVCacheConfig`` for a few blocks (``get_kv_cache_configs``); what it then holds is read from
  ``model_runner.kv_caches`` or its own ``kv_caches`` (:func:`bytes_held`). vLLM core's GPU worker
  is not: it allocates on its device.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

#: vLLM core's worker: the default
GPU_WORKER = "vllm.v1.worker.gpu_worker:Worker"


def resolve_worker(worker: type | str | None) -> type:
    """A worker class from a class, None (vLLM core's GPU worker) or ``"package.module:Class"``."""
    import importlib

    if isinstance(worker, type):
        return worker
    module_name, _, attr = (worker or GPU_WORKER).partition(":")
    if not attr:
        raise ValueError(f"worker {worker!r}: expected 'package.module:ClassName'")
    return getattr(importlib.import_module(module_name), attr)  # type: ignore[no-any-return]


def worker_name(worker: type | str | None) -> str:
    """How reports name a worker; no import."""
    if isinstance(worker, type):
        return f"{worker.__module__}.{worker.__qualname__}"
    return (worker or GPU_WORKER).replace(":", ".")


#: what the fake device has free while a memory probe runs; None: the engine's budget
_DEVICE_FREE: contextvars.ContextVar[int | None] = contextvars.ContextVar("kvconform_free", default=None)


def device_free_bytes(config: Any) -> int:
    """The bytes the fake device of an engine on ``config`` has free: its
    ``kv_cache_memory_bytes`` (the budget), or what :func:`device_free` set."""
    free = _DEVICE_FREE.get()
    return int(config.cache_config.kv_cache_memory_bytes or 0) if free is None else free


@contextlib.contextmanager
def device_free(free: int | None) -> Iterator[None]:
    """Inside, the fake device has ``free`` bytes free (None: the engine's budget)."""
    token = _DEVICE_FREE.set(free)
    try:
        yield
    finally:
        _DEVICE_FREE.reset(token)


class DeviceSnapshot:
    """``Worker.init_snapshot`` (a ``MemorySnapshot`` taken by ``init_device``) of the fake device."""

    def __init__(self, config: Any) -> None:
        self._config = config

    @property
    def free_memory(self) -> int:
        return device_free_bytes(self._config)


@dataclass(frozen=True)
class WorkerSteps:
    """How a worker's ``init_device`` and ``load_model`` run here: ``own`` (the worker's code;
    its ``load_model`` builds the model its runner builds, and vLLM's layers are not built),
    ``hook`` (the plugin profile's ``init_device(worker)`` / ``load_model(worker, None)``: what
    the worker's own makes, short of the device and the weights), ``skipped`` (vLLM core's GPU
    worker's needs a CUDA device), or ``vllm_layers`` (vLLM's model on ``meta``, as
    ``GPUModelRunner.load_model`` builds it, handed to the profile's ``load_model(worker, model)``)."""

    init_device: Literal["own", "hook", "skipped"]
    load_model: Literal["own", "hook", "vllm_layers"]

    def describe(self) -> str:
        how = {"own": "its own", "hook": "the profile's hook", "skipped": "not run (needs a CUDA device)",
               "vllm_layers": "vLLM's layers on meta"}  # fmt: skip
        no_layers = " (no vLLM layers)" if self.load_model != "vllm_layers" else ""
        return f"init_device {how[self.init_device]}, load_model {how[self.load_model]}{no_layers}"


def default_steps(worker_cls: type) -> WorkerSteps:
    """A worker's own steps, except those it keeps of vLLM core's GPU worker (they need a device)."""
    gpu = resolve_worker(GPU_WORKER)
    keeps = issubclass(worker_cls, gpu)
    init = "skipped" if keeps and worker_cls.init_device is gpu.init_device else "own"
    load = "vllm_layers" if keeps and worker_cls.load_model is gpu.load_model else "own"
    return WorkerSteps(init, load)  # type: ignore[arg-type]


class RunnerStandIn:
    """The model runner of a worker built without a device: the layers' specs through vLLM's own
    ``GPUModelRunner.get_kv_cache_spec``, a profile run that runs nothing."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.shared_kv_cache_layers: dict[str, str] = {}

    def get_kv_cache_spec(self) -> dict[str, Any]:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        return dict(GPUModelRunner.get_kv_cache_spec(self))  # type: ignore[arg-type]

    def profile_run(self, *args: Any, **kwargs: Any) -> None:
        return None


#: the stand-in's answers (qualified names): where one ran, vLLM core's code answered, not the plugin's
STAND_IN_ANSWERS = ("RunnerStandIn.get_kv_cache_spec", "RunnerStandIn.profile_run")


def build_worker(
    worker_cls: type,
    config: Any,
    distributed_init_method: str,
    steps: WorkerSteps,
    init_device: Callable[[Any], Any] | None = None,
) -> Any:
    """``worker_cls`` on ``config``, without a device (the contract above), then its
    ``init_device`` as ``steps`` say: its own, the profile's hook ``init_device`` (what the
    worker's own makes besides the device and the process group), or none (vLLM core's GPU
    worker: the stand-in runner). Call inside the platform's scope, under
    ``set_current_vllm_config(config)``."""
    worker = worker_cls(
        vllm_config=config, local_rank=0, rank=0, distributed_init_method=distributed_init_method,
        is_driver_worker=True,
    )  # fmt: skip
    if steps.init_device == "own":
        worker.init_device()
    elif steps.init_device == "hook" and init_device is not None:
        init_device(worker)
    if steps.init_device != "own" and getattr(worker, "model_runner", None) is None:
        worker.model_runner = RunnerStandIn(config)
    if not hasattr(worker, "init_snapshot"):
        worker.init_snapshot = DeviceSnapshot(config)
    if not hasattr(worker, "randomize_dummy_inputs"):
        worker.randomize_dummy_inputs = False
    return worker


def is_gpu_worker(worker_cls: type) -> bool:
    """Whether ``worker_cls`` is vLLM core's own GPU worker (it allocates on its device)."""
    return f"{worker_cls.__module__}:{worker_cls.__qualname__}" == GPU_WORKER


def bytes_held(worker: Any) -> int:
    """What the worker holds for the KV cache after ``initialize_from_config``: the bytes of the
    storage behind its runner's ``kv_caches`` (vLLM's GPU runner and tpu-inference's keep them
    there), or the worker's own ``kv_caches``: tensors, arrays, buffers, and lists, tuples and
    dicts of them, each storage counted once (vLLM's per-layer views of one backing allocation
    are one allocation)."""
    runner = getattr(worker, "model_runner", None)
    caches = getattr(runner, "kv_caches", None)
    if caches is None:
        caches = getattr(worker, "kv_caches", None)
    if caches is None:
        raise TypeError(f"{type(worker).__qualname__} keeps no kv_caches after initialize_from_config")
    storages: dict[Any, int] = {}
    _storages(caches, storages)
    return sum(storages.values())


def _storages(x: Any, out: dict[Any, int]) -> None:
    """The distinct storages behind ``x``: key -> bytes (a view adds its base's storage once)."""
    if isinstance(x, dict):
        for v in x.values():
            _storages(v, out)
    elif isinstance(x, list | tuple):
        for v in x:
            _storages(v, out)
    elif isinstance(x, bytes | bytearray):
        out[("buffer", id(x))] = len(x)
    elif isinstance(x, memoryview):
        out[("buffer", id(x.obj))] = x.obj.nbytes if hasattr(x.obj, "nbytes") else len(x.obj)
    elif hasattr(x, "untyped_storage"):  # a torch tensor: its storage, wherever the view starts
        storage = x.untyped_storage()
        out[("torch", storage._cdata)] = int(storage.nbytes())
    elif getattr(x, "base", None) is not None and hasattr(x.base, "nbytes"):  # a numpy view
        _storages(x.base, out)
    else:
        out[("array", id(x))] = int(x.nbytes)


__all__ = ["GPU_WORKER", "STAND_IN_ANSWERS", "DeviceSnapshot", "RunnerStandIn", "WorkerSteps",
           "build_worker", "bytes_held", "default_steps", "device_free", "device_free_bytes", "is_gpu_worker",
           "resolve_worker", "worker_name"]  # fmt: skip
