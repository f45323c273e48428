"""pytest-benchmark of ``plan()`` with vLLM's code next to the reference, per scenario.

Each scenario is one benchmark group holding two rows: ``VllmBackend().plan`` (vLLM's own
``_align_hybrid_block_size``, ``unify_kv_cache_spec_page_size``, ``get_kv_cache_groups``,
``get_kv_cache_configs`` ...) and ``ReferenceBackend().plan`` (the pure-Python reference).
The vLLM backend is warmed up before timing: the first call imports vLLM and builds the
``ModelConfig`` from the generated config.json (seconds); the adapter then keeps the
``ModelConfig`` and the hybrid alignment per (config.json, runtime), so the timed calls are
what every later plan of that scenario costs in one process.

Measures only; there are no timed asserts. The "vllm" rows time the selected backend, so they
run only with ``--kvconform-backend=vllm`` (or a backend that drives a vLLM platform: one that
does not decline the ``platform`` family);
vLLM is imported by no other run. Run with
``pytest --pyargs pytest_kvconform.suites --benchmark-only --kvconform-backend=vllm -k vllm_vs``.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvconform.scenario import load_scenario

SCENARIOS = ("granite-4.0-h-tiny", "glm-5-fp8-ds-mla")
IMPLEMENTATIONS = ("vllm", "reference")

pytestmark = pytest.mark.kvconform_benchmark


@pytest.mark.parametrize(
    ("name", "implementation"),
    [
        pytest.param(name, impl, id=f"{name}-{impl}", marks=pytest.mark.benchmark(group=f"plan {name}"))
        for name in SCENARIOS
        for impl in IMPLEMENTATIONS
    ],
)
def test_vllm_vs_reference_plan(
    benchmark: Any, kv_backend: Any, kv_reference: Any, name: str, implementation: str
) -> None:
    if kv_backend.declines.reason("platform") is not None:  # the reference's own declaration too
        pytest.skip(f"times vLLM's planning: needs --kvconform-backend=vllm, not {kv_backend.name!r}")
    scenario = load_scenario(name)
    backend = kv_backend if implementation == "vllm" else kv_reference
    warm = backend.plan(scenario)  # vLLM: the import and the ModelConfig happen here, untimed
    benchmark.extra_info.update(
        scenario=scenario.name, implementation=implementation, block_size=warm.block_size
    )
    result = benchmark(backend.plan, scenario)
    assert result == warm  # a correctness check, not a timing one
