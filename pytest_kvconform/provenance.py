"""Who really answered a rule: the backend's own code, the reference's code running for it, or
the reference because the backend declined.

Decided by behaviour, never by whether a method is redefined. :func:`ask` calls one rule method
of a backend and watches which code hands the answer back:

* ``backend``: code other than the reference's produced the value (or raised the rejection);
* ``inherited``: the value is one the reference's code (``pytest_kvconform/reference/``) handed
  back to the backend during the call: a method the backend does not redefine, an override that
  returns ``super()``'s answer, a branch that hands back the reference's answer, a rejection
  raised inside the reference's code;
* ``reference``: the backend declined (its ``declines``, or an
  :class:`~pytest_kvconform.gaps.OfflineGap`) and the reference of the same release answered
  instead (recorded by the caller);
* ``core``: for a backend that drives a plugin (its :meth:`plugin_code`), vLLM core's code
  answered for the plugin: no code of the plugin's packages returned during the call, or a
  stand-in of the harness did (:class:`~.backends.vllm.worker.RunnerStandIn`: vLLM's
  ``GPUModelRunner.get_kv_cache_spec`` for a worker the harness built no runner for). A
  stand-in's answer is never the plugin's own.

"Handed back" is judged by identity: a value the backend built itself is a new object even when
it equals the reference's. Values CPython shares between unrelated code (``None``, booleans,
small integers) are judged by equality instead, so a backend that calls ``super()`` only to
compare and then returns an equal small integer of its own counts as inherited: never as passed.

While a redefined method runs, a ``sys.setprofile`` hook records the values the reference's
functions return to code outside the reference; a profile function already installed is put
back afterwards. The answers of one test (or one ``kvconform check`` comparison) are kept in a
:class:`Ledger`, the per-test state the plugin reads after the call.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

BACKEND, INHERITED, REFERENCE, CORE = "backend", "inherited", "reference", "core"

#: every file of the reference's code starts with this (as code objects spell their file)
REFERENCE_CODE = os.path.join(os.path.dirname(__file__), "reference", "")


def is_reference_code(filename: str) -> bool:
    return filename.startswith(REFERENCE_CODE)


def is_oracle(rules: Any) -> bool:
    """Whether ``rules`` is the reference itself (its answers are the reference's own, not
    inherited): an object of a class that marks itself ``_kvconform_oracle``, not a subclass."""
    return bool(vars(type(rules)).get("_kvconform_oracle", False))


@dataclass(frozen=True)
class Answer:
    """One rule method's answer and who produced it; ``error`` when it raised."""

    by: str
    value: Any = None
    error: Exception | None = None
    #: the process whose code gave the answer (a backend in its own process: that one's)
    pid: int = field(default_factory=os.getpid)

    def get(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


def _shared(value: Any) -> bool:
    """Values CPython may share between unrelated code, so identity says nothing about them."""
    return value is None or isinstance(value, bool) or (type(value) is int and -5 <= value <= 256)


def _handed_back(value: Any, handed: list[Any]) -> bool:
    if _shared(value):
        return any(type(v) is type(value) and v == value for v in handed)
    return any(v is value for v in handed)


def _raised_by_reference(error: BaseException) -> bool:
    """Whether the innermost frame of ``error``'s traceback is the reference's code."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and is_reference_code(tb.tb_frame.f_code.co_filename)


@dataclass(frozen=True)
class PluginCode:
    """Whose code a plugin's is: the folders of its packages, and the qualified-name prefixes of
    the harness's stand-ins whose answers are vLLM core's (``RunnerStandIn.``)."""

    roots: tuple[str, ...]
    stand_ins: tuple[str, ...] = ()


@dataclass
class _Watch:
    handed: list[Any] = field(default_factory=list)
    plugin_ran: bool = False
    stand_in_ran: bool = False

    def by(self, value_by: str, plugin: PluginCode | None) -> str:
        """``value_by`` (backend or inherited), made ``core`` where the plugin's code did not answer."""
        if value_by == BACKEND and plugin is not None and (self.stand_in_ran or not self.plugin_ran):
            return CORE
        return value_by


#: the watch of the running :func:`ask`, for :func:`credit`
_WATCH: contextvars.ContextVar[_Watch | None] = contextvars.ContextVar("kvconform_watch", default=None)


@contextlib.contextmanager
def _watch_returns(plugin: PluginCode | None = None) -> Iterator[_Watch]:
    """Meanwhile: the values the reference's functions return to code outside the reference, and
    whether code of ``plugin``'s packages, or a stand-in, returned at all. A watch inside another
    (:func:`participation` during an :func:`ask`) passes every event on to the outer one."""
    watch = _Watch()
    previous = sys.getprofile()
    roots = plugin.roots if plugin is not None else ()
    stand_ins = plugin.stand_ins if plugin is not None else ()

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if previous is not None:
            previous(frame, event, arg)
        if event != "return":
            return
        filename = frame.f_code.co_filename
        if is_reference_code(filename):
            caller = frame.f_back
            if caller is None or not is_reference_code(caller.f_code.co_filename):
                watch.handed.append(arg)
        elif roots and filename.startswith(roots):
            watch.plugin_ran = True
        elif stand_ins and frame.f_code.co_qualname.startswith(stand_ins):
            watch.stand_in_ran = True

    sys.setprofile(hook)
    token = _WATCH.set(watch)
    try:
        yield watch
    finally:
        _WATCH.reset(token)
        sys.setprofile(previous)


@dataclass(frozen=True)
class Participation:
    """Whose code ran while an answer was computed (for a backend that hands it out later)."""

    plugin_ran: bool = False
    stand_in_ran: bool = False


@contextlib.contextmanager
def participation(plugin: PluginCode | None) -> Iterator[list[Participation]]:
    """Whose code runs inside: a backend that computes an answer once and hands it out to later
    asks (vLLM's engine, built once per scenario) keeps it and :func:`credit` s it to each."""
    out: list[Participation] = []
    with _watch_returns(plugin) as watch:
        yield out
    out.append(Participation(watch.plugin_ran, watch.stand_in_ran))


def credit(done: Sequence[Participation]) -> None:
    """The running :func:`ask` hands out an answer computed earlier (:func:`participation`): the
    code that computed it counts as having answered now."""
    watch = _WATCH.get()
    for p in done if watch is not None else ():
        watch.plugin_ran |= p.plugin_ran
        watch.stand_in_ran |= p.stand_in_ran


def plugin_code_of(rules: Any) -> PluginCode | None:
    """The plugin ``rules`` drives (its ``plugin_code()``), if any."""
    method = getattr(rules, "plugin_code", None)
    return method() if callable(method) else None


def ask(rules: Any, method: str, *args: Any, **kwargs: Any) -> Answer:
    """``rules.<method>(*args, **kwargs)`` and who answered; anything raised is kept in the
    :class:`Answer`. The reference itself always answers as ``backend`` (its own code). A backend
    running in another process (:class:`~.backends.isolated.IsolatedBackend`) is asked there."""
    remote = getattr(type(rules), "kvconform_ask", None)
    if remote is not None:
        return remote(rules, method, *args, **kwargs)
    fn: Callable[..., Any] = getattr(rules, method)
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if is_oracle(rules):
        by_code = BACKEND
    elif code is not None and is_reference_code(code.co_filename):
        by_code = INHERITED  # the reference's own function runs (not redefined)
    else:
        prepare = getattr(rules, "prepare", None)
        if callable(prepare) and kwargs.get("scenario") is not None:
            prepare(kwargs["scenario"])  # its expensive set-up, unwatched (see ReferenceRules.prepare)
        plugin = plugin_code_of(rules)
        with _watch_returns(plugin) as watch:
            try:
                value = fn(*args, **kwargs)
            except Exception as exc:
                return Answer(
                    watch.by(INHERITED if _raised_by_reference(exc) else BACKEND, plugin), error=exc
                )
        return Answer(watch.by(INHERITED if _handed_back(value, watch.handed) else BACKEND, plugin), value)
    try:
        return Answer(by_code, fn(*args, **kwargs))
    except Exception as exc:
        return Answer(by_code, error=exc)


def composes_plan(backend: Any) -> bool:
    """Whether ``backend.plan`` is the reference's composition of the backend's own rules (so a
    plan can be composed step by step, each step asked separately), not a plan of its own."""
    remote = getattr(type(backend), "kvconform_composes_plan", None)
    if remote is not None:
        return bool(remote(backend))
    code = getattr(getattr(type(backend), "plan", None), "__code__", None)
    return code is not None and is_reference_code(code.co_filename)


# ----------------------------------------------------------------------------- per-test state


@dataclass
class Ledger:
    """What one test (or one ``kvconform check`` comparison) saw of the backend: every answer with
    who gave it, the known departures about it, and the generated inputs of a property test."""

    #: (rule family, method, who answered, why the reference answered; "" otherwise), in order
    answers: list[tuple[str, str, str, str]] = field(default_factory=list)
    #: the processes whose code answered (more than this one: a backend in its own process)
    processes: set[int] = field(default_factory=set)
    #: the known departures about this test (``requirements.KnownDeparture``; per input kind for
    #: generated inputs)
    known: list[Any] = field(default_factory=list)
    #: generated inputs compared (both answered, or both rejected alike)
    compared: int = 0
    #: reason -> generated inputs the backend declined (declared, or an offline gap)
    declined: Counter[str] = field(default_factory=Counter)
    #: reason -> generated inputs that departed where a known departure says they do
    known_departures: Counter[str] = field(default_factory=Counter)
    #: rule -> compared generated inputs that reached it
    exercised: Counter[str] = field(default_factory=Counter)

    def record(self, family: str, method: str, by: str, reason: str = "", pid: int | None = None) -> None:
        self.answers.append((family, method, by, reason))
        if pid is not None:
            self.processes.add(pid)

    def counts(self) -> dict[str, int]:
        """Answers by who gave them (``backend``, ``inherited``, ``reference``, ``core``)."""
        return dict(Counter(by for _, _, by, _ in self.answers))

    def by_method(self) -> dict[str, dict[str, int]]:
        """``family.method`` -> who answered -> answers, in the order first asked."""
        out: dict[str, Counter[str]] = {}
        for family, method, by, _ in self.answers:
            out.setdefault(f"{family}.{method}", Counter())[by] += 1
        return {k: dict(v) for k, v in out.items()}

    def declined_steps(self) -> list[str]:
        """``family.method: reference (why)`` of each answer the reference gave because the
        backend declined."""
        return list(dict.fromkeys(
            f"{f}.{m}: reference ({why})" for f, m, by, why in self.answers if by == REFERENCE
        ))  # fmt: skip

    def generated(self) -> dict[str, int]:
        """The property test's generated inputs: compared, declined, known departures."""
        return {"compared": self.compared, "declined": sum(self.declined.values()),
                "known": sum(self.known_departures.values())}  # fmt: skip


_current: contextvars.ContextVar[Ledger | None] = contextvars.ContextVar("kvconform_ledger", default=None)


@contextlib.contextmanager
def ledger() -> Iterator[Ledger]:
    """A fresh :class:`Ledger` for the duration of one test or comparison."""
    led = Ledger()
    token = _current.set(led)
    try:
        yield led
    finally:
        _current.reset(token)


def current() -> Ledger:
    """The running test's ledger; outside one, a throwaway ledger."""
    return _current.get() or Ledger()
