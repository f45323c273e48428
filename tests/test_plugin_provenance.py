"""Whose code answered a plugin's test: the plugin's, or vLLM core's running for it.

A plugin driven through the vllm backend (its Platform, its Worker) answers with its own code only
where code of its packages runs: a worker without a model runner of its own is given the harness's
stand-in (vLLM's ``GPUModelRunner.get_kv_cache_spec``), whose specs are vLLM core's, and vLLM's
planner groups and checks memory for every plugin. Those answers are ``core``: never a pass of the
plugin. The toy plugin (tests/toy_plugin/kvtoy) shows both: its platform with vLLM core's GPU
worker (the stand-in answers its specs) and with its own worker (its code prices the layers).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.usefixtures("toy_on_path"),
]

RULES = str(Path(__file__).resolve().parents[1] / "pytest_kvconform" / "suites" / "test_kvconform_rules.py")


def _verdicts(
    pytester: pytest.Pytester,
    *options: str,
    tests: str = "test_layer_specs or test_kv_cache_groups",
    platform: str = "kvtoy.platform:ToyPlatform",
) -> dict[str, Any]:
    report = pytester.path / "report.json"
    pytester.runpytest_subprocess(
        RULES, "--kvconform-backend=vllm", f"--kvconform-backend-option=platform={platform}",
        *options, "-k", f"({tests}) and llama-3.1-8b-instruct-fp8]",
        f"--kvconform-report={report}", "-p", "no:cacheprovider",
    )  # fmt: skip
    doc = json.loads(report.read_text())
    return {r["test"].rpartition("::")[2].partition("[")[0]: r for r in doc["results"]}


def test_a_stand_ins_specs_are_vllm_cores_not_the_plugins(pytester: pytest.Pytester) -> None:
    """The toy platform with vLLM core's GPU worker: the worker builds no runner offline, so the
    stand-in answers its specs with vLLM's code (before: counted as the plugin's, agreed)."""
    got = _verdicts(pytester)
    assert got["test_layer_specs"]["verdict"] == "core", got["test_layer_specs"]
    assert "layer_specs.layer_specs" in got["test_layer_specs"]["message"]
    assert got["test_kv_cache_groups"]["verdict"] == "core"  # vLLM's planner groups for every plugin
    assert got["test_layer_specs"]["answers"]["vLLM core"] >= 1  # (the toy platform's block choice: own)


def test_the_plugins_own_worker_is_credited(pytester: pytest.Pytester) -> None:
    got = _verdicts(pytester, "--kvconform-backend-option=worker=kvtoy.worker:ToyWorker")
    assert got["test_layer_specs"]["verdict"] == "agreed", got["test_layer_specs"]
    assert got["test_layer_specs"]["answers"]["own"] >= 1
    assert got["test_kv_cache_groups"]["verdict"] == "core"


def test_a_once_per_process_hook_credits_no_rule(pytester: pytest.Pytester) -> None:
    """vLLM's planner runs the platform's ``register_custom_kv_cache_specs`` once per process, in
    the first plan asked. The harness runs it while preparing the scenario, so the plan it asks
    next is vLLM core's whichever test comes first (before: the first one counted as the
    plugin's, agreed, and the same test run after another was core)."""
    platform = "kvtoy.registering:RegisteringPlatform"
    got = _verdicts(pytester, tests="test_kv_cache_tensors", platform=platform)
    assert got["test_kv_cache_tensors"]["verdict"] == "core", got["test_kv_cache_tensors"]


def test_a_failing_once_per_process_hook_fails_the_rule(pytester: pytest.Pytester) -> None:
    """The platform's ``register_custom_kv_cache_specs`` raising while the scenario is prepared
    (unwatched) is not lost: the planner runs the hook again, and the rule asked crashes with its
    error (before: vLLM's built-in spec types stayed registered, the hook never ran again, and
    the test ended ``core``, as if the plugin had no hook)."""
    platform = "kvtoy.registering:FailingRegistrationPlatform"
    got = _verdicts(pytester, tests="test_kv_cache_tensors", platform=platform)
    assert got["test_kv_cache_tensors"]["verdict"] == "crashed", got["test_kv_cache_tensors"]
    assert "spec types cannot be registered" in got["test_kv_cache_tensors"]["message"]
