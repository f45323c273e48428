"""What cannot run on this host, and why: the only reasons a backend may decline at run time.

A backend declines an input it does not model by declaring it once (its
:class:`~pytest_kvconform.requirements.Declines`); at run time only these offline gaps may
decline, each raised as :class:`OfflineGap` with its key. Everything else a backend, a plugin or
vLLM raises while building, planning or allocating is a crash: a failed test.
"""

from __future__ import annotations

#: key -> what cannot run here and why
OFFLINE_GAPS: dict[str, str] = {
    "no_model": "a spec-level scenario names its pages, not a model: there is no model for vLLM to build",
    "no_config_writer": "the harness writes vLLM a config.json only for the geometries its writers "
    "spell (pytest_kvconform/backends/vllm/configs.py); this geometry has none",
    "cpu_build": "a kernel or attention backend that a CPU build of vLLM lacks (FlashInfer's nvfp4, "
    "the Triton kernels of UltraQuant, FlashAttention's MLA prefill before vLLM 0.29, CUTLASS DSL)",
    "release_lacks": "the installed vLLM release has no such feature (a kv_cache_dtype or API newer than it)",
    "draft_checkpoint": "the draft of EAGLE or a draft model comes from a checkpoint of its own, "
    "which offline sizing does not load",
    "constructed_layers": "a value vLLM reads from constructed layers, where the rule is asked of a "
    "config without them (the prefill checkpoint alignment of Mamba layers)",
    "offline_config": "a setting vLLM derives from what the offline config does not model "
    "(pipeline parallelism, a max_model_len derived from weights)",
    "device_allocation": "vLLM core's GPU worker allocates on its device (GPUModelRunner."
    "initialize_kv_cache); only a plugin's worker is asked to allocate here",
    "one_unify_policy": "vLLM implements one page unification (pad-to-max); the scenario asks for another",
    "device_count": "the host has fewer devices than the plugin's mesh needs",
    "runner_views": "before vLLM 0.29 a plugin's own model runner makes its layers' views (its "
    "_reshape_kv_cache_tensors, inside its allocation); the harness runs vLLM core's runner's only",
}


class OfflineGap(Exception):
    """Raised by a backend for an input it cannot run on this host: ``OfflineGap("cpu_build",
    "nvfp4 is packed by FlashInfer")``. The key must be one of :data:`OFFLINE_GAPS`."""

    def __init__(self, gap: str, detail: str = "") -> None:
        if gap not in OFFLINE_GAPS:
            raise ValueError(f"OfflineGap({gap!r}): expected one of {', '.join(OFFLINE_GAPS)}")
        self.gap, self.detail = gap, detail
        super().__init__(f"{gap}: {detail}" if detail else gap)

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.gap, self.detail)
