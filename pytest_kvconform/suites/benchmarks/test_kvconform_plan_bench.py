"""pytest-benchmark of the selected backend's ``plan()`` over every packaged scenario.

Measures only; there are no timed asserts (the suites check the plans). Runs only with
``--benchmark-only``: ``pytest --pyargs pytest_kvconform.suites --benchmark-only
--kvconform-backend=NAME``.

A scenario is skipped only for a reason the backend declares (``declines``), an offline gap, or
a rejection the reference makes too (the engine would not start). Any other exception fails.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvconform.conformance import decline_if_declared
from pytest_kvconform.gaps import OfflineGap
from pytest_kvconform.reference.layers import layer_specs
from pytest_kvconform.rejections import rejection_kind
from pytest_kvconform.scenario import Scenario, load_scenario, packaged_scenario_names

pytestmark = pytest.mark.kvconform_benchmark


def warm_plan(backend: Any, scenario: Scenario, name: str) -> Any:
    """The backend's plan of ``scenario``, untimed (imports and per-scenario caches happen here).

    Skips only on what the backend declares, an offline gap, or a rejection (the engine would not
    start: the suites compare it); anything else it raises propagates and fails the case."""
    decline_if_declared(backend, "plan", scenario)
    try:
        return backend.plan(scenario)
    except OfflineGap as exc:
        pytest.skip(f"backend {backend.name!r} cannot plan {name} here: {exc}")
    except Exception as exc:
        kind = rejection_kind(exc)
        if kind is None:
            raise
        pytest.skip(f"backend {backend.name!r} rejects {name} ({kind}): nothing to time")


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
