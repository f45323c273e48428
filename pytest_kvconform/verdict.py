"""One verdict per test, decided here: for the suites, ``kvconform check``, the matrix and the report.

A kvconform test (or one ``kvconform check`` comparison) ends as exactly one of:

* ``agreed``: the backend's own code answered and agrees with the reference: the only pass;
* ``inherited``: the answers that decide the test came from the reference's code, run for the
  backend (a method it does not redefine, an override returning ``super()``'s answer), or no
  answer of the backend was compared at all: agreement proves nothing about the backend;
* ``core``: for a backend that drives a plugin, every answer the test compares came from vLLM
  core's code running for the plugin (vLLM's planner, vLLM's runner through the harness's
  stand-in), none from the plugin's own packages: agreement proves nothing about the plugin;
* ``declined``: the backend declared that it does not do this (its
  :class:`~pytest_kvconform.requirements.Declines`), or an offline gap
  (:data:`~pytest_kvconform.gaps.OFFLINE_GAPS`) stopped it: the reason says which;
* ``departed``: the backend's answer differs: the first differing field, both values;
* ``known``: it departed exactly where a :class:`~pytest_kvconform.requirements.KnownDeparture`
  says it does (run as a strict xfail: the same test departing elsewhere, crashing, or agreeing
  fails);
* ``crashed``: anything else raised (by the backend, the plugin, vLLM or the harness): the
  exception's one-line summary and where it was raised;
* ``n/a``: the check does not apply to this input (not a hybrid, no state layers): the harness's
  decision, not the backend's.

pytest sees ``agreed`` as passed, ``departed`` and ``crashed`` as failed, ``known`` as xfailed and
the others as skipped with the reason; ``--kvconform-strict`` also fails an ``inherited`` verdict
whose families the backend does not declare in ``inherits``.
"""

from __future__ import annotations

import ast
import enum
import linecache
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import pytest

from . import provenance
from .rejections import raised_at
from .requirements import KnownDeparture


class Verdict(enum.StrEnum):
    AGREED = "agreed"
    INHERITED = "inherited"
    CORE = "core"
    DECLINED = "declined"
    DEPARTED = "departed"
    KNOWN = "known"
    CRASHED = "crashed"
    NOT_APPLICABLE = "n/a"


#: the verdicts, in report order
VERDICTS: tuple[str, ...] = tuple(v.value for v in Verdict)

#: the plan steps whose answers decide a composed plan (``reference.plan.STEPS``' families)
LOAD_BEARING = ("layer_specs", "block_size", "grouping", "memory", "allocation")


# ----------------------------------------------------------------------------- how tests end


class Departure(pytest.fail.Exception):  # type: ignore[misc,name-defined]
    """The backend's answer differs from the reference's: the rule, the first differing field
    and both values (the report records them)."""

    __module__ = "builtins"  # shown as ``Departure: [rule] ...``, as pytest shows ``Failed: ...``

    def __init__(
        self, message: str, rule: str, field: str, reference: Any, backend: Any, pytrace: bool = True
    ) -> None:
        super().__init__(message, pytrace=pytrace)
        self.rule, self.field, self.reference, self.backend = rule, field, reference, backend

    def to_dict(self) -> dict[str, str]:
        """JSON-serialisable (it travels as a user property under xdist): the values as ``repr``."""
        return {"field": self.field, "reference": repr(self.reference), "backend": repr(self.backend)}


class Declined(pytest.skip.Exception):  # type: ignore[misc,name-defined]
    """The backend declined (a declared reason or an offline gap); the message says which."""

    __module__ = "builtins"


class NotApplicable(pytest.skip.Exception):  # type: ignore[misc,name-defined]
    """The check does not apply to this input (the harness's decision, not the backend's)."""

    __module__ = "builtins"


class Crashed(pytest.fail.Exception):  # type: ignore[misc,name-defined]
    """Something raised outside the contract: its one-line summary and where it was raised."""

    __module__ = "builtins"


