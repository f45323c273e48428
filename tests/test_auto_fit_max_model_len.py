"""vLLM's auto-fit of ``max_model_len`` (``max_model_len = -1``; ``_auto_fit_max_model_len`` in
``get_kv_cache_configs``): the scenario format, the reference's plan per release, and broken
auto-fit rules caught by the hand-derived ``[expect]`` of qwen2.5-3b-instruct-auto-fit.toml
(docs/scenario-derivations.md, R17)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pytest_kvconform.reference import memory
from pytest_kvconform.reference.releases import rule_set
from pytest_kvconform.reference.rules import reference_rules
from pytest_kvconform.scenario import ScenarioError, load_scenario, scenario_from_dict

PACKAGE = Path(__file__).resolve().parents[1] / "pytest_kvconform"
SCENARIO = PACKAGE / "scenarios" / "qwen2.5-3b-instruct-auto-fit.toml"
RULES_SUITE = str(PACKAGE / "suites" / "test_kvconform_rules.py")

GIB = 1 << 30  # 1,073,741,824
BLOCK = 36 * 32 * 2 * (128 + 128) * 2  # 36 layers x 32 tokens x 2 KV heads x (K + V) x bf16 = 1,179,648


def _dense(max_model_len: object, budget: int = GIB, **model: object) -> dict:
    return {
        "schema": "kv-scenario/1", "name": "auto-fit",
        "model": {"architecture": "Qwen2ForCausalLM", "dtype": "bfloat16", "num_hidden_layers": 36,
                  "layers": "A" * 36, "attention": {"kind": "gqa", "num_kv_heads": 2, "head_dim": 128},
                  **model},
        "runtime": {"max_model_len": max_model_len, "block_size": 32, "kv_cache_memory_bytes": budget,
                    "mamba_cache_mode": "none", "max_concurrent_batches": 1},
    }  # fmt: skip


@pytest.mark.parametrize("spelling", [-1, "auto"])
def test_minus_one_and_auto_request_auto_fit_from_the_derived_length(spelling: object) -> None:
    s = scenario_from_dict(_dense(spelling, max_position_embeddings=32768))
    assert s.runtime.auto_fit_max_model_len and s.runtime.max_model_len == 32768


def test_auto_fit_needs_the_derived_length() -> None:
    with pytest.raises(ScenarioError, match="max_position_embeddings"):
        scenario_from_dict(_dense(-1))
    with pytest.raises(ScenarioError, match=r"runtime\.max_model_len"):
        scenario_from_dict(_dense(0, max_position_embeddings=32768))


def test_the_packaged_scenario_per_release() -> None:
    s = load_scenario(SCENARIO)
    # 0.29+: the null block held back, 909 blocks of 32 tokens
    for release, text in (("0.33", "available KV cache memory (1.0 GiB GPU)"),
                          ("0.32", "available KV cache memory (1.0 GiB GPU)"),
                          ("0.31", "available GPU memory (1.0 GiB available for KV cache)"),
                          ("0.29", "available GPU memory (1.0 GiB available for KV cache)")):  # fmt: skip
        plan = reference_rules(rule_set(release)).plan(s)
        assert (plan.auto_fit_max_model_len, plan.blocks_per_request, plan.admission) == (909 * 32, 909, "ok")
        assert (
            plan.auto_fit_message == f"Auto-fit max_model_len: reduced from 32768 to 29088 to fit in {text}"
        )
    # 0.23 ... 0.28: the whole pool, 910 blocks
    for release in ("0.28", "0.23"):
        plan = reference_rules(rule_set(release)).plan(s)
        assert plan.auto_fit_max_model_len == 910 * 32 == 29120
        assert plan.auto_fit_message.endswith(
            "29120 to fit in available GPU memory (1.0 GiB available for KV cache)"
        )


def test_a_fitting_model_keeps_its_length_and_says_so() -> None:
    plan = reference_rules().plan(scenario_from_dict(_dense(-1, 8 * GIB, max_position_embeddings=32768)))
    assert plan.auto_fit_max_model_len == 32768 and plan.blocks_per_request == 1024
    assert plan.auto_fit_message == (
        "Auto-fit max_model_len: full model context length 32768 fits in available KV cache memory "
        "(8.0 GiB GPU)"  # (8 GiB - 1,179,648) / 2**30 = 7.9989, rounded 8.0
    )
    assert (
        "fits in available GPU memory"
        in reference_rules(rule_set("0.31"))
        .plan(scenario_from_dict(_dense(-1, 8 * GIB, max_position_embeddings=32768)))
        .auto_fit_message
    )


def test_not_one_token_is_vllms_auto_fit_error() -> None:
    plan = reference_rules().plan(
        scenario_from_dict(_dense(-1, BLOCK + BLOCK // 2, max_position_embeddings=32768))
    )
    assert plan.admission == memory.AUTO_FIT_ERROR  # 1.5 blocks: the null block leaves half a block
    assert (plan.auto_fit_max_model_len, plan.auto_fit_message) == (0, "")


def test_plans_without_auto_fit_keep_their_records() -> None:
    plan = reference_rules().plan(scenario_from_dict(_dense(4096, max_position_embeddings=32768)))
    assert "auto_fit_message" not in plan.to_dict() and "auto_fit_max_model_len" not in plan.to_dict()
    assert dataclasses.replace(plan).auto_fit_max_model_len == 0


BROKEN = '''
from unittest import mock

from pytest_kvconform.backends.base import ReferenceBackend
from pytest_kvconform.reference import memory


class IgnoresAutoFit(ReferenceBackend):
    """max_model_len = -1 planned as the derived length itself (no auto-fit)."""
    name = "ignores-auto-fit"
    def plan(self, scenario):
        return super().plan(scenario.with_runtime(auto_fit_max_model_len=False))


class AutoFitOnWholePool(ReferenceBackend):
    """Auto-fit searching the whole pool, the null block not held back (as before vLLM 0.29)."""
    name = "auto-fit-on-whole-pool"
    def plan(self, scenario):
        budget = memory.admission_budget
        whole = lambda a, b, **k: budget(a, b, reserve_null_block=False)
        with mock.patch.object(memory, "admission_budget", whole):
            return super().plan(scenario)


class AutoFitTextOfTheWholePool(ReferenceBackend):
    """The log text naming the length of the whole pool (the null block not held back, as before
    vLLM 0.29) while the plan holds the null block back: the text's numbers are wrong."""
    name = "auto-fit-text-of-the-whole-pool"
    def plan(self, scenario):
        text = memory.auto_fit_message
        whole = lambda derived, fitted, *a, **k: text(derived, fitted + scenario.runtime.block_size, *a, **k)
        with mock.patch.object(memory, "auto_fit_message", whole):
            return super().plan(scenario)


