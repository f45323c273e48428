"""The probes of "green means right": each wrong or absent backend below used to come out green.

One verdict per test (pytest_kvconform/verdict.py): a backend that answers only the budget has no
plan of its own, an empty subclass in the property suite is inherited, an isolated backend that
hangs fails its tests within --kvconform-timeout, two runs on the same inputs write the same
report, and the plugin changes nothing in a run that does not use it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SUITES = Path(__file__).resolve().parents[1] / "pytest_kvconform" / "suites"
RULES_SUITE = str(SUITES / "test_kvconform_rules.py")
PROPS_SUITE = str(SUITES / "test_kvconform_properties.py")

BACKENDS = '''
import time

from pytest_kvconform.backends.base import ReferenceBackend
from pytest_kvconform.requirements import Declines


class OnlyTheBudget(ReferenceBackend):
    """Declines the layer specs, the block choice, the alignment, the groups and the pool; answers
    only the memory probe (the budget)."""
    name = "only-the-budget"
    declines = ReferenceBackend.declines | Declines({
        "layer_specs": "no spec code", "block_size": "no block choice", "hybrid_alignment": "no alignment",
        "grouping": "no grouper", "memory.check_memory": "no pool check",
    })


class Empty(ReferenceBackend):
    name = "empty"


class Wrong(ReferenceBackend):
    name = "wrong"

    def align_hybrid_block_size(self, scenario):
        return super().align_hybrid_block_size(scenario.with_runtime(kernel_block_alignment=32))


class Hangs(ReferenceBackend):
    """Its process blocks on a device probe that never answers."""
    name = "hangs"
    registers_process_wide = "a device runtime"

    def kv_cache_dtype_bytes(self, kv_cache_dtype, model_dtype, scenario=None):
        time.sleep(60)
'''


@pytest.fixture
def backends(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(probes=BACKENDS)
    pytester.syspathinsert()
    return pytester


def _report(
    pytester: pytest.Pytester, *args: str, name: str = "report.json"
) -> tuple[pytest.RunResult, dict]:
    path = pytester.path / name
    result = pytester.runpytest_subprocess(*args, f"--kvconform-report={path}", "-p", "no:cacheprovider")
    return result, json.loads(path.read_text())


def test_a_backend_answering_only_the_budget_has_no_plan_of_its_own(backends: pytest.Pytester) -> None:
    """Its plans used to pass ("one own step is enough"): now each is declined, naming the steps."""
    _, doc = _report(
        backends,
        RULES_SUITE,
        "--kvconform-backend=probes:OnlyTheBudget",
        "-k",
        "test_plan and granite-4.0-h-tiny and not tp4 and not hma-disabled and not mamba-all",
    )
    assert [r["verdict"] for r in doc["results"]] == ["declined"]
    assert (
        "layer_specs.layer_specs (does not provide layer_specs: no spec code)" in doc["results"][0]["message"]
    )
    assert doc["totals"]["agreed"] == 0
    cli = backends.run(
        sys.executable,
        "-m",
        "pytest_kvconform.cli",
        "check",
        "granite-4.0-h-tiny",
        "--backend",
        "probes:OnlyTheBudget",
        "--json",
    )
    assert cli.ret == 0
    check = json.loads(cli.stdout.str())
    assert {r["verdict"] for r in check["results"] if r["rule"] == "plan"} == {"declined"}
    assert check["totals"]["agreed"] == 0


def test_an_empty_subclass_is_inherited_in_the_property_suite(backends: pytest.Pytester) -> None:
    """The property suite calls the backend directly; nothing recorded who answered, and an empty
    record counted as a pass: six families "passed" for a backend that overrides nothing."""
    result, doc = _report(
        backends, PROPS_SUITE, "--kvconform-backend=probes:Empty", "--kvconform-max-examples=5"
    )
    assert result.ret == pytest.ExitCode.OK
    verdicts = {r["test"].rpartition("::")[2]: r["verdict"] for r in doc["results"]}
    assert verdicts and set(verdicts.values()) == {"inherited"}, verdicts
    assert doc["totals"]["agreed"] == 0


def test_the_same_inputs_give_a_byte_identical_report(backends: pytest.Pytester) -> None:
    """No process id, no time, no run-dependent order; generated inputs seeded per test."""
    args = (
        RULES_SUITE,
        PROPS_SUITE,
        "--kvconform-backend=probes:Wrong",
        "--kvconform-max-examples=5",
        "-k",
        "granite or generated",
        "-p",
        "no:cacheprovider",
    )
    reports = []
    for name, workers in (("one.json", "0"), ("two.json", "2")):
        path = backends.path / name
        backends.runpytest_subprocess(*args, "-n", workers, f"--kvconform-report={path}")
        reports.append(path.read_bytes())
    assert reports[0] == reports[1]
    assert b'"pid"' not in reports[0] and json.loads(reports[0])["totals"]["departed"] > 0


def test_an_isolated_backend_that_hangs_fails_within_the_timeout(backends: pytest.Pytester) -> None:
    """A call that does not answer within --kvconform-timeout fails its test and stops the
    process; the tests after it fail at once with the reason; the session ends."""
    result, doc = _report(backends, RULES_SUITE, "--kvconform-backend=probes:Hangs", "--kvconform-timeout=3",
                          "-k", "test_kv_cache_dtype_bytes and (auto-float16 or fp8-float16)")  # fmt: skip
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert [r["verdict"] for r in doc["results"]] == ["crashed", "crashed"]
    assert result.duration < 30
    result.stdout.fnmatch_lines(["*its process stopped answering (ask 'kv_cache_dtype_bytes' took over 3 s, "
                                 "--kvconform-timeout) and was stopped*"])  # fmt: skip


def test_the_plugin_is_inert_in_a_run_that_does_not_use_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No kvconform option and no kvconform test: the environment, the garbage collector and the
    xdist scheduler are the user's."""
    for name in ("HF_HUB_OFFLINE", "KVCONFORM_BACKEND", "VLLM_TARGET_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    pytester.makepyfile(
        """
        import gc, os

        def test_untouched(request):
            assert "HF_HUB_OFFLINE" not in os.environ and "VLLM_PLUGINS" not in os.environ
            assert gc.get_freeze_count() == 0
            assert request.config.getoption("dist", "no") == "no"
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "kvconform" not in result.stdout.str().split("= test session starts =")[1].split("\n", 3)[2]


def test_a_vllm_newer_than_the_newest_rules_is_named_in_the_header(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM release the reference has no rule set for is judged by the newest one, and the
    header says so instead of judging it silently."""
    from pytest_kvconform.backends.vllm import runtime
    from pytest_kvconform.reference.releases import LATEST
    from pytest_kvconform.session import selected_release

    major, minor = LATEST.release.split(".")
    newer = f"{major}.{int(minor) + 1}.0"
    monkeypatch.setattr(runtime, "is_vllm_installed", lambda: True)
    monkeypatch.setattr(runtime, "installed_vllm_version", lambda: newer)
    rules, why = selected_release("")
    assert rules.release == LATEST.release
    assert why == (
        f"installed vLLM {newer}; WARNING: newer than the newest rule set ({LATEST.release}), judged by "
        f"{LATEST.release}'s rules: changes after {LATEST.release} are not known to the reference"
    )
