"""A plugin that changes its process when it starts runs in a process of its own.

The toy plugin's ``toy-wide-heads`` backend (tests/toy_plugin/kvtoy/wide.py) pads the head_dim of
every toy runner in its process to a multiple of 256 when it starts (``kvtoy.device``), as
tpu-inference replaces vLLM's layers for the whole process. Built in the test process, it changes
what the ``toy`` backend answers; built in its own process (it declares
``registers_process_wide``), it does not, and both are checked in one session.

Qwen2.5-3B at TP 4 (the packaged scenario): 2 KV heads, so 1 per rank (replicated), head_dim 128,
bf16, block 16. A full attention page is 2 (K, V) * 16 * 1 head * head_dim * 2 B: 8,192 B at
head_dim 128, 16,384 B at the wide device's 256.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_kvconform import provenance
from pytest_kvconform.backends.base import ReferenceBackend
from pytest_kvconform.backends.isolated import IsolatedBackend, RemoteObject
from pytest_kvconform.backends.registry import BackendError, build_backend, resolve_backend
from pytest_kvconform.conformance import ask, declined_reason
from pytest_kvconform.rejections import rejection_kind
from pytest_kvconform.scenario import load_scenario
from pytest_kvconform.verdict import Declined

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "tests" / "toy_plugin"
QWEN = "qwen2.5-3b-instruct-tp4"
WIDE_WHY = "sets kvtoy.device.HEAD_DIM_ALIGN = 256 for every toy runner in its process"


@pytest.fixture
def toy_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The toy distribution importable here and in spawned processes; its process-wide setting
    put back afterwards."""
    monkeypatch.syspath_prepend(str(TOY))
    from kvtoy import device

    monkeypatch.setattr(device, "HEAD_DIM_ALIGN", device.HEAD_DIM_ALIGN)
    yield


@pytest.fixture
def wide(toy_path: None) -> Iterator[IsolatedBackend]:
    backend = resolve_backend("toy-wide-heads")
    yield backend
    backend.close()


def _page(backend: object) -> int:
    specs = backend.layer_specs(scenario=load_scenario(QWEN))  # type: ignore[attr-defined]
    (page,) = {spec.page_size_bytes for spec in specs.values()}
    return page


def test_a_backend_that_registers_process_wide_is_built_in_its_own_process(wide: IsolatedBackend) -> None:
    assert isinstance(wide, IsolatedBackend)
    assert wide.process["pid"] != os.getpid() and wide.process["isolated"]
    assert "HEAD_DIM_ALIGN" in wide.process["why"]
    assert wide.name == "toy-wide-heads" and wide.notes() == ["toy device: cpu"]
    assert _page(wide) == 16_384  # its own process has its setting
    from kvtoy import device

    assert device.HEAD_DIM_ALIGN == 1  # ... this one does not
    assert _page(resolve_backend("toy")) == 8_192 == _page(ReferenceBackend())


def test_built_here_it_would_change_what_another_plugin_answers(toy_path: None) -> None:
    """The control: the same plugin built in the test process pads the other plugin's heads."""
    toy = build_backend("toy")
    assert _page(toy) == 8_192
    build_backend("toy-wide-heads")
    assert _page(toy) == 16_384


def test_who_answered_is_decided_in_the_backends_process(wide: IsolatedBackend) -> None:
    scenario = load_scenario(QWEN)
    own = provenance.ask(wide, "layer_specs", scenario=scenario)
    assert (own.by, own.pid) == (provenance.BACKEND, wide.process["pid"])
    # ToyBackend.kernel_block_size hands back super()'s answer; attention_page_bytes is not redefined
    assert provenance.ask(wide, "kernel_block_size", 16, scenario=scenario).by == provenance.INHERITED
    assert provenance.ask(wide, "attention_page_bytes", scenario=scenario).by == provenance.INHERITED
    assert provenance.composes_plan(wide)
    # a refusal raised there is kept with the process that raised it: a rejection of its kind
    plan = ReferenceBackend().plan(scenario)
    allocation = wide.allocate_kv_cache(plan, 3, scenario=scenario)
    rejected = provenance.ask(wide, "check_kv_cache_config", allocation, 4, scenario=scenario)
    assert rejection_kind(rejected.error) == "oversized_config" and rejected.pid == wide.process["pid"]
    # what it declines is its declaration, read from its process once: no call crosses for it
    mla = load_scenario("deepseek-v3-fp8")
    assert "MLA models never take the toy paged kernel" in (
        declined_reason(wide, "kernel_block", mla, "kernel_block_size") or "")  # fmt: skip
    assert declined_reason(wide, "kernel_block", scenario, "kernel_block_size") is None
    wide.close()  # its process stopped: the declaration still decides
    with provenance.ledger() as ledger, pytest.raises(Declined, match="MLA models never take"):
        ask(wide, "kernel_block_size", 16, scenario=mla)
    assert [a[:3] for a in ledger.answers] == [("kernel_block", "kernel_block_size", provenance.REFERENCE)]


