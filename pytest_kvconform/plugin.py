"""pytest hooks of pytest-kvconform: options, markers, fixtures, header and summary.

Loaded through the ``pytest11`` entry point in every pytest run where the package is
installed, so it imports only the standard library and pytest at import time; the
reference, the backends and hypothesis are imported when a session uses them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .session import ENV_BACKEND, KVConformSession, process_of, resolve, session_key

# The shipped suites compare through these helpers: rewrite their asserts, so that a failing
# golden shows syrupy's diff and a failing comparison its values.
pytest.register_assert_rewrite("pytest_kvconform.regressions", "pytest_kvconform.conformance")

if TYPE_CHECKING:
    from .scenario import Scenario

MARKERS = {
    "kvconform_rule": "kvconform_rule(name): the rule family a conformance test checks",
    "kvconform_scenario": "kvconform_scenario(*names): restrict kv_scenario to these scenarios",
    "kvconform_independent": "kvconform_independent: compares with numbers independent of the reference "
    "(an [expect] table, a golden, a published figure); the reference's self-check runs only these",
    "kvconform_metal": "kvconform_metal: needs the MLX paged-attention runtime (skips without mlx)",
    "kvconform_benchmark": "kvconform_benchmark: a kvconform benchmark; runs only with --benchmark-only",
}
#: fixtures whose use makes a test a kvconform test (besides the markers)
FIXTURES = frozenset({"kv_backend", "kv_reference", "kv_scenario", "metal_runtime"})


class _SessionHooks:
    """The hooks that feed :class:`~pytest_kvconform.session.KVConformSession` (registered as a
    plugin next to it)."""

    def __init__(self, session: KVConformSession) -> None:
        self.session = session

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.session.record(report)

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> Iterator[None]:
        """hypothesis's plugin caches the local constants in its storage dir while collecting:
        ours, when the run's only hypothesis tests are kvconform's."""
        hypothesis_items = [
            i for i in items if getattr(getattr(i, "function", None), "is_hypothesis_test", False)
        ]
        if hypothesis_items and all(i.get_closest_marker("kvconform_rule") for i in hypothesis_items):
            with _hypothesis_home(self.session):
                return (yield)
        return (yield)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvconform", "KV-cache sizing conformance (pytest-kvconform)")
    group.addoption(
        "--kvconform-backend",
        default=None,
        help="backend to check against the reference: reference (default), vllm, metal, an entry "
        f"point of group pytest_kvconform.backends, or package.module:ClassName (env: {ENV_BACKEND})",
    )
    group.addoption(
        "--kvconform-backend-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the backend's constructor, as a string (repeatable; "
        "ini: kvconform_backend_options, one per line)",
    )
    group.addoption(
        "--kvconform-max-examples",
        type=int,
        default=None,
        help="hypothesis max_examples for the differential property tests",
    )
    group.addoption(
        "--kvconform-scenarios",
        action="append",
        default=[],
        metavar="PATH",
        help="extra kv-scenario/1 TOML files, models' config.json files or directories, or folders of "
        "either, for the kv_scenario fixture (repeatable)",
    )
    group.addoption(
        "--kvconform-xfails",
        default=None,
        metavar="PATH",
        help="TOML file of known failures ([[xfail]] backend/rule/test/reason), run as strict xfails",
    )
    group.addoption(
        "--kvconform-strict",
        action="store_true",
        default=False,
        help="fail each test whose verdict is inherited (the reference's own code answered) for a rule "
        "family the backend does not declare in `inherits`",
    )
    group.addoption(
        "--kvconform-isolate",
        action="store_true",
        default=False,
        help="build the backend in a process of its own (automatic for a backend that declares "
        "registers_process_wide), so what its plugin registers process-wide stays there",
    )
    group.addoption(
        "--kvconform-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long a backend in its own process may take to start or to answer one call before "
        "the call fails and the process is stopped (default 600)",
    )
    group.addoption(
        "--kvconform-skip-unavailable",
        action="store_true",
        default=False,
        help="skip the backend's tests when its runtime is not installed (e.g. a macOS job without vLLM); "
        "without it, a selected backend that cannot be imported or built is a usage error",
    )
    group.addoption(
        "--kvconform-vllm",
        default=None,
        metavar="RELEASE",
        help="judge by the sizing rules of this vLLM release (0.23 ... 0.33; default: the installed "
        "vLLM's, else the newest; ini: kvconform_vllm)",
    )
    group.addoption(
        "--kvconform-report",
        default=None,
        metavar="PATH",
        help="write the rule x outcome matrix to PATH (.json or .md)",
    )
    parser.addini("kvconform_backend", "default kvconform backend (see --kvconform-backend)", default="")
    parser.addini("kvconform_vllm", "vLLM release whose rules judge (see --kvconform-vllm)", default="")
    parser.addini(
        "kvconform_backend_options", "KEY=VALUE options for the backend (see --kvconform-backend-option)",
        type="linelist", default=[],
    )  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS.values():
        config.addinivalue_line("markers", line)
    session = KVConformSession(config)
    config.stash[session_key] = session
    config.pluginmanager.register(_SessionHooks(session), "kvconform-session")
    if session.explicit:
        resolve(session)
    if session.release_option:
        session.release  # noqa: B018 - a bad release is a usage error before collection
    if session.extra_scenario_paths:
        session.scenarios()  # a malformed file is a usage error before collection
    if session.xfails_path and session.unavailable is None:
        from .conformance import load_xfails

        try:
            session.xfails = load_xfails(Path(session.xfails_path), session.backend.name)
        except ValueError as exc:
            raise pytest.UsageError(f"--kvconform-xfails: {exc}") from None
    if session.max_examples is not None and session.max_examples < 1:
        raise pytest.UsageError("--kvconform-max-examples must be >= 1")
    if session.timeout <= 0:
        raise pytest.UsageError("--kvconform-timeout must be > 0 seconds")


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(session_key, None)
    if session is not None:
        session.cleanup()


def _session(config: pytest.Config) -> KVConformSession:
    return config.stash[session_key]


def _is_kvconform_item(item: pytest.Item) -> bool:
    """A test of this plugin's: it carries a ``kvconform_*`` marker or uses a kvconform fixture."""
    if any(mark.name.startswith("kvconform_") for mark in item.iter_markers()):
        return True
    return not FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


