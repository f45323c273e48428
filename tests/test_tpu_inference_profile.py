"""The tpu-inference profile's own pieces that need no tpu-inference (the backend itself runs in
.venv-tpu: scripts/test.sh, docs/plugins.md "tpu-inference")."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import pytest_kvconform
from pytest_kvconform.backends.registry import BUILTINS, available_backends
from pytest_kvconform.backends.vllm.profiles import tpu_inference as profile
from pytest_kvconform.conformance import load_xfails

XFAILS = Path(pytest_kvconform.__file__).parent / "xfails" / "tpu-inference.toml"


def test_tpu_inference_is_a_builtin_backend_with_an_install_hint() -> None:
    assert "tpu-inference" in available_backends()
    target, hint = BUILTINS["tpu-inference"]
    assert target.endswith("profiles.tpu_inference:TpuInferenceBackend")
    assert "scripts/install-tpu-inference.sh" in hint


@pytest.mark.parametrize("budget", [1, 237_895_680, 8 << 30, 42_949_672_960, (64 << 30) - 1])
@pytest.mark.parametrize("utilization", [0.9, 0.92, 0.5, 1.0])
def test_hbm_stats_leave_exactly_the_budget(budget: int, utilization: float) -> None:
    """As TPUWorker.determine_available_memory computes it: int(limit * utilization - in_use)."""
    stats = profile.hbm_stats(budget, utilization)
    assert int(stats["bytes_limit"] * utilization - stats["bytes_in_use"]) == budget
    assert stats["bytes_in_use"] >= 0


def test_refusals_are_tpu_inferences_start_up_errors_only() -> None:
    mla = ValueError("Value error, MLA models require both the NEW_MODEL_DESIGN=1 environment variable ...")
    assert "NEW_MODEL_DESIGN=1" in (profile.refusal(mla) or "")
    dtype = TypeError("data type 'turboquant_k8v4' not understood")
    assert "turboquant_k8v4" in (profile.refusal(dtype) or "")
    assert profile.refusal(ValueError("Cannot fit both KV pools under gpu_memory_utilization=0.92")) is None


def test_every_xfail_is_tpu_inferences_and_names_a_function() -> None:
    entries = load_xfails(XFAILS, "tpu-inference")
    assert len(entries) >= 60
    assert not load_xfails(XFAILS, "vllm")  # none leaks to another backend
    for reason in entries.values():
        assert any(name in reason for name in ("TpuPlatform.", "KVCacheManager.", "TPUWorker.")), reason


@pytest.mark.skipif(importlib.util.find_spec("tpu_inference") is not None, reason="tpu-inference installed")
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_without_tpu_inference_the_backend_says_how_to_install_it() -> None:
    from pytest_kvconform.backends.vllm.runtime import VllmUnavailableError

    with pytest.raises(VllmUnavailableError, match=r"install-tpu-inference\.sh"):
        profile.TpuInferenceBackend()
