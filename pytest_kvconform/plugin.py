"""pytest hooks of pytest-kvconform: options, markers, fixtures, header and summary.

Loaded through the ``pytest11`` entry point in every pytest run where the package is
installed, so it imports only the standard library and pytest at import time; the
reference, the backends and hypothesis are imported when a session uses them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# The shipped suites compare through these helpers: rewrite their asserts, so that a failing
# golden shows syrupy's diff and a failing comparison its values.
pytest.register_assert_rewrite("pytest_kvconform.regressions", "pytest_kvconform.conformance")

if TYPE_CHECKING:
    from .scenario import Scenario

ENV_BACKEND = "KVCONFORM_BACKEND"
MARKERS = {
    "kvconform_rule": "kvconform_rule(name): the rule family a conformance test checks",
    "kvconform_scenario": "kvconform_scenario(*names): restrict kv_scenario to these scenarios",
    "kvconform_requires": "kvconform_requires(capability): skip unless the backend has this capability",
    "kvconform_metal": "kvconform_metal: needs the MLX paged-attention runtime (skips without mlx)",
    "kvconform_benchmark": "kvconform_benchmark: a kvconform benchmark; runs only with --benchmark-only",
}
#: fixtures whose use makes a test a kvconform test (besides the markers)
FIXTURES = frozenset({"kv_backend", "kv_reference", "kv_scenario", "metal_runtime"})


class KVConformSession:
    """Per-session state, kept in ``config.stash`` under :data:`session_key` and registered as a
    plugin for the report hooks."""

    def __init__(self, config: pytest.Config) -> None:
        self.backend_name, self.backend_origin = _selected_backend(config)
        self.backend_options_raw: list[str] = [
            *config.getini("kvconform_backend_options"),
            *config.getoption("kvconform_backend_option"),
        ]
        self._backend: Any = None
        #: why the selected backend cannot run here (its runtime is not installed): its tests skip
        self.unavailable: str | None = None
        self._release: tuple[Any, str] | None = None
        self.release_option = config.getoption("kvconform_vllm") or config.getini("kvconform_vllm")
        self._inherited: dict[str, bool] = {}
        self._scenarios: list[Scenario] | None = None
        self.matrix: dict[str, Counter[str]] = defaultdict(Counter)
        #: rule family -> rule reached -> generated inputs compared that reached it
        self.exercised: dict[str, Counter[str]] = defaultdict(Counter)
        #: one record per conformance test: test (nodeid), rule, scenario, outcome, message and the
        #: first difference of a departure (field, reference, backend; else None)
        self.records: list[dict[str, Any]] = []
        self.strict = bool(config.getoption("kvconform_strict"))
        self.strict_failure = ""
        #: "family.method: reference (why)" -> plans in which the reference answered that step
        self.reference_steps: Counter[str] = Counter()
        self.xfails_path = config.getoption("kvconform_xfails")
        self.xfails: dict[str, str] = {}
        self.extra_scenario_paths = [Path(p) for p in config.getoption("kvconform_scenarios") or []]
        self.max_examples: int | None = config.getoption("kvconform_max_examples")
        #: whether any kvconform option, ini value or environment variable is set
        self.configured = self.explicit or any(
            config.getoption(name)
            for name in ("kvconform_scenarios", "kvconform_max_examples", "kvconform_xfails",
                         "kvconform_strict", "kvconform_vllm", "kvconform_report")
        ) or bool(config.getini("kvconform_vllm"))  # fmt: skip
        self._config = config
        self._hypothesis_dir: Path | None = None
        self._hypothesis_tmp = False

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Count outcomes per rule family (under xdist, from the workers' replayed reports)."""
        properties = dict(report.user_properties)
        if report.when == "call":
            for step in properties.get("kvconform_reference_steps", ()):
                self.reference_steps[str(step)] += 1
        rule = properties.get("kvconform_rule")
        if rule is None:
            return
        if report.when == "call" or (report.when == "setup" and not report.passed):
            if hasattr(report, "wasxfail"):
                outcome = "xfailed" if report.skipped else "failed"  # an XPASS(strict) fails
            else:
                outcome = report.outcome
            if outcome == "passed" and properties.get("kvconform_inherited"):
                outcome = "inherited"  # the backend answered with the reference's own code
            self.matrix[str(rule)][outcome] += 1
            self.matrix[str(rule)]["generated"] += int(properties.get("kvconform_generated", 0))
            self.matrix[str(rule)]["discarded"] += int(properties.get("kvconform_discarded", 0))
            if properties.get("kvconform_exercised"):
                self.exercised[str(rule)].update(properties["kvconform_exercised"])
            scenario = str(properties.get("kvconform_scenario", ""))
            self.records.append({
                "test": report.nodeid, "rule": str(rule), "scenario": scenario, "outcome": outcome,
                "message": _outcome_message(report), "difference": properties.get("kvconform_difference"),
            })  # fmt: skip

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> Iterator[None]:
        """hypothesis's plugin caches the local constants in its storage dir while collecting:
        ours, when the run's only hypothesis tests are kvconform's."""
        hypothesis_items = [
            i for i in items if getattr(getattr(i, "function", None), "is_hypothesis_test", False)
        ]
        if hypothesis_items and all(i.get_closest_marker("kvconform_rule") for i in hypothesis_items):
            with _hypothesis_home(self):
                return (yield)
        return (yield)

    def inherited(self, rule: str) -> bool:
        """Whether the backend answers ``rule`` with the reference's own code (it overrides none of
        the family's methods; for ``plan``, none at all)."""
        if rule not in self._inherited:
            from .conformance import inherits_rule

            self._inherited[rule] = inherits_rule(self.backend, rule)
        return self._inherited[rule]

    def report_document(self) -> dict[str, Any]:
        """The ``--kvconform-report`` document (:func:`pytest_kvconform.report.report_document`)."""
        from .backends.registry import parse_options
        from .report import report_document

        release, selected_by = self.release
        return report_document(
            self.backend, self.matrix, self.exercised, self.records,
            options=parse_options(self.backend_options_raw),
            reference={"vllm_release": release.release, "selected_by": selected_by},
        )  # fmt: skip

    def undeclared_inherited(self) -> list[str]:
        """Families reported inherited that the backend does not declare in ``inherits``."""
        declared = getattr(self.backend, "inherits", {})
        return [rule for rule, counts in self.matrix.items() if counts["inherited"] and rule not in declared]

    @property
    def explicit(self) -> bool:
        return self.backend_origin != "default" or bool(self.backend_options_raw)

    @property
    def backend(self) -> Any:
        if self._backend is None:
            from .backends.registry import BackendError, parse_options, resolve_backend

            try:
                self._backend = resolve_backend(self.backend_name, parse_options(self.backend_options_raw))
            except BackendError as exc:
                self.unavailable = _not_installed(exc)
                if self.unavailable is None:
                    raise pytest.UsageError(f"--kvconform-backend: {exc}") from None
                raise
            self.apply_release(self._backend)
        return self._backend

    @property
    def release(self) -> tuple[Any, str]:
        """The vLLM release whose rules the reference applies, and why (:func:`_selected_release`)."""
        if self._release is None:
            try:
                self._release = _selected_release(self.release_option)
            except ValueError as exc:
                raise pytest.UsageError(f"--kvconform-vllm: {exc}") from None
        return self._release

    def apply_release(self, rules: Any) -> Any:
        """Give ``rules`` (the reference, or a backend built on it) the selected release's rules."""
        from .reference.rules import ReferenceRules

        if isinstance(rules, ReferenceRules):
            rules.release = self.release[0]
        return rules

    def hypothesis_dir(self) -> Path:
        """Where kvconform's property tests keep hypothesis's files: pytest's cache dir, or a temp
        dir (removed at the end) when the cacheprovider is off; never the working directory."""
        if self._hypothesis_dir is None:
            cache = getattr(self._config, "cache", None)
            if cache is not None:
                self._hypothesis_dir = cache.mkdir("kvconform-hypothesis")
            else:
                self._hypothesis_dir = Path(tempfile.mkdtemp(prefix="kvconform-hypothesis-"))
                self._hypothesis_tmp = True
        return self._hypothesis_dir

    def cleanup(self) -> None:
        if self._hypothesis_tmp and self._hypothesis_dir is not None:
            shutil.rmtree(self._hypothesis_dir, ignore_errors=True)

    def scenarios(self) -> list[Scenario]:
        """Packaged scenarios plus every ``*.toml`` under ``--kvconform-scenarios`` (loaded once).

        A malformed file is a usage error naming the file and the key.
        """
        if self._scenarios is None:
            from .scenario import ScenarioError, load_scenario, packaged_scenario_names

            try:
                found = [load_scenario(n) for n in packaged_scenario_names()]
                for path in self.extra_scenario_paths:
                    files = sorted(path.glob("*.toml")) if path.is_dir() else [path]
                    found.extend(load_scenario(f) for f in files)
            except ScenarioError as exc:
                raise pytest.UsageError(f"kvconform: bad scenario: {exc}") from None
            self._scenarios = found
        return self._scenarios


