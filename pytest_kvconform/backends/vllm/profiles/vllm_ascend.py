"""vllm-ascend 0.23 (Huawei Ascend NPU, ``pip install vllm-ascend``) on vLLM 0.23:
``pytest pytest_kvconform/suites --kvconform-backend=vllm-ascend`` (``bash scripts/install-vllm-ascend.sh``
builds the ``.venv-ascend`` it runs in).

What answers is vllm-ascend's own code: ``NPUPlatform`` (vllm_ascend/platform.py:
``pre_register_and_update`` applies its process-wide patches, among them
``patch/platform/patch_mamba_config.py``, which replaces vLLM's hybrid block-size rule, and
``patch_kv_cache_utils.py``, which replaces parts of vLLM's planner; ``check_and_update_config``
picks the block size), ``NPUWorker`` (worker/worker.py: ``determine_available_memory``,
``initialize_from_config``) and ``NPUModelRunner`` (worker/model_runner_v1.py:
``get_kv_cache_spec`` with its ``AscendMLAAttentionSpec``, the cache tensors, here on the CPU).
The engine's config names the ``npu`` device: NPUPlatform's hooks act only on it.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any, ClassVar

from ....requirements import HYBRID, Declines, InputKind
from .profile import PluginProfile, Stub, WorkerSteps

#: transformers' Qwen2-VL processors, which import torchvision (removed from .venv, as vLLM's CPU
#: install wants); vLLM's Qwen-VL models import them, and vllm-ascend's worker patches import those
QWEN2_VL_PROCESSORS = {
    "transformers.models.qwen2_vl.image_processing_qwen2_vl": ("Qwen2VLImageProcessor", "smart_resize"),
    "transformers.models.qwen2_vl.video_processing_qwen2_vl": ("Qwen2VLVideoProcessor",),
}


def _turboquant(scenario: Any) -> bool:
    return scenario.runtime.kv_cache_dtype.startswith("turboquant")


TURBOQUANT = InputKind("turboquant", "a TurboQuant KV cache (turboquant_*)", _turboquant)


class VllmAscendBackend(PluginProfile):
    """vllm-ascend 0.23.0.post1 (platform, worker, runner) on vLLM 0.23's Python over the CPU build."""

    name: ClassVar[str] = "vllm-ascend"
    distribution: ClassVar[str] = "vllm_ascend"
    install_hint: ClassVar[str] = (
        "bash scripts/install-vllm-ascend.sh (vllm-ascend 0.23.0.post1 in .venv-ascend)"
    )
    platform: ClassVar[type | str | None] = "vllm_ascend.platform:NPUPlatform"
    worker: ClassVar[type | str | None] = "vllm_ascend.worker.worker:NPUWorker"
    steps: ClassVar[WorkerSteps] = WorkerSteps("hook", "vllm_layers")  # its own need the device, the weights
    engine_device: ClassVar[str] = "npu"
    stubs: ClassVar[tuple[Stub, ...]] = (
        Stub("torch_npu", "Ascend's torch backend (torch-npu, a CANN extension), imported at module level by "
             "most of vllm_ascend: a chip id and the device index, no size", {
                 "npu.get_soc_version": lambda: 223,  # Ascend 910B (A2): selects code paths
                 "npu.is_available": lambda: False,
                 "npu.device_count": lambda: 0,
                 "npu.current_device": lambda: 0,  # the device index layers are placed on
             }),
        Stub("acl", "CANN's Python runtime (acl.rt), imported by vllm_ascend's device utilities"),
        Stub("vllm_ascend._build_info", "written by vllm-ascend's setup.py at build time (not in the sdist): "
             "the device type a 910B build records",
             {"__device_type__": "A2", "__soc_version__": "ASCEND910B1", "__sleep_mode_enabled__": False}),
    )  # fmt: skip
    declines: ClassVar[Declines] = PluginProfile.declines | Declines({
        ("allocation", HYBRID): "with NPUPlatform's full decode graphs (ACL graphs) vLLM's "
        "CompilationConfig.adjust_cudagraph_sizes (vllm/config/compilation.py, 0.23) refuses a Mamba pool of "
        "fewer blocks than max_num_seqs (128): the suite's pools have 3 blocks, and one of 128 hybrid blocks "
        "is gigabytes on the CPU. The hybrid's pages, groups and plan are checked; its tensors are not",
        ("allocation", TURBOQUANT): "NPUModelRunner._reshape_kv_cache_tensors views each layer's buffer as K "
        "and V of the model dtype; a TurboQuant page (packed 8-bit K, 4-bit V) does not reshape "
        "(RuntimeError): vllm-ascend 0.23 has no TurboQuant cache, and refuses it only there",
    })  # fmt: skip
    registers_process_wide: ClassVar[str] = (
        "NPUPlatform.pre_register_and_update patches vLLM's config, planner and KV cache coordinator "
        "process-wide (vllm_ascend/patch/platform)"
    )

    def stub_device(self) -> None:
        npu_device()

    def load_plugin(self) -> None:
        """Its import, then ``pre_register_and_update()`` (vLLM's CLI calls it before parsing): the
        process-wide patches vllm-ascend ships."""
        qwen2_vl_processors()
        super().load_plugin()
        from vllm_ascend.platform import NPUPlatform

        NPUPlatform.pre_register_and_update()

    def init_device(self, worker: Any) -> None:
        """``NPUWorker.init_device`` less the device and the process group: the runner on the
        CPU. Its ``profile_run`` does nothing: with ``kv_cache_memory_bytes`` set,
        ``determine_available_memory`` runs it only to warm the model up, and a forward needs
        weights."""
        import torch

        # one NPU worker per process: compilation/acl_graph.py keeps its graph parameters in module
        # globals, set once by a worker's initialize_kv_cache; each worker here starts from none
        from vllm_ascend.compilation import acl_graph
        from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

        for name in ("_graph_params", "_draft_graph_params", "_draft_graph_prefill_params"):
            setattr(acl_graph, name, None)
        worker.device = torch.device("cpu")
        with no_pinned_memory():
            worker.model_runner = NPUModelRunner(worker.vllm_config, worker.device)
        worker.model_runner.profile_run = lambda *args, **kwargs: None

    def building_model(self) -> contextlib.AbstractContextManager[Any]:
        """Layers that place tensors on ``current_platform.current_device()`` explicitly get
        ``meta`` too (``torch.device("meta")`` alone does not override an explicit device)."""
        return all_devices_meta()


