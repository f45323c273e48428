"""pytest-benchmark of the selected backend's ``plan()`` over every packaged scenario.

Measures only; there are no timed asserts (the suites check the plans). Runs only with
``--benchmark-only``: ``pytest --pyargs pytest_kvconform.suites --benchmark-only
--kvconform-backend=NAME``.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvconform.reference.layers import layer_specs
from pytest_kvconform.scenario import load_scenario, packaged_scenario_names

pytestmark = pytest.mark.kvconform_benchmark


@pytest.mark.parametrize("name", packaged_scenario_names())
def test_plan_benchmark(benchmark: Any, kv_backend: Any, name: str) -> None:
    scenario = load_scenario(name)
    try:
        warm = kv_backend.plan(scenario)  # untimed: imports and per-scenario caches happen here
    except Exception as exc:
        pytest.skip(f"backend {kv_backend.name!r} does not plan {name}: {type(exc).__name__}: {exc}")
    layers = (
        scenario.model.num_hidden_layers if scenario.model else sum(e.count for e in scenario.layer_specs)
    )
    benchmark.extra_info.update(
        backend=kv_backend.name, scenario=scenario.name, layers=layers,
        kv_cache_specs=len(layer_specs(scenario)), kv_cache_groups=warm.kv_cache_groups,
    )  # fmt: skip
    result = benchmark(kv_backend.plan, scenario)
    assert result == warm  # a determinism check, not a timing one
