"""pytest-benchmark of the selected backend's ``plan()`` over every packaged scenario.

Measures only; there are no timed asserts (the suites check the plans). Runs only with
``--benchmark-only``: ``pytest --pyargs pytest_kvconform.suites --benchmark-only
--kvconform-backend=NAME``.

A scenario is skipped only for a reason the backend declares: ``plan`` not provided, not
applicable (``RuleNotApplicable``), or a rejection its ``known_failures`` lists for
``plan::test_plan[<scenario>]``. Any other exception fails the case.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvconform.conformance import known_failure_of, skip_if_not_provided
from pytest_kvconform.errors import REJECTIONS, RuleNotApplicable
from pytest_kvconform.reference.layers import layer_specs
from pytest_kvconform.scenario import Scenario, load_scenario, packaged_scenario_names

pytestmark = pytest.mark.kvconform_benchmark


def warm_plan(backend: Any, scenario: Scenario, name: str) -> Any:
    """The backend's plan of ``scenario``, untimed (imports and per-scenario caches happen here).

    Skips only on what the backend declares (not provided, not applicable, a known rejection);
    anything else it raises propagates and fails the case."""
    skip_if_not_provided(backend, "plan")
    try:
        return backend.plan(scenario)
    except RuleNotApplicable as exc:
        pytest.skip(f"backend {backend.name!r} cannot plan {name}: {exc}")
    except REJECTIONS as exc:
        declared = known_failure_of(backend, "plan", f"test_plan[{name}]")
        if declared is None:
            raise
        pytest.skip(
            f"backend {backend.name!r} rejects {name} ({type(exc).__name__}), a known failure: {declared}"
        )


@pytest.mark.parametrize("name", packaged_scenario_names())
def test_plan_benchmark(benchmark: Any, kv_backend: Any, name: str) -> None:
    scenario = load_scenario(name)
    warm = warm_plan(kv_backend, scenario, name)
    layers = (
        scenario.model.num_hidden_layers if scenario.model else sum(e.count for e in scenario.layer_specs)
    )
    benchmark.extra_info.update(
        backend=kv_backend.name, scenario=scenario.name, layers=layers,
        kv_cache_specs=len(layer_specs(scenario)), kv_cache_groups=warm.kv_cache_groups,
    )  # fmt: skip
    result = benchmark(kv_backend.plan, scenario)
    assert result == warm  # a determinism check, not a timing one
