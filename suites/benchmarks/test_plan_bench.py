"""pytest-benchmark of the reference ``plan()`` over every packaged scenario.

Measures only; there are no timed asserts. Run with
``python -m pytest suites/benchmarks/test_plan_bench.py --benchmark-only``.
"""

from __future__ import annotations

import pytest

from pytest_kvconform.reference import plan
from pytest_kvconform.reference.layers import layer_specs
from pytest_kvconform.scenario import load_scenario, packaged_scenario_names


@pytest.mark.parametrize("name", packaged_scenario_names())
def test_plan_benchmark(benchmark, name):
    scenario = load_scenario(name)
    layers = (
        scenario.model.num_hidden_layers if scenario.model else sum(e.count for e in scenario.layer_specs)
    )
    benchmark.extra_info["scenario"] = scenario.name
    benchmark.extra_info["layers"] = layers
    benchmark.extra_info["kv_cache_specs"] = len(layer_specs(scenario))
    result = benchmark(plan, scenario)
    assert result == plan(scenario)  # a correctness check, not a timing one
    benchmark.extra_info["kv_cache_groups"] = result.kv_cache_groups
