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
    "kvconform_requires": "kvconform_requires(capability): skip unless the backend has this capability",
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
        self.session.record(report, outcome_message(report))

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
        help="extra kv-scenario/1 TOML files or folders for the kv_scenario fixture (repeatable)",
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
        help="fail the run when a rule family is inherited (answered by the reference's own code) "
        "and the backend does not declare it in `inherits`",
    )
    group.addoption(
        "--kvconform-isolate",
        action="store_true",
        default=False,
        help="build the backend in a process of its own (automatic for a backend that declares "
        "registers_process_wide), so what its plugin registers process-wide stays there",
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


DEFAULT_HEADER = f"kvconform: backend=reference (default; select with --kvconform-backend or ${ENV_BACKEND})"


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
    if config.getvalue("dist") != "load":
        return None
    from .scheduling import ScenarioScheduling

    ids = [_scenario_id(s) for s in _session(config).scenarios()]
    return ScenarioScheduling(config, log, scenario_ids=ids)


def _scenario_id(scenario: Scenario) -> str:
    return Path(scenario.source).stem if scenario.source.endswith(".toml") else scenario.name


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
        cap = item.get_closest_marker("kvconform_requires")
        if cap is not None:
            if len(cap.args) != 1 or not isinstance(cap.args[0], str):
                raise pytest.UsageError(f"{item.nodeid}: kvconform_requires expects one capability name")
            if cap.args[0] not in session.backend.capabilities:
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"backend {session.backend_name!r} lacks capability {cap.args[0]!r}"
                    )
                )
        if item.get_closest_marker("kvconform_metal") is not None:
            try:
                import mlx.core  # noqa: F401
            except ImportError:
                item.add_marker(
                    pytest.mark.skip(reason="needs mlx: pip install 'pytest-kvconform[metal-cpu]'")
                )
        if rule is not None:
            from .conformance import known_failure

            reason = known_failure(session.backend, item, session.xfails)
            if reason:
                item.add_marker(pytest.mark.xfail(reason=reason, strict=True))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    if item.get_closest_marker("kvconform_rule") is None:
        return (yield)
    from .provenance import ledger

    with ledger() as led, _hypothesis_settings(item, _session(item.config)):
        item.stash[_ledger_key] = led
        return (yield)


@contextlib.contextmanager
def _hypothesis_settings(item: pytest.Item, session: KVConformSession) -> Iterator[None]:
    """For one kvconform property test: ``--kvconform-max-examples``, and hypothesis's files in
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
    if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
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
    report = yield
    rule = item.get_closest_marker("kvconform_rule")
    session = _session(item.config)
    if rule is not None and rule.args and session.unavailable is None:
        report.user_properties.append(("kvconform_rule", rule.args[0]))
        led = item.stash.get(_ledger_key, None)
        if call.when == "call" and led is not None:
            # JSON-serialisable, as everything here: user properties cross xdist
            report.user_properties.append(("kvconform_answers", led.counts()))
            report.user_properties.append(("kvconform_processes", sorted(led.processes)))
            if rule.args[0] == "plan" and led.answers:
                report.user_properties.append(("kvconform_steps", led.by_method()))
            if led.outcome_of_pass(rule.args[0]) == "inherited":
                report.user_properties.append(("kvconform_inherited", True))
            if led.declined_steps():
                report.user_properties.append(("kvconform_reference_steps", led.declined_steps()))
            discarded = sum(led.discarded.values())
            if led.compared or discarded:
                report.user_properties.extend([
                    ("kvconform_generated", led.compared), ("kvconform_discarded", discarded),
                    ("kvconform_exercised", dict(led.exercised)),
                ])  # fmt: skip
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "kv_scenario" in params:
            report.user_properties.append(("kvconform_scenario", _scenario_id(params["kv_scenario"])))
        if call.excinfo is not None:
            from .conformance import Departure

            if isinstance(call.excinfo.value, Departure):  # JSON-serialisable: it crosses xdist
                report.user_properties.append(("kvconform_difference", call.excinfo.value.to_dict()))
    return report


def outcome_message(report: pytest.TestReport) -> str:
    """One line saying why: the failure's message, the skip or xfail reason ("" when passed)."""
    if hasattr(report, "wasxfail"):
        return str(report.wasxfail)
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(report.longrepr)
        return text.splitlines()[0] if text else ""
    return ""


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    kv = _session(session.config)
    if kv.strict and not hasattr(session.config, "workerinput") and kv.matrix:
        undeclared = kv.undeclared_inherited()
        if undeclared and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            kv.strict_failure = f"--kvconform-strict: inherited and not declared: {', '.join(undeclared)}"


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    session = _session(config)
    if not session.matrix or hasattr(config, "workerinput"):
        return
    from .report import answers_of, format_answers, format_matrix, write_report

    terminalreporter.section(f"kvconform: backend {session.backend.name} vs reference")
    for line in format_matrix(session.matrix):
        terminalreporter.write_line(line)
    answers = format_answers(answers_of(session.records))
    if answers:
        terminalreporter.write_line("the backend's answers, by whose code gave them:")
        for line in answers:
            terminalreporter.write_line("  " + line)
    declared = getattr(session.backend, "inherits", {})
    for rule in [r for r, counts in session.matrix.items() if counts["inherited"]]:
        why = (
            f"declared: {declared[rule]}" if rule in declared else "not declared in the backend's `inherits`"
        )
        terminalreporter.write_line(
            f"inherited {rule}: every answer in {session.matrix[rule]['inherited']} passing tests came from "
            f"the reference's code ({why})"
        )
    if session.exercised:
        from .report import format_exercised

        terminalreporter.write_line("generated inputs compared, per rule they reach:")
        for line in format_exercised(session.exercised):
            terminalreporter.write_line("  " + line)
    if session.plan_steps:
        from .report import format_steps

        terminalreporter.write_line("plan steps, by whose code answered them (answers over all plan tests):")
        for line in format_steps(session.plan_steps):
            terminalreporter.write_line("  " + line)
    if session.reference_steps:
        terminalreporter.write_line("plan steps the reference answered because the backend declined them:")
        for step, count in sorted(session.reference_steps.items()):
            terminalreporter.write_line(f"  {count:>4} plans  {step}")
    if session.strict_failure:
        terminalreporter.write_line(session.strict_failure, red=True)
    path = config.getoption("kvconform_report")
    if path:
        write_report(Path(path), session.report_document())
        terminalreporter.write_line(f"kvconform: report written to {path}")
