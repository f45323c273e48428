"""The state of one kvconform pytest session, and the selection of its backend and release.

:class:`KVConformSession` (kept in ``config.stash`` under :data:`session_key`) holds what the
hooks of :mod:`pytest_kvconform.plugin` collect: the backend under test, the vLLM release whose
rules judge it, the scenarios, and the rule x outcome matrix. :func:`selected_release` is shared
with ``kvconform`` (:mod:`pytest_kvconform.cli`). Standard library and pytest only at import.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .scenario import Scenario

ENV_BACKEND = "KVCONFORM_BACKEND"


class KVConformSession:
    """Per-session state, kept in ``config.stash`` under :data:`session_key`."""

    def __init__(self, config: pytest.Config) -> None:
        self.backend_name, self.backend_origin = selected_backend(config)
        self.backend_options_raw: list[str] = [
            *config.getini("kvconform_backend_options"),
            *config.getoption("kvconform_backend_option"),
        ]
        self._backend: Any = None
        #: why the selected backend cannot run here, with ``--kvconform-skip-unavailable``: its tests skip
        self.unavailable: str | None = None
        self.skip_unavailable = bool(config.getoption("kvconform_skip_unavailable"))
        self._release: tuple[Any, str] | None = None
        self.release_option = config.getoption("kvconform_vllm") or config.getini("kvconform_vllm")
        self._scenarios: list[Scenario] | None = None
        #: one record per conformance test (:func:`pytest_kvconform.checks.record`, plus the plan
        #: steps, the rules generated inputs reached and the answering processes)
        self.records: list[dict[str, Any]] = []
        self.strict = bool(config.getoption("kvconform_strict"))
        #: build the backend in a process of its own (``--kvconform-isolate``)
        self.isolate = bool(config.getoption("kvconform_isolate"))
        #: seconds an isolated backend may take to answer one call (``--kvconform-timeout``)
        self.timeout = float(config.getoption("kvconform_timeout"))
        self.xfails_path = config.getoption("kvconform_xfails")
        #: known departures kept as data (``--kvconform-xfails``)
        self.xfails: list[Any] = []
        self.extra_scenario_paths = [Path(p) for p in config.getoption("kvconform_scenarios") or []]
        self.max_examples: int | None = config.getoption("kvconform_max_examples")
        #: whether any kvconform option, ini value or environment variable is set
        self.configured = self.explicit or any(
            config.getoption(name)
            for name in ("kvconform_scenarios", "kvconform_max_examples", "kvconform_xfails",
                         "kvconform_strict", "kvconform_vllm", "kvconform_report", "kvconform_isolate")
        ) or bool(config.getini("kvconform_vllm"))  # fmt: skip
        self._config = config
        self._hypothesis_dir: Path | None = None
        self._hypothesis_tmp = False

    def record(self, report: pytest.TestReport) -> None:
        """Keep one test's record (under xdist, from the workers' replayed reports)."""
        properties = dict(report.user_properties)
        record = properties.get("kvconform_record")
        if record is not None:
            self.records.append(dict(record))

    @property
    def self_check(self) -> bool:
        """The reference against itself: only the tests that compare with independent numbers run."""
        from .provenance import is_oracle

        return self.unavailable is None and is_oracle(self.backend)

    def known_departures(self) -> list[Any]:
        """The backend's known departures, then those of ``--kvconform-xfails``."""
        return [*getattr(self.backend, "known_departures", ()), *self.xfails]

    def report_document(self) -> dict[str, Any]:
        """The ``--kvconform-report`` document (:func:`pytest_kvconform.report.report_document`)."""
        from .backends.registry import parse_options
        from .report import report_document

        release, selected_by = self.release
        return report_document(
            self.backend, self.records, options=parse_options(self.backend_options_raw),
            reference={"vllm_release": release.release, "selected_by": selected_by},
            process=process_of(self.backend), mode="self-check" if self.self_check else "conformance",
        )  # fmt: skip

    @property
    def explicit(self) -> bool:
        return self.backend_origin != "default" or bool(self.backend_options_raw)

    @property
    def backend(self) -> Any:
        if self._backend is None:
            from .backends.registry import BackendError, parse_options, resolve_backend

            try:
                self._backend = resolve_backend(
                    self.backend_name, parse_options(self.backend_options_raw), isolate=self.isolate,
                    timeout=self.timeout,
                )  # fmt: skip
            except BackendError as exc:
                missing = not_installed(exc)
                if missing is not None and self.skip_unavailable:
                    self.unavailable = missing
                    raise
                raise pytest.UsageError(f"--kvconform-backend={self.backend_name}: {exc}") from None
            self.apply_release(self._backend)
        return self._backend

    @property
    def release(self) -> tuple[Any, str]:
        """The vLLM release whose rules the reference applies, and why (:func:`selected_release`)."""
        if self._release is None:
            try:
                self._release = selected_release(self.release_option)
            except ValueError as exc:
                raise pytest.UsageError(f"--kvconform-vllm: {exc}") from None
        return self._release

    def apply_release(self, rules: Any) -> Any:
        """Give ``rules`` (the reference, or a backend built on it) the selected release's rules."""
        from .backends.registry import with_release

        return with_release(rules, self.release[0])

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
        close = getattr(self._backend, "close", None)
        if close is not None:  # its processes, engines, caches, the environment it set
            close()
        if self._hypothesis_tmp and self._hypothesis_dir is not None:
            shutil.rmtree(self._hypothesis_dir, ignore_errors=True)

    def scenarios(self) -> list[Scenario]:
        """Packaged scenarios plus, under ``--kvconform-scenarios``, every ``*.toml`` and every
        model's config.json (a model directory, or one a level down; read with the engine's
        defaults for what it does not say, :mod:`.hf_config`), loaded once.

        A malformed file is a usage error naming the file and the key.
        """
        if self._scenarios is None:
            from .hf_config import is_config_path, load_config_scenario, scenario_files
            from .scenario import ScenarioError, load_scenario, packaged_scenario_names

            try:
                found = [load_scenario(n) for n in packaged_scenario_names()]
                for path in self.extra_scenario_paths:
                    for f in scenario_files(path):
                        found.append(load_config_scenario(f) if is_config_path(f) else load_scenario(f))
            except ScenarioError as exc:
                raise pytest.UsageError(f"kvconform: bad scenario: {exc}") from None
            self._scenarios = found
        return self._scenarios