DEFAULT_HEADER = (
    "kvconform: self-check of the expectations: the reference against [expect] tables, goldens and "
    "regression literals (backend=reference, the default; select one with --kvconform-backend or "
    f"${ENV_BACKEND})"
)


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    """Without kvconform options the header says nothing; the default backend is named once
    kvconform tests are collected."""
    if _session(config).configured or not any(_is_kvconform_item(item) for item in items):
        return []
    return [DEFAULT_HEADER]


def pytest_report_header(config: pytest.Config) -> list[str]:
    session = _session(config)
    if not session.configured:
        return []  # inert in runs that do not use the plugin
    if not session.explicit and not config.getoption("kvconform_scenarios"):
        return [DEFAULT_HEADER]
    if session.unavailable:
        return [
            f"kvconform: backend={session.backend_name} unavailable (its tests skip): {session.unavailable}"
        ]
    backend = session.backend
    release, release_origin = session.release
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("KVCONFORM_"))
    policy = getattr(backend, "unify_policy", None) or "per scenario"
    notes = backend.notes() if callable(getattr(backend, "notes", None)) else []
    if session.backend_options_raw:
        notes.insert(0, "options: " + " ".join(session.backend_options_raw))
    process = process_of(backend)
    if process["isolated"]:
        notes.insert(0, f"answers in its own process ({process['why']})")
    if session.self_check:
        notes.insert(0, "self-check of the expectations (differential tests deselected)")
    line = (
        f"kvconform: backend={backend.name} ({backend.version}), reference=vLLM {release.release} rules "
        f"({release_origin}), "
        f"unify policy={policy}, selected by {session.backend_origin}"
    )
    return [line + "".join(f", {part}" for part in [*notes, env] if part)]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def kv_backend(pytestconfig: pytest.Config) -> Any:
    """The backend under test (``--kvconform-backend``); skips when its runtime is not installed."""
    session = _session(pytestconfig)
    if session.unavailable:
        pytest.skip(session.unavailable)
    return session.backend


@pytest.fixture(scope="session")
def kv_reference(pytestconfig: pytest.Config) -> Any:
    """The reference backend, the oracle every backend is compared with (the rules of the
    ``--kvconform-vllm`` release)."""
    from .backends.base import ReferenceBackend

    return _session(pytestconfig).apply_release(ReferenceBackend())