def where_raised(error: BaseException) -> str:
    """``file:line in function`` of the innermost frame of ``error`` (or what its own process
    recorded, for an exception that crossed from a backend's process)."""
    file, line, function = raised_at(error)
    return f"{_short_path(file)}:{line} in {function}" if file else "?"


def _short_path(path: str) -> str:
    for marker in ("site-packages" + os.sep, os.getcwd() + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def summary(error: BaseException) -> str:
    """``Type: first line of the message (at file:line in function)``."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''} (at {where_raised(error)})"


# ----------------------------------------------------------------------------- the decision


def absent_families(backend: Any) -> list[str]:
    """The rule families ``backend`` declines whole (its ``declines``)."""
    declines = getattr(backend, "declines", None)
    return list(declines.families()) if declines is not None else []


@dataclass(frozen=True)
class Result:
    """A test's verdict, its one-line message, and a departure's first difference."""

    verdict: Verdict
    message: str = ""
    difference: Mapping[str, str] | None = None
    #: the reason of the known departure it matched (``known``) or failed to match
    known: str = ""
    #: --kvconform-strict: an inherited verdict the backend does not declare (the test fails)
    strict_failure: str = ""

    @property
    def outcome(self) -> str:
        """What pytest reports: passed, failed, skipped or xfailed."""
        if self.strict_failure:
            return "failed"
        return {
            Verdict.AGREED: "passed", Verdict.DEPARTED: "failed", Verdict.CRASHED: "failed",
            Verdict.KNOWN: "xfailed",
        }.get(self.verdict, "skipped")  # fmt: skip


def _own_assertion(error: AssertionError, test_files: Sequence[str]) -> str | None:
    """The source of the ``assert`` statement that failed, when ``error`` was raised by an
    assertion of the test itself (its innermost frame in one of ``test_files``), else None."""
    tb: TracebackType | None = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or os.path.realpath(tb.tb_frame.f_code.co_filename) not in test_files:
        return None
    line = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno).strip()
    try:
        node = ast.parse(line).body[0]
    except (SyntaxError, IndexError):  # an assert over several lines: its first line
        return line.removeprefix("assert ")
    return ast.unparse(node.test) if isinstance(node, ast.Assert) else line


def _from_error(error: BaseException, test_files: Sequence[str]) -> Result:
    if isinstance(error, Departure):
        return Result(Verdict.DEPARTED, _first_line(error), error.to_dict())
    if isinstance(error, Declined):
        return Result(Verdict.DECLINED, _first_line(error))
    if isinstance(error, Crashed):
        return Result(Verdict.CRASHED, _first_line(error))
    if isinstance(error, pytest.skip.Exception):
        return Result(Verdict.NOT_APPLICABLE, _first_line(error))
    if isinstance(error, AssertionError):
        statement = _own_assertion(error, [os.path.realpath(f) for f in test_files])
        if statement is not None:  # the test's own comparison with a number it states
            lines = str(error).splitlines()
            shown = lines[0] if lines else statement
            return Result(Verdict.DEPARTED, f"assert {statement}: {shown}",
                          {"field": f"assert {statement}", "reference": "", "backend": shown})  # fmt: skip
    return Result(Verdict.CRASHED, summary(error))


def _first_line(error: BaseException) -> str:
    text = str(getattr(error, "msg", "") or error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _from_answers(
    rule: str,
    answers: Sequence[tuple[str, str, str, str]],
    oracle: bool,
    generated: Mapping[str, int],
    absent: Iterable[str] = (),
) -> Result:
    """The verdict of a test that raised nothing, from who gave the answers it compared (and, for
    a property test, what became of its generated inputs)."""
    if oracle:
        return Result(Verdict.AGREED)
    if generated and not generated.get("compared"):
        if generated.get("known"):
            return Result(Verdict.KNOWN, "every generated input compared departed as a known departure",
                          known="by input kind")  # fmt: skip
        if generated.get("declined"):
            return Result(Verdict.DECLINED, "the backend declined every generated input")
    if rule == "plan":  # the load-bearing steps; the allocation only where the backend allocates
        relevant = [a for a in answers if a[0] in (*LOAD_BEARING, "plan")
                    and not (a[0] == "allocation" and a[0] in absent)]  # fmt: skip
    else:  # the rule's answers, else those of the families the backend has
        relevant = [a for a in answers if a[0] == rule] or [a for a in answers if a[0] not in absent]
    if not relevant:
        return Result(Verdict.INHERITED, "the backend was asked nothing this test compares")
    declined = _steps(a for a in relevant if a[2] == provenance.REFERENCE)
    if declined:
        return Result(Verdict.DECLINED, "declined: " + "; ".join(declined))
    inherited = _steps(a for a in relevant if a[2] == provenance.INHERITED)
    if inherited:
        return Result(Verdict.INHERITED, "the reference's code answered: " + ", ".join(inherited))
    if all(a[2] == provenance.CORE for a in relevant):
        core = _steps(relevant)
        return Result(Verdict.CORE, "vLLM core's code answered for the plugin: " + ", ".join(core))
    return Result(Verdict.AGREED)


def _steps(answers: Iterable[tuple[str, str, str, str]]) -> list[str]:
    return list(dict.fromkeys(f"{f}.{m}" + (f" ({why})" if why else "") for f, m, _, why in answers))


def decide(
    *,
    rule: str,
    error: BaseException | None,
    answers: Sequence[tuple[str, str, str, str]] = (),
    backend: Any = None,
    known: Sequence[KnownDeparture] = (),
    strict: bool = False,
    test_files: Sequence[str] = (),
    generated: Mapping[str, int] | None = None,
) -> Result:
    """The verdict of one test of ``rule``: what it raised (``error``; None when it returned), the
    answers it recorded (:class:`~pytest_kvconform.provenance.Ledger` rows), the backend (whether it
    is the reference itself, its declared ``inherits``, the families it declines whole: a composed
    plan of a backend that allocates nothing needs no allocation of its own), the known departures
    about this test and ``--kvconform-strict``. ``test_files``: where the test's own asserts live;
    ``generated``: a property test's inputs (``compared``, ``declined``, ``known``)."""
    if error is None:
        oracle = backend is not None and provenance.is_oracle(backend)
        result = _from_answers(rule, answers, oracle, generated or {}, set(absent_families(backend)))
    else:
        result = _from_error(error, test_files)
    if known:
        result = _with_known(result, known)
    if strict and result.verdict is Verdict.INHERITED:
        # a plan: the load-bearing steps the reference's code answered; another test: its rule
        families = sorted({a[0] for a in answers if a[2] == provenance.INHERITED and a[0] in LOAD_BEARING}
                          if rule == "plan" else ()) or [rule]  # fmt: skip
        inherits = getattr(backend, "inherits", None) or {}
        undeclared = [f for f in families if f not in inherits]
        if undeclared:
            return Result(result.verdict, result.message, strict_failure=(
                f"--kvconform-strict: inherited and not declared in `inherits`: {', '.join(undeclared)}"
            ))  # fmt: skip
    return result


def _with_known(result: Result, known: Sequence[KnownDeparture]) -> Result:
    """A departure a known entry names is ``known``; a departure elsewhere, a crash, or an agreement
    where a named test was to depart fails, saying which departure was expected."""
    expected = "; ".join(k.describe() for k in known)
    if result.verdict is Verdict.DEPARTED and result.difference is not None:
        match = next((k for k in known if k.matches(result.difference)), None)
        if match is not None:
            return Result(Verdict.KNOWN, match.reason, result.difference, known=match.reason)
        return Result(Verdict.DEPARTED, f"{result.message} [not the known departure: {expected}]",
                      result.difference, known=expected)  # fmt: skip
    if result.verdict is Verdict.CRASHED:
        return Result(
            Verdict.CRASHED,
            f"{result.message} [a known departure does not cover a crash: {expected}]",
            known=expected,
        )
    named = [k for k in known if k.test != "*"]
    if result.verdict is Verdict.AGREED and named:
        return Result(Verdict.DEPARTED, "[XPASS(strict)] the known departure no longer happens: "
                      + "; ".join(k.describe() for k in named), known=expected)  # fmt: skip
    return result
