"""A correct plugin passes and a plugin with one wrong formula fails, through the documented command.

The toy plugin (tests/toy_plugin/kvtoy) is a CPU-hosted Platform whose paged kernel serves blocks of
a multiple of 8 tokens (vLLM core's Triton: 16) and a Worker that prices full attention and holds
its pool itself, as a hardware plugin does. Its broken siblings each carry one historical class of
bug. Each run is ``pytest --pyargs pytest_kvconform.suites --kvconform-backend=vllm
--kvconform-backend-option platform=... --kvconform-backend-option worker=...`` (docs/plugins.md).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.backends.vllm.backend import VllmBackend

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.usefixtures("toy_on_path"),
]

CORRECT = {"platform": "kvtoy.platform:ToyPlatform", "worker": "kvtoy.worker:ToyWorker"}


def suites(pytester: pytest.Pytester, *args: str, **options: str) -> tuple[pytest.RunResult, dict[str, Any]]:
    """The documented command in a subprocess (vLLM's extensions load once per process), with the
    toy plugin importable; returns the run and its JSON report."""
    report = pytester.path / "report.json"
    chosen = [f"--kvconform-backend-option={k}={v}" for k, v in {**CORRECT, **options}.items()]
    result = pytester.runpytest_subprocess(
        "--pyargs", "pytest_kvconform.suites", "--kvconform-backend=vllm", *chosen, *args,
        f"--kvconform-report={report}", "-p", "no:cacheprovider", "--benchmark-disable",
    )  # fmt: skip
    return result, json.loads(report.read_text())


def verdicts(doc: dict[str, Any], test: str) -> dict[str, str]:
    """test id (the part after ``::``) -> verdict, for the tests whose id starts with ``test``."""
    out = {}
    for r in doc["results"]:
        name = r["test"].rpartition("::")[2]
        if name.startswith(test):
            out[name] = r["verdict"]
    return out


def test_a_correct_plugin_passes_every_suite(pytester: pytest.Pytester) -> None:
    """The whole suite, property tests included, with no known-departure file: nothing departs or
    crashes. The false alarms a correct plugin used to hit: the Qwen3.5 bs160 reviewer numbers,
    stated for a kernel of 32, are not applicable to the toy's kernel of 8 (its plans agree at 8);
    the auto-fit message is compared by its numbers (the toy's engine says "GiB CPU"); the Gemma 4
    pool kept as per-layer views of one allocation is counted once; fp8 GQA pages agree."""
    result, doc = suites(pytester, "-n", "2", "--kvconform-max-examples=20")
    totals = doc["totals"]
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    assert (totals["departed"], totals["crashed"]) == (0, 0), result.stdout.str()[-3000:]
    # known: only vLLM core's own bugs, which every plugin on vLLM's planner inherits (no file of its own)
    vllm_bugs = {k.reason for k in VllmBackend.known_departures}
    assert {r["message"] for r in doc["results"] if r["verdict"] == "known"} <= vllm_bugs
    # vLLM's planner groups and checks memory for the plugin: those tests are vLLM core's, not passes
    assert totals["agreed"] > 200 and totals["core"] > 50 and totals["gen. compared"] > 100
    assert verdicts(doc, "test_expectations[qwen3.5-bs160-reviewer]") == {
        "test_expectations[qwen3.5-bs160-reviewer]": "n/a"  # block 160 at alignment 16; the toy's is 8
    }
    # the Qwen3.5 hybrids of vllm-metal #235 planned at the toy's 8 (its kernel block rule is metal's)
    assert set(verdicts(doc, "test_metal235_qwen35_08b_today").values()) == {"agreed"}
    assert set(verdicts(doc, "test_metal235_plan_reports_the_translation").values()) == {"agreed"}
    assert set(verdicts(doc, "test_plan[qwen2.5-3b-instruct-auto-fit]").values()) == {"agreed"}
    assert set(verdicts(doc, "test_pool_holds_exactly_the_planned_blocks[gemma-4-31b-it]").values()) == {
        "agreed"
    }
    assert set(verdicts(doc, "test_layer_specs[llama-3.1-8b-instruct-fp8]").values()) == {"agreed"}
    props = {r["rule"]: r["verdict"] for r in doc["results"] if r["test"].endswith("_generated")}
    assert props and set(props.values()) <= {"agreed", "core", "declined"}, props
    assert "agreed" in props.values()


def test_the_worker_is_handed_the_engine_config_without_the_pools_override(pytester: pytest.Pytester) -> None:
    """vllm-metal #527's scenario pins the whole pool (num_gpu_blocks_override = 999,999); the
    few-block config the worker is asked to hold used to carry it, so a correct worker held 999,999
    blocks against the reference's 3."""
    scenario = (
        Path(__file__).parents[1] / "pytest_kvconform/scenarios/regressions/qwen2.5-3b-block-override.toml"
    )
    result, doc = suites(pytester, f"--kvconform-scenarios={scenario}", "-k",
                         "test_pool_holds_exactly_the_planned_blocks and block-override")  # fmt: skip
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    assert verdicts(doc, "test_pool_holds_exactly_the_planned_blocks") == {
        "test_pool_holds_exactly_the_planned_blocks[qwen2.5-3b-block-override]": "agreed"
    }


@pytest.mark.parametrize(
    ("options", "select", "test", "verdict", "shown"),
    [
        # its allocator holds one block fewer than the engine's KVCacheConfig
        (
            {"worker": "kvtoy.worker:OneBlockShortWorker"},
            "test_pool_holds_exactly_the_planned_blocks and llama-3.1",
            "test_pool_holds_exactly_the_planned_blocks[llama-3.1-8b-instruct-fp8]",
            "departed",
            "*[[]allocation[]] backend 'vllm' on scenario *: bytes_held: reference 3145728, backend 2097152*",
        ),
        # fp8 attention priced at the model's two bytes (vLLM stores fp8 as uint8): 65,536 B pages, not 32,768
        (
            {"worker": "kvtoy.worker:Fp8AtModelDtypeWorker"},
            "test_layer_specs and llama-3.1-8b-instruct-fp8 and not block-8",
            "test_layer_specs[llama-3.1-8b-instruct-fp8]",
            "departed",
            "*[[]layer_specs[]] * layer 0 (attention): dtype: reference 'uint8', backend 'bfloat16'*",
        ),
        # the engine's budget is not the budget: 0.92 of a device with twice the budget free
        (
            {"worker": "kvtoy.worker:SizesFromTheDeviceWorker"},
            "test_available_memory and llama-3.1-8b-instruct-fp8 and not block-8",
            "test_available_memory[llama-3.1-8b-instruct-fp8]",
            "departed",
            "*[[]memory[]] * available bytes (device 17,179,869,184 B free): reference 8589934592, "
            "backend 15805479649*",
        ),
        # a setting outside the cache config, halved on every call of the config hook
        (
            {"platform": "kvtoy.broken:HalvesMaxNumSeqsPlatform"},
            "test_config_hook_is_idempotent and qwen2.5-3b-instruct-tp4",
            "test_config_hook_is_idempotent[qwen2.5-3b-instruct-tp4-check_and_update_config]",
            "departed",
            "*HalvesMaxNumSeqsPlatform.check_and_update_config (second run) set "
            "scheduler_config.max_num_seqs*",
        ),
        # its attention backend's module does not exist: a crash, never a skip or a reference answer
        (
            {"platform": "kvtoy.broken:MissingKernelPlatform"},
            "test_layer_specs and qwen2.5-3b-instruct-tp4",
            "test_layer_specs[qwen2.5-3b-instruct-tp4]",
            "crashed",
            "*ModuleNotFoundError: No module named 'kvtoy.kernels_v2'*",
        ),
    ],
)
def test_a_plugin_with_one_wrong_formula_fails(
    pytester: pytest.Pytester,
    options: dict[str, str],
    select: str,
    test: str,
    verdict: str,
    shown: str,
) -> None:
    result, doc = suites(pytester, "-k", select, **options)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()[-3000:]
    assert verdicts(doc, test) == {test: verdict}, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines([shown])
