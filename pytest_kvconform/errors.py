"""The contract between the harness and a backend's rule methods, on one page.

* A return value is the backend's answer. It is compared with the reference's answer of the
  vLLM release being judged; the test *agrees* only when the backend's own code gave it
  (:mod:`pytest_kvconform.provenance`), not when the reference's code answered for it.
* A refusal of the input, as vLLM refuses (``ValueError``, ``NotImplementedError``,
  ``AssertionError`` with one of vLLM's messages, or :class:`~pytest_kvconform.rejections.Rejected`
  with a kind), is an answer too: it is compared by its kind
  (:data:`~pytest_kvconform.rejections.KINDS`: parallel split, pages not unifiable, not enough
  memory, unsupported dtype or block size, ...) with the reference's. Such an exception whose
  message maps to no kind is not a refusal: it crashes the test.
* What a backend does not do is declared once, on the backend (``declines``:
  :class:`~pytest_kvconform.requirements.Declines`); those tests end *declined* with the reason,
  and a composed plan takes the reference's answer for that step (reported). At run time only
  an :class:`~pytest_kvconform.gaps.OfflineGap` (what cannot run on this host, from the one table
  :data:`~pytest_kvconform.gaps.OFFLINE_GAPS`) declines.
* Where the backend departs on purpose or by a known bug, it says so once (``known_departures``:
  :class:`~pytest_kvconform.requirements.KnownDeparture`, naming the field), or the user does
  (``--kvconform-xfails``); the test must depart exactly there.
* Anything else raised is a crash: the test fails with the exception's one-line summary and
  where it was raised (:mod:`pytest_kvconform.verdict`). Inside a composed plan it is wrapped in
  :class:`RuleError`, naming the step.
"""

from __future__ import annotations

from typing import Any

from .gaps import OfflineGap
from .rejections import REJECTION_CLASSES, Rejected

#: Exception classes a refusal may be raised as (compared by kind, :mod:`.rejections`).
REJECTIONS = REJECTION_CLASSES

__all__ = ["REJECTIONS", "OfflineGap", "Rejected", "RuleError"]


class RuleError(Exception):
    """A step of a composed plan raised something outside the contract."""

    def __init__(self, family: str, method: str, backend: str, scenario: Any, error: BaseException) -> None:
        self.family, self.method, self.backend, self.error = family, method, backend, error
        where = f" on scenario {scenario.name!r} ({scenario.source})" if scenario is not None else ""
        super().__init__(
            f"[{family}] backend {backend!r}.{method} raised{where}: {type(error).__name__}: {error}"
        )
