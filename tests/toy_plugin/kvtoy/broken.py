"""Broken siblings of the toy Platform, each one historical class of bug."""

from kvtoy.platform import ToyPlatform, ToyVllm


class RepadsMambaPlatform(ToyPlatform):
    """Its config hook re-pads the Mamba page on every call (the vllm-gaudi #1708 class of bug:
    the hook is not idempotent)."""

    @classmethod
    def check_and_update_config(cls, vllm_config):
        cache = vllm_config.cache_config
        if cache.mamba_page_size_padded:
            cache.mamba_page_size_padded = cache.mamba_page_size_padded * 2


class HalvesMaxNumSeqsPlatform(ToyPlatform):
    """Its config hook halves ``max_num_seqs`` on every call: a setting outside the cache config."""

    @classmethod
    def check_and_update_config(cls, vllm_config):
        scheduler = vllm_config.scheduler_config
        scheduler.max_num_seqs = max(1, scheduler.max_num_seqs // 2)


class MissingKernelPlatform(ToyPlatform):
    """Its attention backend path names a module that does not exist (a renamed kernel package)."""

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        return "kvtoy.kernels_v2.ToyAttention"


class RepadsVllm(ToyVllm):
    name = "toy-vllm-repads"
    platform = RepadsMambaPlatform