@pytest.fixture
def kv_scenario(request: pytest.FixtureRequest) -> Scenario:
    """One scenario; tests using it are parametrized over the packaged scenarios (ids = names)."""
    return request.param


@pytest.fixture(scope="session")
def metal_runtime() -> Any:
    """The MLX paged-attention runtime (:mod:`pytest_kvconform.metal_runtime`); skips without mlx."""
    pytest.importorskip("mlx.core", reason="needs mlx: pip install 'pytest-kvconform[metal-cpu]'")
    from . import metal_runtime

    return metal_runtime


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kv_scenario" not in metafunc.fixturenames:
        return
    scenarios = _session(metafunc.config).scenarios()
    marker = metafunc.definition.get_closest_marker("kvconform_scenario")
    if marker is not None:
        wanted = set(marker.args)
        unknown = wanted - {_scenario_id(s) for s in scenarios}
        if unknown:
            raise pytest.UsageError(f"kvconform_scenario: unknown scenario(s) {sorted(unknown)}")
        scenarios = [s for s in scenarios if _scenario_id(s) in wanted]
    metafunc.parametrize("kv_scenario", scenarios, ids=[_scenario_id(s) for s in scenarios], indirect=True)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own choice of scheduler
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``-n N`` with xdist's default ``--dist load``: every test of one scenario in one
    worker (:mod:`.scheduling`); other ``--dist`` modes are xdist's."""
    if config.getvalue("dist") != "load" or not _session(config).configured:
        return None  # inert when no kvconform backend or option is configured
    from .scheduling import ScenarioScheduling

    ids = [_scenario_id(s) for s in _session(config).scenarios()]
    return ScenarioScheduling(config, log, scenario_ids=ids)


def _scenario_id(scenario: Scenario) -> str:
    from .checks import scenario_id

    return scenario_id(scenario)


# ----------------------------------------------------------------------------- markers


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if _is_kvconform_item(item)]
    if not ours:
        return
    from .conformance import RULE_FAMILIES

    session = _session(config)
    benchmark_only = bool(config.getoption("benchmark_only", default=False))
    if session.explicit:
        resolve(session)
    self_check = session.self_check
    deselected = []
    for item in ours:
        if item.get_closest_marker("kvconform_benchmark") is not None and not benchmark_only:
            item.add_marker(pytest.mark.skip(reason="kvconform benchmarks run only with --benchmark-only"))
        if session.unavailable:
            item.add_marker(pytest.mark.skip(reason=session.unavailable))
            continue
        rule = item.get_closest_marker("kvconform_rule")
        if rule is not None and (len(rule.args) != 1 or rule.args[0] not in RULE_FAMILIES):
            raise pytest.UsageError(
                f"{item.nodeid}: kvconform_rule expects one of {', '.join(RULE_FAMILIES)}; got {rule.args}"
            )
        if self_check and rule is not None and item.get_closest_marker("kvconform_independent") is None:
            deselected.append(item)  # the reference compared with itself: nothing independent
            continue
        if item.get_closest_marker("kvconform_metal") is not None:
            try:
                import mlx.core  # noqa: F401
            except ImportError:
                item.add_marker(
                    pytest.mark.skip(reason="needs mlx: pip install 'pytest-kvconform[metal-cpu]'")
                )
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        dropped = set(deselected)
        items[:] = [item for item in items if item not in dropped]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    if item.get_closest_marker("kvconform_rule") is None:
        return (yield)
    from .provenance import ledger

    session = _session(item.config)
    with ledger() as led, _hypothesis_settings(item, session):
        led.known = _known_for(item, session)
        item.stash[_ledger_key] = led
        return (yield)


def _rule_of(item: pytest.Item) -> str:
    marker = item.get_closest_marker("kvconform_rule")
    return str(marker.args[0]) if marker is not None and marker.args else ""


def _scenario_of(item: pytest.Item) -> Scenario | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("kv_scenario")  # type: ignore[no-any-return]


