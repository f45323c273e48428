"""A toy vLLM hardware plugin's Platform: CPU-hosted, its paged kernel serves blocks of 8 tokens."""

from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import Platform, PlatformEnum
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend

from pytest_kvconform.backends.vllm import VllmBackend


class ToyKernel:
    """The toy kernel serves any block of a multiple of 8 tokens (vLLM core's Triton: of 16)."""

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(8)]

    @classmethod
    def supports_block_size(cls, block_size):
        return block_size is None or block_size % 8 == 0


class ToyAttention(ToyKernel, TritonAttentionBackend): ...


class ToyMLA(ToyKernel, CPUMLABackend): ...


class ToyTurboQuant(ToyKernel, TurboQuantAttentionBackend): ...


class ToyPlatform(Platform):
    _enum = PlatformEnum.CPU  # vLLM's CPU kernels run the model's layers on this host
    device_name = device_type = "cpu"
    dispatch_key = "CPU"

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_mla:
            return "kvtoy.platform.ToyMLA"
        if (attn_selector_config.kv_cache_dtype or "").startswith("turboquant_"):
            # the one backend of these dtypes: a layer it cannot serve (sinks, a window) has none
            config = {**attn_selector_config._asdict(), "device_capability": None}
            if reasons := ToyTurboQuant.validate_configuration(**config):
                raise ValueError(f"No valid attention backend found for {cls.device_name}: {reasons}")
            return "kvtoy.platform.ToyTurboQuant"
        return "kvtoy.platform.ToyAttention"

    @classmethod
    def get_mla_prefill_backend_cls(cls, mla_selector_config):
        return CpuPlatform.get_mla_prefill_backend_cls(mla_selector_config)

    @classmethod
    def support_hybrid_kv_cache(cls):
        return True


class ToyVllm(VllmBackend):
    """The vllm backend on the toy's Platform and Worker (entry point ``toy-vllm``)."""

    name = "toy-vllm"
    platform = ToyPlatform
    worker = "kvtoy.worker:ToyWorker"