session_key = pytest.StashKey[KVConformSession]()


def _not_installed(exc: BaseException) -> str | None:
    """The reason when a backend failed to start because its runtime is not installed (vLLM on
    macOS), else None: that backend's tests skip instead of the run erroring."""
    cause = exc.__cause__
    if type(cause).__name__ == "VllmUnavailableError" and str(cause).startswith("vLLM is not installed"):
        return str(cause)
    return None


def _resolve(session: KVConformSession) -> None:
    """Resolve the backend now: a bad name is a usage error before collection; a backend whose
    runtime is not installed is recorded in ``session.unavailable``."""
    from .backends.registry import BackendError

    with contextlib.suppress(BackendError):
        session.backend  # noqa: B018


def _selected_release(option: str) -> tuple[Any, str]:
    """``--kvconform-vllm`` (ini ``kvconform_vllm``), else the installed vLLM's release (a newer
    one than the newest rule set gets the newest), else the newest rule set."""
    from .backends.vllm.runtime import installed_vllm_version, is_vllm_installed
    from .reference.releases import LATEST, rule_set

    if option:
        return rule_set(option), "--kvconform-vllm"
    if not is_vllm_installed():
        return LATEST, "newest; vLLM is not installed"
    version = installed_vllm_version()
    return rule_set(version, newer_is_latest=True), f"installed vLLM {version}"


