"""The KV cache layout is resolved as the engine resolves it (vLLM 0.29+): ``EngineCore.
_initialize_kv_caches`` asks the workers which layouts their attention backends support
(``Worker.get_supported_kv_cache_layouts``), resolves one (``resolve_kv_cache_layout``,
vllm/v1/attention/backends/utils.py) and hands it to them (``set_kv_cache_layout``) before the
pool is planned. Expected layouts from vLLM 0.32's source: Triton declares none, so the default
preference's first (``_DEFAULT_LAYOUT_PREFERENCE``: LBNHC) stands; vLLM's CPU attention backend
declares only LBHNC (cpu_attn.py ``CPUAttentionBackend.supported_kv_cache_layouts``: "The CPU
backend only reads head-major block interiors"). Before, the harness resolved the default for every
platform, so the CPU platform's engine planned a layout its kernel does not read.
"""

from __future__ import annotations

import pytest

from pytest_kvconform.scenario import load_scenario

pytest.importorskip("vllm")

CPU_PLATFORM = "vllm.platforms.cpu:CpuPlatform"


@pytest.mark.parametrize(("platform", "layout"), [(None, "LBNHC"), (CPU_PLATFORM, "LBHNC")])
def test_the_layout_is_one_the_workers_backends_support(platform: str | None, layout: str) -> None:
    from vllm.v1.attention.backends import utils

    from pytest_kvconform.backends.vllm import VllmBackend

    if not hasattr(utils, "resolve_kv_cache_layout"):
        pytest.skip("vLLM before 0.29 has no KV cache layout")
    backend = VllmBackend(platform=platform, cpu_features="avx512_bf16") if platform else VllmBackend()
    engine = backend.engine(load_scenario("llama-3.1-8b-instruct-fp8"))
    assert engine.config.cache_config.kv_cache_layout == layout
