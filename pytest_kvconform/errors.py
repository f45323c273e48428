"""The exception contract between the harness and a backend's rule methods.

* A return value is the backend's answer.
* ``ValueError``, ``NotImplementedError`` or ``AssertionError``: the backend *rejects* the input,
  as vLLM does with these exceptions (an indivisible TP split, pages unification cannot
  reconcile, a block no kernel supports). The harness compares the rejection with the
  reference's: both must reject, with the same exception type.
* :class:`RuleNotApplicable`: the backend *cannot answer* this input (no code path for it, a
  piece that cannot run offline). The rule's test skips with the message; in a composed plan
  that one step takes the reference's answer and the report says so.
* Anything else is a failure of the backend, reported as :class:`RuleError` naming the rule,
  the method, the backend and the scenario.
"""

from __future__ import annotations

from typing import Any

#: Exceptions that mean "the backend rejects this input" (compared with the reference's rejection).
REJECTIONS: tuple[type[BaseException], ...] = (ValueError, NotImplementedError, AssertionError)


class RuleNotApplicable(Exception):
    """Raised by a backend that has no code path for this particular input (the message says
    why): the test skips with that reason, and a composed plan takes the reference's answer
    for that step."""


class RuleError(Exception):
    """A backend's rule method raised something outside the contract."""

    def __init__(self, family: str, method: str, backend: str, scenario: Any, error: BaseException) -> None:
        self.family, self.method, self.backend, self.error = family, method, backend, error
        where = f" on scenario {scenario.name!r} ({scenario.source})" if scenario is not None else ""
        super().__init__(
            f"[{family}] backend {backend!r}.{method} raised{where}: {type(error).__name__}: {error}"
        )