def npu_device() -> None:
    """``torch.npu`` and the ``npu`` device name, as importing torch_npu sets them: the stub's
    ``npu`` module, ``torch.utils.rename_privateuse1_backend("npu")`` (so ``DeviceConfig("npu")``
    parses) and ``torch.distributed.is_hccl_available`` (vllm_ascend's model loader reads it)."""
    import torch
    import torch.distributed

    npu = importlib.import_module("torch_npu.npu")
    torch.npu = npu  # type: ignore[attr-defined]
    sys.modules.setdefault("torch.npu", npu)
    if not hasattr(torch.distributed, "is_hccl_available"):
        torch.distributed.is_hccl_available = lambda: False  # type: ignore[attr-defined]
    with contextlib.suppress(RuntimeError):  # renamed already
        torch.utils.rename_privateuse1_backend("npu")


def qwen2_vl_processors() -> None:
    """Stand-ins for transformers' Qwen2-VL processors where they cannot import (no torchvision):
    classes of those names, which only vision inputs would use."""
    for name, classes in QWEN2_VL_PROCESSORS.items():
        try:
            importlib.import_module(name)
        except ImportError:
            module = types.ModuleType(name, "stub: needs torchvision")
            for cls in classes:
                setattr(module, cls, type(cls, (), {}))
            sys.modules[name] = module


@contextlib.contextmanager
def no_pinned_memory() -> Iterator[None]:
    """``is_pin_memory_available()`` is False while the runner is built: its host staging buffers
    ask for pinned memory, which needs the device."""
    import vllm.utils.platform_utils as platform_utils

    saved = platform_utils.is_pin_memory_available
    users = [m for name, m in list(sys.modules.items())  # vLLM's and vllm-ascend's importers of it
             if name.startswith("vllm") and getattr(m, "is_pin_memory_available", None) is saved]  # fmt: skip
    for module in users:
        module.is_pin_memory_available = lambda: False
    try:
        yield
    finally:
        for module in users:
            module.is_pin_memory_available = saved


def all_devices_meta() -> Any:
    """A torch function mode under which every tensor factory builds on ``meta``."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors

    constructors = _device_constructors()

    class AllMeta(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = dict(kwargs or {})
            if "device" in kwargs or func in constructors:
                kwargs["device"] = torch.device("meta")
            return func(*args, **kwargs)

    return AllMeta()


__all__ = ["VllmAscendBackend"]