def _known_for(item: pytest.Item, session: KVConformSession) -> list[Any]:
    """The known departures about ``item`` (its rule and name; its scenario for ``when``); a
    property test gets every entry of its rule and name, matched per generated input."""
    from .requirements import known_departures_for

    rule, generated = _rule_of(item), getattr(getattr(item, "function", None), "is_hypothesis_test", False)
    entries = session.known_departures()
    if generated:
        return [e for e in entries if e.covers(rule, item.name, None) or (e.when is not None and
                e.rule == rule and e.test == "*")]  # fmt: skip
    return known_departures_for(entries, rule, item.name, _scenario_of(item))


@contextlib.contextmanager
def _hypothesis_settings(item: pytest.Item, session: KVConformSession) -> Iterator[None]:
    """For one kvconform property test: ``--kvconform-max-examples``, its inputs seeded by the test
    (``derandomize``, no example database: two runs or two hosts compare the same inputs) unless
    ``--hypothesis-seed`` asks for a seed, and hypothesis's files in
    :meth:`KVConformSession.hypothesis_dir` instead of ``./.hypothesis``.

    Only this test's settings change (hypothesis reads them from the test at call time), and
    only for the call: no profile is loaded, other hypothesis tests of the run are untouched. A
    database or storage directory the user configured (``HYPOTHESIS_STORAGE_DIRECTORY``) is kept.
    """
    test = getattr(item, "function", None)
    if not getattr(test, "is_hypothesis_test", False):
        yield
        return
    from hypothesis import settings
    from hypothesis.database import DirectoryBasedExampleDatabase

    original = test._hypothesis_internal_use_settings
    changes: dict[str, Any] = {}
    if session.max_examples is not None:
        changes["max_examples"] = session.max_examples
    if item.config.getoption("hypothesis_seed", default=None) is None:
        changes.update(derandomize=True, database=None)
    elif not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        default_db = Path.cwd() / ".hypothesis" / "examples"
        db = original.database
        if isinstance(db, DirectoryBasedExampleDatabase) and Path(db.path).resolve() == default_db.resolve():
            changes["database"] = DirectoryBasedExampleDatabase(session.hypothesis_dir() / "examples")
    test._hypothesis_internal_use_settings = settings(original, **changes)
    try:
        with _hypothesis_home(session):
            yield
    finally:
        test._hypothesis_internal_use_settings = original


@contextlib.contextmanager
def _hypothesis_home(session: KVConformSession) -> Iterator[None]:
    """hypothesis's storage dir (its caches: constants, charmap) in the session's dir for a while,
    unless the user chose one (``HYPOTHESIS_STORAGE_DIRECTORY``)."""
    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        yield
        return
    from hypothesis import configuration

    previous = getattr(configuration, "__hypothesis_home_directory", None)
    configuration.set_hypothesis_home_dir(session.hypothesis_dir())
    try:
        yield
    finally:
        configuration.set_hypothesis_home_dir(previous)


#: what the running kvconform test saw of the backend (its answers, its generated inputs)
_ledger_key = pytest.StashKey[Any]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A kvconform test's report carries its verdict (:func:`pytest_kvconform.verdict.decide`,
    the one place it is decided) and ends as the verdict says: agreed passes, departed and crashed
    fail, a known departure xfails, the others skip with their reason."""
    report = yield
    rule = _rule_of(item)
    session = _session(item.config)
    if not rule or session.unavailable is not None:
        return report
    if call.when == "setup" and report.failed:  # a fixture crashed: the backend could not be built
        _keep(report, item, _crashed_setup(report), None)
        return report
    if call.when != "call":
        return report
    from .provenance import Ledger
    from .verdict import decide

    led: Ledger = item.stash.get(_ledger_key, None) or Ledger()
    error = call.excinfo.value if call.excinfo is not None else None
    if report.skipped and error is None:  # skipped before the call (a marker)
        return report
    backend = session.backend
    generated = getattr(getattr(item, "function", None), "is_hypothesis_test", False)
    # a generated input departing where an entry's `when` says was matched on that input; the
    # input hypothesis reports failing matched none
    known = [k for k in led.known if k.when is None] if generated else led.known
    result = decide(
        rule=rule, error=error, answers=led.answers, backend=backend, known=known,
        strict=session.strict, test_files=[str(item.path)],
        generated=led.generated() if generated else None,
    )  # fmt: skip
    _apply(report, item, result, getattr(error, "__notes__", None))
    _keep(report, item, result, led)
    return report


def _crashed_setup(report: pytest.TestReport) -> Any:
    from .verdict import Result, Verdict

    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return Result(Verdict.CRASHED, f"setup: {text.splitlines()[0] if text else ''}")


def _apply(report: pytest.TestReport, item: pytest.Item, result: Any, notes: list[str] | None = None) -> None:
    """Make pytest's outcome the verdict's (``Result.outcome``); a failure shown without its
    traceback keeps hypothesis's notes (the counterexample scenario)."""
    outcome = result.outcome
    if outcome == "passed":
        report.outcome = "passed"
        report.longrepr = None
    elif outcome == "xfailed":
        report.outcome = "skipped"
        report.wasxfail = f"known departure: {result.known}"
    elif outcome == "skipped":
        report.outcome = "skipped"
        path, line, _ = item.reportinfo()
        report.longrepr = (str(path), (line or 0) + 1, f"Skipped: {result.verdict}: {result.message}")
    else:
        report.outcome = "failed"
        if result.strict_failure or report.longrepr is None or result.known:
            report.longrepr = "\n".join(
                filter(None, [result.strict_failure or result.message, _text(report)])
            )
        elif (
            notes
            and isinstance(report.longrepr, str | tuple) is False
            and "\n".join(notes) not in _text(report)
        ):
            report.longrepr = "\n".join([_text(report), *notes])