def test_what_cannot_be_pickled_stays_in_the_backends_process(wide: IsolatedBackend) -> None:
    """The wide device's pool (a lock inside, as a JAX array or a worker) stays there: read and
    called through, and sent back as an argument it is that very object again."""
    scenario = load_scenario(QWEN)
    plan = ReferenceBackend().plan(scenario)
    allocation = wide.allocate_kv_cache(plan, 3, scenario=scenario)
    assert isinstance(allocation.handle, RemoteObject)
    assert allocation.handle.nbytes == 3 * plan.bytes_per_block == allocation.bytes_held
    assert allocation.handle.blocks(plan.bytes_per_block) == 3
    wide.check_kv_cache_config(allocation, 3, scenario=scenario)  # a DeviceBuffer there again
    with pytest.raises(ValueError, match="requests 4 blocks but the Metal paged pool was allocated with 3"):
        wide.check_kv_cache_config(allocation, 4, scenario=scenario)


def test_a_backend_that_cannot_start_there_is_a_one_line_error(toy_path: None) -> None:
    no_option = r"^backend 'toy-wide-heads' takes no option colour; its options: device_name$"
    with pytest.raises(BackendError, match=no_option):
        resolve_backend("toy-wide-heads", {"colour": "red"})
    with pytest.raises(BackendError, match=r"^unknown kvconform backend 'no-such'"):
        resolve_backend("no-such", isolate=True)


def test_one_session_checks_two_plugins_each_in_its_process(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", f"{TOY}:{ROOT}")
    pytester.makepyfile(
        test_two="""
        import os
        import pytest
        from pytest_kvconform.backends.registry import resolve_backend
        from pytest_kvconform.conformance import check_scenario

        @pytest.fixture(scope="module", params=["toy-wide-heads", "toy"])
        def plugin(request):
            backend = resolve_backend(request.param, isolate=True)
            yield backend
            backend.close()

        def test_plan(plugin):
            assert plugin.process["pid"] != os.getpid()
            fields = {d.field for d in check_scenario("qwen2.5-3b-instruct-tp4", plugin)}
            if plugin.name == "toy":  # not padded by the other plugin, checked first
                assert not fields
            else:
                assert "bytes_per_block" in fields
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_the_report_says_which_process_answered(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", f"{TOY}:{ROOT}")
    """The backend's own allocate_kv_cache answers (agreed) in its process: the report's
    ``isolation`` section says why it was isolated and which process answered each test; the
    results themselves carry no process ids."""
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pyargs", "pytest_kvconform.suites.test_kvconform_allocation",
        "-k", "test_pool_holds_exactly_the_planned_blocks and qwen2 and tp4",
        "--kvconform-backend=toy-wide-heads", "--kvconform-report=r.json",
    )  # fmt: skip
    result.assert_outcomes(passed=1)
    header = next(line for line in result.outlines if line.startswith("kvconform: backend=toy-wide-heads"))
    assert "answers in its own process (sets kvtoy.device.HEAD_DIM_ALIGN" in header
    document = json.loads((pytester.path / "r.json").read_text())
    (record,) = document["results"]
    assert (record["verdict"], record["answers"]["own"]) == ("agreed", 1)
    assert "processes" not in record and "process" not in document
    assert document["isolation"]["why"] == WIDE_WHY
    assert list(document["isolation"]["processes"]) == [record["test"]]
    (answered,) = document["isolation"]["processes"][record["test"]]
    assert answered > 0 and answered != os.getpid()