session_key = pytest.StashKey[KVConformSession]()


def process_of(backend: Any) -> dict[str, Any]:
    """Whether ``backend``'s code runs in a process of its own, and why. Which process answered
    each test is in its record (``processes``: under xdist every worker has its own)."""
    from .backends.isolated import IsolatedBackend

    if isinstance(backend, IsolatedBackend):
        return {"isolated": True, "why": backend.process["why"]}
    return {"isolated": False, "why": ""}


def not_installed(exc: BaseException) -> str | None:
    """The reason when a backend failed to start because its runtime is not installed (vLLM on
    macOS, a plugin's package), else None."""
    from .backends.registry import BackendError

    cause = exc.__cause__
    if type(cause).__name__ == "VllmUnavailableError" or isinstance(cause, ImportError):
        return str(cause)
    if isinstance(exc, BackendError) and "could not be imported" in str(exc):
        return str(exc)
    return None


def resolve(session: KVConformSession) -> None:
    """Resolve the backend now: a name that cannot be resolved, a backend that cannot be imported
    or built is a usage error before collection (one line, with the install command); with
    ``--kvconform-skip-unavailable`` a backend whose runtime is not installed is recorded in
    ``session.unavailable`` and its tests skip."""
    from .backends.registry import BackendError

    with contextlib.suppress(BackendError):
        session.backend  # noqa: B018


def selected_release(option: str) -> tuple[Any, str]:
    """``--kvconform-vllm`` (ini ``kvconform_vllm``), else the installed vLLM's release (a newer
    one than the newest rule set gets the newest, and the reason says so), else the newest rule set."""
    from .backends.vllm.runtime import installed_vllm_version, is_vllm_installed
    from .reference.releases import LATEST, release_of, rule_set

    if option:
        return rule_set(option), "--kvconform-vllm"
    if not is_vllm_installed():
        return LATEST, "newest; vLLM is not installed"
    version = installed_vllm_version()
    rules = rule_set(version, newer_is_latest=True)
    if release_of(version) != rules.release:
        return rules, (
            f"installed vLLM {version}; WARNING: newer than the newest rule set ({rules.release}), judged "
            f"by {rules.release}'s rules: changes after {rules.release} are not known to the reference"
        )
    return rules, f"installed vLLM {version}"


def selected_backend(config: pytest.Config) -> tuple[str, str]:
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
