"""The toy platform with a spec registration hook of its own, as vllm-rbln's platform has one:
vLLM's planner calls ``register_custom_kv_cache_specs`` once per process
(``KVCacheSpecRegistry._ensure_registered``), from whichever plan asks first."""

from .platform import ToyPlatform


class RegisteringPlatform(ToyPlatform):
    @classmethod
    def register_custom_kv_cache_specs(cls, vllm_config):
        """Registers nothing (the toy has no spec type of its own), but its code runs."""


class FailingRegistrationPlatform(ToyPlatform):
    """A spec registration hook that raises: the error must reach the rule that plans, never vanish."""

    @classmethod
    def register_custom_kv_cache_specs(cls, vllm_config):
        raise RuntimeError("kvtoy: this platform's spec types cannot be registered")
