"""The toy plugin's own vLLM Platform, driven through pytest-kvconform's vllm backend."""

from vllm.platforms.interface import Platform, PlatformEnum

from pytest_kvconform.backends.vllm import VllmBackend


class ToyPlatform(Platform):
    """A CPU-hosted platform whose config hook re-pads the Mamba page on every call (the
    vllm-gaudi#1708 class of bug: the hook is not idempotent)."""

    _enum = PlatformEnum.CPU
    device_name = "toy"
    device_type = "cpu"

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        return "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"

    @classmethod
    def support_hybrid_kv_cache(cls):
        return True

    @classmethod
    def check_and_update_config(cls, vllm_config):
        cache = vllm_config.cache_config
        if cache.mamba_page_size_padded:
            cache.mamba_page_size_padded = cache.mamba_page_size_padded * 2


class ToyVllm(VllmBackend):
    name = "toy-vllm"
    platform = ToyPlatform
