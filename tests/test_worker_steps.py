"""A plugin's worker runs its own ``init_device`` and ``load_model`` (``.worker.WorkerSteps``).

The toy plugin's ``RunnerWorker`` (tests/toy_plugin/kvtoy/runner.py) is built as vllm-metal's
``MetalWorker`` is: its model runner in ``init_device``, its own model (read from the config.json,
no vLLM layers) in ``load_model``. Driven through the documented command, the correct worker agrees
on its specs, its memory probe and its pool, each answered by its own code; each broken sibling
(one wrong formula in the runner's specs, its allocation, the worker's memory probe) departs on
the test of that step. Before the harness ran these steps, the worker was left without its runner:
the harness's stand-in answered the specs with vLLM core's code (the broken specs went unchecked,
verdict ``core``) and the correct worker's allocation crashed.
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

SUITES = Path(__file__).resolve().parents[1] / "pytest_kvconform" / "suites"
#: one step each: the worker's specs, its memory probe, what it allocates
STEPS = ("test_layer_specs", "test_available_memory", "test_pool_holds_exactly_the_planned_blocks")


def _run(pytester: pytest.Pytester, worker: str, *backend: str) -> tuple[dict[str, Any], str]:
    """The three steps' tests on h2o-danube3-500m, with the toy platform and ``worker`` (or the
    ``backend`` options given instead)."""
    report = pytester.path / "report.json"
    toy = ("--kvconform-backend=vllm", "--kvconform-backend-option=platform=kvtoy.platform:ToyPlatform",
           f"--kvconform-backend-option=worker=kvtoy.runner:{worker}")  # fmt: skip
    result = pytester.runpytest_subprocess(
        str(SUITES / "test_kvconform_rules.py"), str(SUITES / "test_kvconform_allocation.py"),
        *(backend or toy),
        "-k", f"h2o-danube3-500m and ({' or '.join(STEPS)})",
        f"--kvconform-report={report}", "-p", "no:cacheprovider",
    )  # fmt: skip
    doc = json.loads(report.read_text())
    verdicts = {r["test"].rpartition("::")[2].partition("[")[0]: r for r in doc["results"]}
    return verdicts, "\n".join(result.outlines)


def test_a_worker_that_builds_its_runner_in_init_device_answers_with_its_own_code(
    pytester: pytest.Pytester,
) -> None:
    got, out = _run(pytester, "RunnerWorker")
    steps = "init_device its own, load_model its own (no vLLM layers)"
    assert f"worker: kvtoy.runner.RunnerWorker ({steps})" in out
    for step in STEPS:
        assert got[step]["verdict"] == "agreed", got[step]
        assert got[step]["answers"]["own"] >= 1, got[step]


@pytest.mark.parametrize(
    ("worker", "departs"),
    [
        ("GqaAsMhaWorker", "test_layer_specs"),  # its runner's get_kv_cache_spec: 16 KV heads, not 8
        ("OneBlockShortWorker", "test_pool_holds_exactly_the_planned_blocks"),  # its allocation
        ("DeviceMemoryWorker", "test_available_memory"),  # its memory probe ignores the budget
    ],
)
def test_one_wrong_formula_in_the_plugins_own_code_fails(
    pytester: pytest.Pytester, worker: str, departs: str
) -> None:
    got, _ = _run(pytester, worker)
    assert got[departs]["verdict"] == "departed", got[departs]
    assert got[departs]["answers"]["own"] >= 1, got[departs]


def test_a_load_model_that_needs_the_weights_crashes_and_a_profile_hook_replaces_it(
    pytester: pytest.Pytester,
) -> None:
    """``WeightsRunnerWorker`` loads weights in ``load_model`` (vllm-metal's does, through mlx-lm):
    offline its tests crash, never skip; its profile (kvtoy/profile.py: its own ``init_device``,
    a ``load_model`` hook that builds the runner's model without weights) makes them agree."""
    got, _ = _run(pytester, "WeightsRunnerWorker")
    assert {got[step]["verdict"] for step in STEPS} == {"crashed"}, got
    assert "model.safetensors" in got["test_layer_specs"]["message"]
    got, out = _run(pytester, "", "--kvconform-backend=kvtoy.profile:ToyMetalProfile")
    assert "init_device its own, load_model the profile's hook (no vLLM layers)" in out
    for step in STEPS:
        assert got[step]["verdict"] == "agreed", got[step]
