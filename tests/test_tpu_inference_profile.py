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
    """What tpu-inference refuses to start with (an MLA model without NEW_MODEL_DESIGN=1 and DP
    attention, a kv_cache_dtype without a JAX type) is declined by input kind, for every rule;
    the same model with those settings, or a JAX dtype, is not. Its sizing refusal ("Cannot fit
    both KV pools") is no decline: a rejection of kind not_enough_memory, compared with vLLM's."""
    from pytest_kvconform.rejections import rejection_kind
    from pytest_kvconform.scenario import load_scenario

    declines = profile.TpuInferenceBackend.declines
    mla = load_scenario("deepseek-v3-fp8")
    for rule in ("layer_specs", "plan", "memory"):
        assert "NEW_MODEL_DESIGN=1" in (declines.reason(rule, mla) or ""), rule
    dp_attention = '{"sharding": {"sharding_strategy": {"enable_dp_attention": true}}}'
    new_design = mla.with_runtime(env=(("NEW_MODEL_DESIGN", "1"),), additional_config=dp_attention)
    assert declines.reason("plan", new_design) is None
    assert declines.reason("plan", mla.with_runtime(env=(("NEW_MODEL_DESIGN", "1"),))) is not None  # no DP

    dense = load_scenario("granite-4.0-h-tiny")
    turboquant = dense.with_runtime(kv_cache_dtype="turboquant_k8v4")
    assert "to_jax_dtype" in (declines.reason("layer_specs", turboquant) or "")
    for dtype in ("auto", "fp8", "bfloat16"):
        assert declines.reason("layer_specs", dense.with_runtime(kv_cache_dtype=dtype)) is None, dtype

    pools = ValueError("Cannot fit both KV pools under gpu_memory_utilization=0.92")
    assert rejection_kind(pools) == "not_enough_memory"
    assert not any(isinstance(key, str) and key in ("plan", "memory", "*") for key in declines.entries)


def test_every_xfail_is_tpu_inferences_and_names_a_function() -> None:
    entries = load_xfails(XFAILS, "tpu-inference")
    assert len(entries) >= 60
    assert not load_xfails(XFAILS, "vllm")  # none leaks to another backend
    for entry in entries:
        reason = entry.reason
        assert any(name in reason for name in ("TpuPlatform.", "KVCacheManager.", "TPUWorker.")), reason
        # a known departure is strict: it names the tests (or inputs) and the field they depart in
        assert entry.field and entry.field != "*", entry
        assert entry.test.startswith("test_") or entry.when is not None, entry
    assert len({(e.rule, e.test, e.when, e.field) for e in entries}) == len(entries)  # no duplicates


@pytest.mark.skipif(importlib.util.find_spec("tpu_inference") is not None, reason="tpu-inference installed")
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_without_tpu_inference_the_backend_says_how_to_install_it() -> None:
    from pytest_kvconform.backends.vllm.runtime import VllmUnavailableError

    with pytest.raises(VllmUnavailableError, match=r"install-tpu-inference\.sh"):
        profile.TpuInferenceBackend()
