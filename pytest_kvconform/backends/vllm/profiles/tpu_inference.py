"""tpu-inference (vLLM's TPU plugin, ``pip install tpu-inference``) driven end to end by the
``vllm`` backend on a CPU host: ``pytest pytest_kvconform/suites --kvconform-backend=tpu-inference``
(``bash scripts/install-tpu-inference.sh`` builds the ``.venv-tpu`` it runs in).

What answers is tpu-inference's own code: its platform
(``tpu_inference.platforms.tpu_platform:TpuPlatform``: ``check_and_update_config`` picks the
block size, ``update_block_size_for_backend`` skips vLLM's hybrid alignment), its worker
(``tpu_inference.worker.tpu_worker:TPUWorker``: ``determine_available_memory`` sums the HBM of
its devices, ``initialize_from_config`` allocates JAX arrays), and its model runner
(``tpu_inference.runner.tpu_runner:TPUModelRunner``), whose ``get_kv_cache_spec`` is
``runner/kv_cache_manager.py``'s ``KVCacheManager.get_kv_cache_spec`` (the TPU kernel's page
layout, the uniform hybrid page, the compact Mamba pool). The model's layers are vLLM's, built
on ``meta`` by the core path under tpu-inference's platform and its replacement layers, as
tpu-inference's ``MODEL_IMPL_TYPE=vllm`` path builds them (``VllmModelWrapper``). Nothing of
tpu-inference's sizing is re-implemented here.

The device is a CPU JAX mesh of :data:`DEVICES` devices. Every piece the core path does not give
is a shim of this module, named and explained where it is defined; none changes how
tpu-inference computes a size:

* ``environment``, before JAX or tpu_inference is imported: ``TPU_NAME``,
  ``TPU_ACCELERATOR_TYPE``, ``TPU_WORKER_ID`` (else importing tpu_inference polls the GCE
  metadata server, ``tpu_inference/tpu_info.py``), ``JAX_PLATFORMS=cpu``,
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the mesh's devices) and
  ``SKIP_JAX_PRECOMPILE=1`` (``initialize_from_config`` would first JIT the sampler of a loaded
  model);
* :func:`torchax_named_tensor_overloads`: torchax 0.0.13 names ``Dimname`` overloads torch 2.13
  removed;
* :func:`vllm_c_already_loaded`: the ``import vllm._C`` at the top of ``tpu_platform.py``;
* a stub of tokamax's ``gmm_v2`` (``stubs``): tokamax 0.0.12 (the newest for Python 3.11) lacks it;
* :func:`cpu_device_coords`: ``make_optimized_mesh`` sorts devices by their TPU ``coords``;
* :func:`device_memory`: the devices' ``memory_stats`` report the fake device's free memory;
* :meth:`TpuInferenceBackend.init_device`: the devices, the ``TPUModelRunner`` and the
  ``quant_config`` that carries its mesh, as ``init_device`` and ``load_model`` make them.

Declined with the reason (``TpuInferenceBackend.declines``), never answered: what tpu-inference
refuses to start with for reasons that are not sizing (an MLA model without ``NEW_MODEL_DESIGN=1``
and DP attention, a KV cache dtype without a JAX type); vLLM's hybrid alignment, which
tpu-inference never runs; a pool of a few blocks where the engine pins its block count (a hybrid,
or a scenario's ``num_gpu_blocks_override``). tpu-inference's
departures from vLLM core are data, with their reasons, in
``pytest_kvconform/xfails/tpu-inference.toml``; the differential property suite is not run for
it (as for vLLM's CPU platform): nearly every generated input shows one of those departures.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from ....requirements import HYBRID, Declines, InputKind
from ..runtime import UnsupportedByVllmError, vllm_runtime
from .profile import PluginProfile, Stub, WorkerSteps

#: tpu-inference's model runner, which TPUWorker.init_device builds
RUNNER = "tpu_inference.runner.tpu_runner:TPUModelRunner"

#: CPU JAX devices of the mesh: a v6e-8 host has 8 chips (1 JAX device each)
DEVICES = 8

#: The environment tpu-inference reads at import, set before it is imported (values already
#: set by the user are kept)
ENVIRONMENT = {
    "JAX_PLATFORMS": "cpu",
    "TPU_NAME": "kvconform",
    "TPU_ACCELERATOR_TYPE": f"v6e-{DEVICES}",
    "TPU_WORKER_ID": "0",
    # the mesh's devices: JAX reads it when it first initialises a backend
    "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}",
    # TPUWorker.initialize_from_config first JIT-compiles the sampler (to keep that memory out of
    # the KV cache's way on a TPU); it needs a loaded model and sizes nothing
    "SKIP_JAX_PRECOMPILE": "1",
}


class RemovedOverload:
    """A named-tensor overload this torch does not have: a key that matches no real op."""

    def __init__(self, packet: str, name: str) -> None:
        self.name = f"{packet}.{name}"

    def __repr__(self) -> str:
        return f"<removed overload {self.name}>"


#: the named-tensor overloads torchax asked for that this torch lacks (filled while it imports)
REMOVED_OVERLOADS: list[str] = []


def _is_named_tensor_overload(name: str) -> bool:
    return "dimname" in name.lower() or name.startswith("names_")


@contextlib.contextmanager
def torchax_named_tensor_overloads() -> Iterator[None]:
    """Shim: while torchax is imported, ``torch.ops.aten.<op>.<named-tensor overload>`` that
    torch no longer has answers a :class:`RemovedOverload`; every other lookup is untouched."""
    from torch._ops import OpOverloadPacket

    original = OpOverloadPacket.__getattr__

    def lookup(self: Any, key: str) -> Any:
        try:
            return original(self, key)
        except AttributeError:
            if not _is_named_tensor_overload(key):
                raise
            REMOVED_OVERLOADS.append(f"{self._qualified_op_name}.{key}")
            return RemovedOverload(self._qualified_op_name, key)

    OpOverloadPacket.__getattr__ = lookup  # type: ignore[method-assign]
    try:
        yield
    finally:
        OpOverloadPacket.__getattr__ = original  # type: ignore[method-assign]


def vllm_c_already_loaded() -> None:
    """Shim: ``import vllm._C`` answers as the kernel library vLLM already loaded, when that
    library registered the ``_C`` namespace (a second ``TORCH_LIBRARY(_C)`` aborts)."""
    import torch

    if "vllm._C" in sys.modules:
        return
    registered = hasattr(torch.ops, "_C") and hasattr(torch.ops._C, "rms_norm")
    if registered:
        module = types.ModuleType("vllm._C", "the _C ops vLLM's CPU build already registered")
        sys.modules["vllm._C"] = module


#: tokamax 0.0.12 (the last for Python 3.11) has no ``gmm_v2``, which
#: ``tpu_inference/layers/common/linear.py`` and ``fused_moe_gmm.py`` import at module level
#: (tpu-inference 0.32 pins tokamax 0.0.17, Python >= 3.12); stubbed where absent
GMM_V2 = Stub("tokamax._src.ops.experimental.gmm_v2", "tokamax's grouped matmul kernel, absent from "
              "tokamax 0.0.12 (a kernel: sizing never runs it)")  # fmt: skip


def cpu_device_coords() -> None:
    """Shim: a TPU device has ``coords``, its chip's place in the slice, which
    ``tpu_inference.utils.make_optimized_mesh`` sorts the devices by before it lays out the
    mesh; a CPU JAX device has none. CPU devices get ``coords = (id, 0, 0)``, a row of chips:
    the order of the devices in the mesh sizes nothing (its shape does)."""
    import jax

    device_cls = type(jax.devices()[0])
    if not hasattr(device_cls, "coords"):
        device_cls.coords = property(lambda self: (self.id, 0, 0))  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- device memory


def hbm_stats(budget: int, utilization: float) -> dict[str, int]:
    """One device's ``memory_stats``: ``bytes_limit * utilization - bytes_in_use`` is ``budget``
    exactly, in the float arithmetic of ``TPUWorker.determine_available_memory``."""
    limit = math.ceil(budget / utilization) + 1
    in_use = int(limit * utilization - budget)
    for used in (in_use - 1, in_use, in_use + 1, in_use + 2):
        if used >= 0 and int(limit * utilization - used) == budget:
            return {"bytes_limit": limit, "bytes_in_use": used}
    raise RuntimeError(f"no HBM size gives {budget} B at utilization {utilization}")


def device_memory() -> None:
    """Shim: a JAX device's ``memory_stats()`` answers for the engine being configured (vLLM's
    current config): each device's HBM, at ``gpu_memory_utilization`` and less what is in use,
    leaves the config's ``kv_cache_memory_bytes`` for the KV cache (:func:`hbm_stats`). The
    scenario's budget is per device, as ``--kv-cache-memory-bytes`` is per GPU worker: a GPU
    worker drives one tensor-parallel rank, TPUWorker all of them (SPMD), and sums its devices.
    Outside an engine's config, or on one without a budget, it answers as a CPU device does
    (None). In the budget check (``test_available_memory``) the fake device has more free than
    the budget (:func:`..worker.device_free_bytes`)."""
    import jax
    from vllm.config import vllm as vllm_config_module

    from ..worker import device_free_bytes

    device_cls = type(jax.devices()[0])
    original = device_cls.memory_stats
    if getattr(original, "kvconform_shim", False):
        return

    def memory_stats(self: Any) -> Any:
        config = getattr(vllm_config_module, "_current_vllm_config", None)
        cache = getattr(config, "cache_config", None)
        tpu_config = getattr(config, "sharding_config", None) is not None  # TpuPlatform configured it
        if cache is None or not tpu_config or not cache.kv_cache_memory_bytes:
            return original(self)
        return hbm_stats(device_free_bytes(config), float(cache.gpu_memory_utilization))

    memory_stats.kvconform_shim = True  # type: ignore[attr-defined]
    device_cls.memory_stats = memory_stats


# ---------------------------------------------------------------------------- refusals

#: TpuPlatform.check_and_update_config's condition for MLA models
MLA_REFUSAL = (
    "TpuPlatform.check_and_update_config raises ValueError for an MLA model unless NEW_MODEL_DESIGN=1 "
    "([runtime.env]) and DP attention ([runtime.additional_config] "
    "sharding.sharding_strategy.enable_dp_attention = true) are set"
)


#: the kv_cache_dtype strings ``tpu_inference.utils.to_jax_dtype`` knows (its alias table, and
#: what ``jnp.dtype`` reads); any other is a ``TypeError`` in ``TPUModelRunner._init_inputs``
JAX_KV_CACHE_DTYPES = frozenset({"auto", "float16", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"})


def _dp_attention(rt: Any) -> bool:
    sharding = rt.additional_config_dict.get("sharding", {})
    return bool(sharding.get("sharding_strategy", {}).get("enable_dp_attention", False))


def _mla_without_new_design(scenario: Any) -> bool:
    model, rt = scenario.model, scenario.runtime
    return (
        model is not None
        and model.use_mla
        and not (dict(rt.env).get("NEW_MODEL_DESIGN") and _dp_attention(rt))
    )


def _no_jax_dtype(scenario: Any) -> bool:
    return scenario.runtime.kv_cache_dtype not in JAX_KV_CACHE_DTYPES


def _pinned_pool(scenario: Any) -> bool:
    return scenario.runtime.num_gpu_blocks_override is not None


MLA_WITHOUT_NEW_MODEL_DESIGN = InputKind(
    "mla_without_new_model_design",
    "an MLA model without NEW_MODEL_DESIGN=1 and DP attention",
    _mla_without_new_design,
)
NO_JAX_DTYPE = InputKind(
    "no_jax_kv_cache_dtype", "a kv_cache_dtype tpu-inference has no JAX type for", _no_jax_dtype
)
PINNED_POOL = InputKind("pinned_pool", "num_gpu_blocks_override set", _pinned_pool)
_PINNED = (
    "vLLM's KVCacheConfig then has the pinned block count whatever memory it is given, so a pool of a few "
    "blocks cannot be asked (the full one is the scenario's budget)"
)


# ---------------------------------------------------------------------------- the backend


class TpuInferenceBackend(PluginProfile):
    """tpu-inference 0.32 (platform, worker, runner) on vLLM 0.32's CPU build, CPU JAX mesh."""

    name: ClassVar[str] = "tpu-inference"
    distribution: ClassVar[str] = "tpu-inference"
    #: a TPU host runs JAX/Pallas kernels, no Triton: VllmConfig.use_v2_model_runner keeps the V1 model runner
    device_has_triton: ClassVar[bool] = False
    install_hint: ClassVar[str] = "bash scripts/install-tpu-inference.sh (tpu-inference 0.32.0 in .venv-tpu)"
    platform: ClassVar[type | str | None] = "tpu_inference.platforms.tpu_platform:TpuPlatform"
    worker: ClassVar[type | str | None] = "tpu_inference.worker.tpu_worker:TPUWorker"
    steps: ClassVar[WorkerSteps] = WorkerSteps("hook", "vllm_layers")  # its own need the device, the weights
    environment: ClassVar[dict[str, str]] = ENVIRONMENT
    stubs: ClassVar[tuple[Stub, ...]] = (GMM_V2,)
    #: TPUWorker.initialize_from_config allocates the pool (JAX arrays on the CPU mesh), except where
    #: the engine pins its block count; what tpu-inference refuses to start with is declined
    declines: ClassVar[Declines] = PluginProfile.declines | Declines(
        {
            "hybrid_alignment": "TpuPlatform.update_block_size_for_backend never runs "
            "Platform._align_hybrid_block_size (removed by design, tpu-inference #2090 -> #2627): the "
            "hybrid page is unified by KVCacheManager.update_mamba_page_size_padded, checked by the layer "
            "specs and the plan",
            ("*", MLA_WITHOUT_NEW_MODEL_DESIGN): MLA_REFUSAL,
            ("*", NO_JAX_DTYPE): "TPUModelRunner._init_inputs -> tpu_inference.utils.to_jax_dtype raises "
            "TypeError (data type not understood): the engine cannot start",
            ("allocation", HYBRID): "KVCacheManager._maybe_set_compact_mamba_num_blocks_override pins "
            f"num_gpu_blocks_override for a hybrid: {_PINNED}",
            ("allocation", PINNED_POOL): f"the scenario pins num_gpu_blocks_override: {_PINNED}",
        }
    )
    #: vLLM core's known bugs stay the vllm backend's; tpu-inference's departures are data in
    #: pytest_kvconform/xfails/tpu-inference.toml
    known_departures: ClassVar[Sequence[Any]] = ()
    #: so the harness builds it in a process of its own (:mod:`...isolated`)
    registers_process_wide: ClassVar[str] = (
        "tpu-inference replaces vLLM's layers (tpu_inference.layers.vllm) and its platform patches "
        "vLLM when imported; JAX's devices are fixed for the process"
    )

    def notes(self) -> list[str]:
        return [*super().notes(), f"CPU JAX mesh of {DEVICES} devices"]

    def load_plugin(self) -> None:
        """vLLM first (its CPU build loads the kernels of this CPU), the shims that precede
        tpu-inference's import, then its platform, worker and runner modules."""
        vllm_runtime()
        vllm_c_already_loaded()
        cpu_device_coords()
        device_memory()
        with torchax_named_tensor_overloads():
            importlib.import_module("torchax")
            super().load_plugin()
            importlib.import_module(RUNNER.partition(":")[0])

    def init_device(self, worker: Any) -> None:
        """What ``TPUWorker.init_device`` and ``TPUModelRunner.load_model`` make before any spec is
        asked, and nothing else of them: the devices (``jax.devices()[:sharding_config.total_devices]``),
        ``topology_order_id`` (the rank, on a single host), the ``TPUModelRunner`` (rank 0, first
        and last pipeline rank; it builds the mesh and the ``KVCacheManager``), and, as
        ``VllmModelWrapper.__init__`` does, ``config.quant_config =
        get_tpu_quantization_config(config, mesh)``, which tpu-inference's replacement layers
        (``tpu_inference.layers.vllm``, registered process-wide) read while the core path builds
        the model on ``meta`` after this call. Without the distributed init of ``init_device``
        (the core path has its own process group) and without weights."""
        import jax

        module_name, _, attr = RUNNER.partition(":")
        runner_cls = getattr(importlib.import_module(module_name), attr)
        config = worker.vllm_config
        total = config.sharding_config.total_devices
        if total > len(jax.devices()):
            raise UnsupportedByVllmError(
                "device_count", f"the mesh needs {total} devices; this CPU JAX has {len(jax.devices())}"
            )
        worker.devices = jax.devices()[:total]
        worker.topology_order_id = worker.rank  # init_device on a single host
        worker.model_runner = runner_cls(config, worker.devices, worker.rank, True, True)
        # TPUModelRunner.load_model -> VllmModelWrapper.__init__: the model's layers are built
        # under a quant_config that carries the runner's mesh
        from tpu_inference.layers.vllm.quantization import get_tpu_quantization_config

        config.quant_config = get_tpu_quantization_config(config, worker.model_runner.mesh)


__all__ = ["TpuInferenceBackend", "cpu_device_coords", "device_memory", "hbm_stats",
           "torchax_named_tensor_overloads", "vllm_c_already_loaded"]  # fmt: skip
