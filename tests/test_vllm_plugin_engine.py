"""A plugin's worker and platform driven in the engine's order (pytest_kvconform/backends/vllm/worker.py).

The toy plugin's worker (``tests/toy_plugin/kvtoy/worker.py``) prices full-attention layers
itself and allocates its own pool from vLLM's ``KVCacheConfig``: each test ends *agreed*. A worker
that bills a hybrid's state layers as attention departs in ``test_layer_specs`` and the plan; one
that allocates a buffer per KV cache tensor where vLLM's tensors alias one allocation departs in
the allocation suite (the bytes it holds). A platform whose config hook expects a model never sees
a config without one.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, ClassVar

import pytest

SUITES = Path(__file__).resolve().parents[1] / "pytest_kvconform" / "suites"
RULES, ALLOCATION = str(SUITES / "test_kvconform_rules.py"), str(SUITES / "test_kvconform_allocation.py")

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.usefixtures("toy_on_path"),
]


def _run(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, dict[str, Any]]:
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(*args, f"--kvconform-report={report}", "-p", "no:cacheprovider")
    return result, json.loads(report.read_text())


def test_the_workers_own_specs_and_pool_are_checked(pytester: pytest.Pytester) -> None:
    """Granite-4.0-H-Tiny (36 Mamba-2 + 4 attention layers, block 400): the toy worker's specs
    agree layer by layer, and its pool of 3 blocks holds 3 x 4 pages x 819,200 B = 9,830,400 B
    (one attention and one padded state page per slot of the 4-layer groups)."""
    selected = (
        "(layer_specs or test_plan or planned_blocks) and granite-4.0-h-tiny"
        " and not (tp4 or hma-disabled or mamba-all)"
    )
    result, report = _run(pytester, RULES, ALLOCATION, "--kvconform-backend=toy-worker", "-k", selected)
    rules = report["rules"]
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert rules["layer_specs"]["agreed"] == 1 and rules["plan"]["agreed"] == 1
    assert rules["allocation"]["agreed"] == 1
    assert report["totals"]["agreed"] == 3 and sum(report["totals"].values()) == 3  # nothing else
    assert report["plan_steps"]["layer_specs.layer_specs"]["own"] == 1
    assert report["plan_steps"]["allocation.allocate_kv_cache"]["own"] == 1


def test_a_worker_billing_state_layers_as_attention_fails(pytester: pytest.Pytester) -> None:
    selected = "(layer_specs or test_plan) and granite-4.0-h-tiny and not (tp4 or hma-disabled or mamba-all)"
    result, report = _run(pytester, RULES, "--kvconform-backend=toy-state-as-attention", "-k", selected)
    rules = report["rules"]
    assert rules["layer_specs"]["departed"] == 1 and rules["plan"]["departed"] == 1
    assert report["totals"]["departed"] == 2 and sum(report["totals"].values()) == 2  # no crash
    plan = next(r for r in report["results"] if r["rule"] == "plan")
    assert plan["difference"] == {"field": "state_bytes_per_layer", "reference": "806400", "backend": "0"}
    result.stdout.fnmatch_lines([
        "*[[]layer_specs[]] backend 'toy-state-as-attention' on scenario 'ibm-granite/granite-4.0-h-tiny'"
        "*layers differ: missing [[](0, 'state')*",
        "*[[]plan[]] backend 'toy-state-as-attention'*state_bytes_per_layer: reference 806400, backend 0*",
    ])  # fmt: skip


def test_a_pool_per_aliased_tensor_fails_the_allocation(pytester: pytest.Pytester) -> None:
    """vLLM 0.32's ten group tensors of Granite alias one allocation: a buffer per tensor holds
    10 x the 3 blocks' 9,830,400 B."""
    result, report = _run(
        pytester, ALLOCATION, "--kvconform-backend=toy-pool-per-tensor",
        "-k", "planned_blocks and granite-4.0-h-tiny and not (tp4 or hma-disabled or mamba-all)",
    )  # fmt: skip
    from pytest_kvconform.backends.vllm.runtime import installed_vllm_version  # metadata only

    if tuple(map(int, installed_vllm_version().split(".")[:2])) < (0, 32):
        pytest.skip("before vLLM 0.32 each KV cache tensor is its own allocation")
    assert report["rules"]["allocation"]["departed"] == 1, result.stdout.str()[-2000:]
    (allocation,) = report["results"]
    assert allocation["verdict"] == "departed" and allocation["outcome"] == "failed"
    # what the pool holds is compared first: 10 buffers of the 3 blocks' 9,830,400 B
    assert allocation["difference"] == {"field": "bytes_held", "reference": "9830400",
                                        "backend": "98304000"}  # fmt: skip


def test_no_config_without_a_model_reaches_the_plugins_platform() -> None:
    """A platform whose ``check_and_update_config`` reads the model (as tpu-inference's reads
    ``model_config.runner_type``): the process group's bootstrap and the spec-level configs are
    built under vLLM core's neutral platform, so every rule runs."""
    from pytest_kvconform.backends.vllm import VllmBackend
    from pytest_kvconform.backends.vllm.platform import neutral_platform
    from pytest_kvconform.scenario import load_scenario

    base = neutral_platform()

    class NeedsAModel(base):  # type: ignore[misc,valid-type]
        seen: ClassVar[list[str]] = []

        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            cls.seen.append(vllm_config.model_config.runner_type)  # AttributeError without a model

    backend = VllmBackend(platform=NeedsAModel)
    granite = load_scenario("granite-4.0-h-tiny")
    specs = backend.layer_specs(scenario=granite)
    assert backend.kv_cache_groups(specs, scenario=granite)
    spec_level = load_scenario("qwen3-next-80b-a3b-mtp2-tp4-with-draft")
    assert backend.plan(spec_level).num_blocks > 0
    assert NeedsAModel.seen and set(NeedsAModel.seen) == {"generate"}