def _selected_backend(config: pytest.Config) -> tuple[str, str]:
    """``--kvconform-backend``, then ini ``kvconform_backend``, then ``$KVCONFORM_BACKEND``."""
    option = config.getoption("kvconform_backend")
    if option:
        return option, "option"
    ini = config.getini("kvconform_backend")
    if ini:
        return ini, "ini"
    env = os.environ.get(ENV_BACKEND)
    if env:
        return env, "env"
    return "reference", "default"


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
        "--kvconform-vllm",
        default=None,
        metavar="RELEASE",
        help="judge by the sizing rules of this vLLM release (0.27 ... 0.33; default: the installed "
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
    config.pluginmanager.register(session, "kvconform-session")
    if session.explicit:
        _resolve(session)
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
        _resolve(session)
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
    from . import conformance

    for counter in (conformance.DISCARDED, conformance.COMPARED, conformance.EXERCISED):
        counter.clear()
    try:
        with _hypothesis_settings(item, _session(item.config)):
            return (yield)
    finally:
        compared, discarded = sum(conformance.COMPARED.values()), sum(conformance.DISCARDED.values())
        item.stash[_generated_key] = (compared, discarded, dict(conformance.EXERCISED))


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


#: (generated inputs compared, discarded, rule -> compared inputs reaching it) of a property test
_generated_key = pytest.StashKey[tuple[int, int, dict[str, int]]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    rule = item.get_closest_marker("kvconform_rule")
    session = _session(item.config)
    if rule is not None and rule.args and session.unavailable is None:
        report.user_properties.append(("kvconform_rule", rule.args[0]))
        if session.inherited(rule.args[0]):
            report.user_properties.append(("kvconform_inherited", True))
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "kv_scenario" in params:
            report.user_properties.append(("kvconform_scenario", _scenario_id(params["kv_scenario"])))
        if call.excinfo is not None:
            from .conformance import Departure

            if isinstance(call.excinfo.value, Departure):  # JSON-serialisable: it crosses xdist
                report.user_properties.append(("kvconform_difference", call.excinfo.value.to_dict()))
        generated, discarded, exercised = item.stash.get(_generated_key, (0, 0, {}))
        if call.when == "call" and (generated or discarded):
            report.user_properties.extend([
                ("kvconform_generated", generated), ("kvconform_discarded", discarded),
                ("kvconform_exercised", exercised),
            ])  # fmt: skip
    return report


def _outcome_message(report: pytest.TestReport) -> str:
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
    from .report import format_matrix, write_report

    terminalreporter.section(f"kvconform: backend {session.backend.name} vs reference")
    for line in format_matrix(session.matrix):
        terminalreporter.write_line(line)
    declared = getattr(session.backend, "inherits", {})
    for rule in [r for r, counts in session.matrix.items() if counts["inherited"]]:
        why = (
            f"declared: {declared[rule]}" if rule in declared else "not declared in the backend's `inherits`"
        )
        terminalreporter.write_line(f"inherited {rule}: the backend runs the reference's code ({why})")
    if session.exercised:
        from .report import format_exercised

        terminalreporter.write_line("generated inputs compared, per rule they reach:")
        for line in format_exercised(session.exercised):
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
