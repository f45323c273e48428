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
  instead (recorded by the caller).

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

BACKEND, INHERITED, REFERENCE = "backend", "inherited", "reference"

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


@contextlib.contextmanager
def _watch_reference_returns() -> Iterator[list[Any]]:
    """The values the reference's functions return to code outside the reference, meanwhile."""
    handed: list[Any] = []
    previous = sys.getprofile()

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "return" and is_reference_code(frame.f_code.co_filename):
            caller = frame.f_back
            if caller is None or not is_reference_code(caller.f_code.co_filename):
                handed.append(arg)

    sys.setprofile(hook)
    try:
        yield handed
    finally:
        sys.setprofile(previous)


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
        with _watch_reference_returns() as handed:
            try:
                value = fn(*args, **kwargs)
            except Exception as exc:
                return Answer(INHERITED if _raised_by_reference(exc) else BACKEND, error=exc)
        return Answer(INHERITED if _handed_back(value, handed) else BACKEND, value)
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
        """Answers by who gave them (``backend``, ``inherited``, ``reference``)."""
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
