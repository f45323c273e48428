"""The attention backends the neutral platform selects: vLLM's own, at the scenario's kernel block.

A scenario's ``kernel_block_alignment`` is the smallest kernel block of the model's attention
backend (``get_supported_kernel_block_sizes``; FlashAttention and Triton declare
``MultipleOf(16)``). The neutral platform's ``get_attn_backend_cls`` answers with a subclass of
the vLLM backend that serves the layer (FlashAttention or Triton attention, the common MLA
backend, TurboQuant for ``turboquant_*``: :func:`base_for`) whose only change is its kernel
block sizes, ``[MultipleOf(alignment)]`` (``supports_block_size`` accordingly): its
``customize_spec``, impl and name stay vLLM's. A layer TurboQuant's backend cannot serve is
refused as a GPU platform refuses it (:func:`refuse_unserved`). vLLM resolves the answer by
qualified name, so the subclasses are attributes of this module, made on first use:
``pytest_kvconform.backends.vllm.attention.TRITON_ATTN__16``.
"""

from __future__ import annotations

import functools
from typing import Any

from .api import mla_backend
from .runtime import UnsupportedByVllmError

#: base name -> the vLLM backend class it subclasses
BASES = {
    "FLASH_ATTN": "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend",
    "TRITON_ATTN": "vllm.v1.attention.backends.triton_attn:TritonAttentionBackend",
    # Triton MLA's impl imports FlashAttention helpers a CPU build lacks; the CPU MLA backend
    # shares MLACommonBackend's customize_spec, and its kernel sizes are replaced below anyway.
    # Releases without it (before 0.28) use Triton MLA's: :func:`.api.mla_backend`.
    "CPU_MLA": "vllm.v1.attention.backends.mla.cpu_mla:CPUMLABackend",
    "TURBOQUANT": "vllm.v1.attention.backends.turboquant_attn:TurboQuantAttentionBackend",
}


#: kv_cache_dtype -> why no attention backend of a CPU build of vLLM serves it, on any platform
CPU_BUILD_LACKS = {
    "nvfp4": "nvfp4 is packed by FlashInfer, which a CPU build of vLLM lacks",
    "nvfp4_4over6": "nvfp4_4over6 is packed by FlashInfer, which a CPU build of vLLM lacks",
    "ultraquant_4bit": "the UltraQuant backend imports Triton kernels, which a CPU build lacks",
}


#: The caches FlashAttention serves on every device and release (its fp8 depends on the device:
#: ``FlashAttentionImpl`` refuses it where the FlashAttention version has none, as on a CPU build).
UNQUANTIZED = ("auto", "float16", "bfloat16")


def base_for(kv_cache_dtype: str | None, use_mla: bool) -> str:
    """Which of vLLM's backends serves a layer, as CUDA's selection would for sizing
    (``_get_backend_priorities``, vllm/platforms/cuda.py: FlashAttention, FlashInfer, Triton,
    FlexAttention, TurboQuant): FlashAttention for an unquantized cache (a skip layer's too),
    Triton for the formats only it packs (``*_per_token_head``) and for fp8. The two price every
    cache the same except the per-token-head scales, which only Triton's ``customize_spec`` adds:
    what Phase 3 reads when a skip layer comes first."""
    dtype = kv_cache_dtype or "auto"
    if dtype.startswith("turboquant_"):  # the only backend listing them, MLA layers' too
        return "TURBOQUANT"
    if use_mla:
        return "CPU_MLA"
    if dtype in CPU_BUILD_LACKS:
        raise UnsupportedByVllmError("cpu_build", CPU_BUILD_LACKS[dtype])
    if dtype in UNQUANTIZED:
        return "FLASH_ATTN"
    return "TRITON_ATTN"


def refuse_unserved(base: str, alignment: int, attn_selector_config: Any) -> None:
    """A GPU platform's selection (``CudaPlatformBase.get_valid_backends``, vllm/platforms/cuda.py)
    for the one backend a layer cannot avoid: TurboQuant's is the only backend of a ``turboquant_*``
    cache, and vLLM's own ``validate_configuration`` says why it cannot serve the layer (sinks,
    sliding window, DCP, ... as the release checks them); then the engine has no backend for it.
    The block-size reason is left out: the kernel block rule is the scenario's (:func:`aligned_backend`)."""
    if base != "TURBOQUANT":
        return
    from vllm.platforms.interface import DeviceCapability

    validate = aligned_backend(base, alignment).validate_configuration
    reasons = validate(device_capability=DeviceCapability(9, 0), **attn_selector_config._asdict())
    reasons = [r for r in reasons if r != "block_size not supported"]
    if reasons:
        raise ValueError(
            f"No valid attention backend found for cuda with {attn_selector_config!r}. "
            f"Reasons: {{TURBOQUANT: [{', '.join(reasons)}]}}."
        )


def qualname(base: str, alignment: int) -> str:
    return f"{__name__}.{base}__{alignment}"


@functools.cache
def aligned_backend(base: str, alignment: int) -> type:
    """vLLM's ``base`` backend with ``MultipleOf(alignment)`` as its kernel block sizes."""
    import importlib

    from vllm.v1.attention.backend import MultipleOf

    path = mla_backend(BASES[base]) if base == "CPU_MLA" else BASES[base]
    module_name, _, attr = path.partition(":")
    parent = getattr(importlib.import_module(module_name), attr)

    def sizes(kv_cache_spec: Any = None) -> list[Any]:
        return [MultipleOf(alignment)]

    def supports(cls: type, block_size: int | None) -> bool:
        return block_size is None or block_size % alignment == 0

    cls = type(f"{base}__{alignment}", (parent,), {
        "get_supported_kernel_block_sizes": staticmethod(sizes), "supports_block_size": classmethod(supports),
    })  # fmt: skip
    cls.__module__ = __name__
    return cls


def __getattr__(name: str) -> Any:
    base, sep, alignment = name.rpartition("__")
    if sep and base in BASES and alignment.isdigit():
        return aligned_backend(base, int(alignment))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