def _text(report: pytest.TestReport) -> str:
    return "" if report.longrepr is None else str(report.longrepr)


def _keep(report: pytest.TestReport, item: pytest.Item, result: Any, led: Any) -> None:
    """The test's record, JSON-serialisable (user properties cross xdist)."""
    from .checks import record
    from .provenance import Ledger

    led = led or Ledger()
    scenario = _scenario_of(item)
    entry = record(item.nodeid, _rule_of(item), _scenario_id(scenario) if scenario is not None else "",
                   result, led)  # fmt: skip
    entry["processes"] = sorted(led.processes)
    if entry["rule"] == "plan" and led.answers:
        entry["steps"] = led.by_method()
    if led.exercised:
        entry["exercised"] = dict(led.exercised)
    report.user_properties.append(("kvconform_record", entry))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    session = _session(config)
    if not session.records or hasattr(config, "workerinput"):
        return
    from .report import (
        answers_of,
        declined_steps_of,
        exercised_of,
        format_answers,
        format_exercised,
        format_matrix,
        format_steps,
        matrix_of,
        steps_of,
        write_report,
    )

    title = "self-check of the expectations" if session.self_check else "vs reference"
    terminalreporter.section(f"kvconform: backend {session.backend.name} {title}")
    records = session.records
    for line in format_matrix(matrix_of(records)):
        terminalreporter.write_line(line)
    answers = format_answers(answers_of(records))
    if answers:
        terminalreporter.write_line("the backend's answers, by whose code gave them:")
        for line in answers:
            terminalreporter.write_line("  " + line)
    declared = getattr(session.backend, "inherits", {})
    inherited = sorted({r["rule"] for r in records if r["verdict"] == "inherited"})
    for rule in inherited:
        count = sum(r["verdict"] == "inherited" and r["rule"] == rule for r in records)
        why = (
            f"declared: {declared[rule]}" if rule in declared else "not declared in the backend's `inherits`"
        )
        terminalreporter.write_line(
            f"inherited {rule}: {count} tests answered by the reference's code ({why})"
        )
    exercised = exercised_of(records)
    if exercised:
        terminalreporter.write_line("generated inputs compared, per rule they reach:")
        for line in format_exercised(exercised):
            terminalreporter.write_line("  " + line)
    steps = steps_of(records)
    if steps:
        terminalreporter.write_line("plan steps, by whose code answered them (answers over all plan tests):")
        for line in format_steps(steps):
            terminalreporter.write_line("  " + line)
    declined = declined_steps_of(records)
    if declined:
        terminalreporter.write_line("plan steps the reference answered because the backend declined them:")
        for step, count in sorted(declined.items()):
            terminalreporter.write_line(f"  {count:>4} plans  {step}")
    path = config.getoption("kvconform_report")
    if path:
        write_report(Path(path), session.report_document())
        terminalreporter.write_line(f"kvconform: report written to {path}")
