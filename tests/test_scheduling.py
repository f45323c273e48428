"""xdist scheduling by scenario (pytest_kvconform/scheduling.py): the tests of one scenario share a
worker, so a backend's per-scenario work (the vllm backend's engine build) happens once per run."""

from __future__ import annotations

import collections

import pytest

from pytest_kvconform.scheduling import scenario_scope

IDS = ("granite-4.0-h-tiny", "granite-4.0-h-tiny-tp4", "deepseek-v3-mtp1", "deepseek-v3-mtp1-with-draft")


@pytest.mark.parametrize(("nodeid", "scenario"), [
    ("s/test_rules.py::test_plan[granite-4.0-h-tiny]", "granite-4.0-h-tiny"),
    ("s/test_platform.py::test_hook[granite-4.0-h-tiny-update_block_size_for_backend]", "granite-4.0-h-tiny"),
    ("s/test_rules.py::test_estimate[granite-4.0-h-tiny-tp4-0.5]", "granite-4.0-h-tiny-tp4"),
    ("s/test_rules.py::test_plan[deepseek-v3-mtp1-with-draft]", "deepseek-v3-mtp1-with-draft"),
    ("s/test_rules.py::test_plan[deepseek-v3-mtp1]", "deepseek-v3-mtp1"),
    ("s/test_rules.py::test_kernel_block_size[8]", None),
    ("s/test_reported.py::test_plan_golden[granite-4.0-h-tinyish]", None),
    ("s/test_properties.py::test_plan_generated", None),
])  # fmt: skip
def test_scenario_scope(nodeid: str, scenario: str | None) -> None:
    """A scenario's tests share its scope (the longest id that starts the parameters); any other
    test is a scope of its own."""
    assert scenario_scope(nodeid, IDS) == (f"kvconform-scenario:{scenario}" if scenario else nodeid)


def test_each_scenarios_tests_run_in_one_worker(pytester: pytest.Pytester) -> None:
    """Three tests per packaged scenario under ``-n 2`` with a backend selected: every scenario's
    tests report one worker, and both workers ran (xdist's own ``--dist load`` splits most
    scenarios across them). Without a kvconform backend or option the scheduler is xdist's."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.parametrize("step", [1, 2, 3])
        def test_step(kv_scenario, worker_id, step, record_property):
            record_property("where", f"{kv_scenario.name}|{worker_id}")
        """
    )
    log = pytester.path / "log.xml"
    result = pytester.runpytest_subprocess(
        "-n", "2", "-p", "no:cacheprovider", f"--junitxml={log}", "--kvconform-backend=reference"
    )  # fmt: skip
    assert result.ret == 0
    workers = collections.defaultdict(set)
    for line in log.read_text().split('name="where" value="')[1:]:
        scenario, worker = line.split('"', 1)[0].split("|")
        workers[scenario].add(worker)
    assert len(workers) > 20
    assert {s: w for s, w in workers.items() if len(w) > 1} == {}
    assert set().union(*workers.values()) == {"gw0", "gw1"}