class OldAutoFitText(ReferenceBackend):
    """The 0.23 ... 0.31 log text under the newest rules: reworded, the same numbers."""
    name = "old-auto-fit-text"
    def plan(self, scenario):
        text = memory.auto_fit_message
        old = lambda *a, **k: text(*a, kv_cache_memory_text=False)
        with mock.patch.object(memory, "auto_fit_message", old):
            return super().plan(scenario)
'''


def _run_expectations(pytester: pytest.Pytester, backend: str) -> pytest.RunResult:
    pytester.makepyfile(broken=BROKEN)
    pytester.syspathinsert()
    return pytester.runpytest(
        RULES_SUITE, f"--kvconform-backend=broken:{backend}", "-k", "test_expectations and auto-fit",
        "-p", "no:cacheprovider", "-rfEs",
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["IgnoresAutoFit", "AutoFitOnWholePool", "AutoFitTextOfTheWholePool"])
def test_a_broken_auto_fit_fails_the_packaged_expectation(pytester: pytest.Pytester, backend: str) -> None:
    result = _run_expectations(pytester, backend)
    failed = [
        line for line in result.stdout.lines if line.startswith("FAILED") and "test_expectations[" in line
    ]
    assert any("qwen2.5-3b-instruct-auto-fit" in line for line in failed), result.stdout.str()[-2000:]


def test_a_reworded_auto_fit_text_is_not_a_departure(pytester: pytest.Pytester) -> None:
    """vLLM's texts are compared by kind and numbers (``conformance.message_view``): the older
    release's wording with the same numbers meets the [expect]; the plan is the reference's code's
    own answer (``super().plan``), so the verdict is inherited, not agreed."""
    result = _run_expectations(pytester, "OldAutoFitText")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] *: inherited: the reference's code answered: *plan.plan*"])
