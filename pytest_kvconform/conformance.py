"""Running rules on a backend and comparing them with the reference.

Used by the shipped suites and by downstream repos (``check_scenario``) that want the same
checks on their own scenario files.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from .backends.base import RULE_FAMILIES, ReferenceBackend, RuleNotApplicable
from .scenario import Scenario, load_scenario

__all__ = [
    "RULE_FAMILIES",
    "Difference",
    "call_rule",
    "check_scenario",
    "known_failure",
    "skip_if_not_provided",
]


def skip_if_not_provided(backend: Any, rule: str) -> None:
    """Skip the current test when ``backend`` does not provide ``rule`` (with its reason)."""
    reason = getattr(backend, "not_provided", {}).get(rule)
    if reason is not None:
        pytest.skip(f"backend {backend.name!r} does not provide rule {rule!r}: {reason}")


def call_rule(backend: Any, rule: str, method: str, *args: Any, scenario: Scenario | None = None) -> Any:
    """Call one rule method; a backend exception fails only this test, naming rule and scenario."""
    skip_if_not_provided(backend, rule)
    fn: Callable[..., Any] | None = getattr(backend, method, None)
    if fn is None:
        pytest.skip(f"backend {backend.name!r} has no method {method!r} (rule {rule!r})")
    try:
        return fn(*args)
    except RuleNotApplicable as exc:
        pytest.skip(f"[{rule}] backend {backend.name!r} cannot answer this input: {exc}")
    except Exception as exc:
        where = f" on scenario {scenario.name!r} ({scenario.source})" if scenario is not None else ""
        message = f"[{rule}] backend {backend.name!r}.{method} raised{where}: {type(exc).__name__}: {exc}"
    pytest.fail(message, pytrace=False)  # outside the except: no chained traceback


def known_failure(backend: Any, item: pytest.Item, extra: Mapping[str, str] | None = None) -> str | None:
    """The reason a test is a known failure of ``backend``: its ``known_failures`` data, plus
    ``extra`` entries (``--kvconform-xfails`` files).

    Keys are ``"<rule>::<test name>"`` where ``*`` in the name matches anything and every other
    character is literal (so ``[`` of a parametrize id needs no escaping), e.g.
    ``"plan::test_plan[glm-5-fp8-ds-mla]"`` or ``"hybrid_alignment::*glm-5*"``.
    """
    rule_marker = item.get_closest_marker("kvconform_rule")
    rule = rule_marker.args[0] if rule_marker is not None else ""
    entries = {**getattr(backend, "known_failures", {}), **(extra or {})}
    for key, reason in entries.items():
        key_rule, _, pattern = key.partition("::")
        regex = ".*".join(re.escape(part) for part in (pattern or "*").split("*"))
        if key_rule == rule and re.fullmatch(regex, item.name):
            return str(reason)
    return None


def load_xfails(path: Path, backend_name: str) -> dict[str, str]:
    """Known failures kept as data, outside the backend's code (``--kvconform-xfails``)::

        [[xfail]]
        backend = "metal"            # optional: only for this backend
        rule = "plan"
        test = "test_plan[glm-5-*]"  # ``*`` matches anything
        reason = "why, with the numbers"

    Raises ``ValueError`` naming the file and the entry when it is malformed.
    """
    import tomllib

    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the xfails file ({exc})") from None
    entries = data.get("xfail", [])
    if set(data) - {"xfail"} or not isinstance(entries, list):
        raise ValueError(f"{path}: expected only [[xfail]] tables")
    out = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) - {"backend", "rule", "test", "reason"}:
            raise ValueError(f"{path}: xfail[{i}]: expected keys backend, rule, test, reason")
        missing = [k for k in ("rule", "test", "reason") if not isinstance(entry.get(k), str)]
        if missing:
            raise ValueError(f"{path}: xfail[{i}]: {', '.join(missing)} missing or not a string")
        if entry["rule"] not in RULE_FAMILIES:
            raise ValueError(f"{path}: xfail[{i}].rule: expected one of {', '.join(RULE_FAMILIES)}")
        if entry.get("backend", backend_name) == backend_name:
            out[f"{entry['rule']}::{entry['test']}"] = entry["reason"]
    return out


@dataclasses.dataclass(frozen=True)
class Difference:
    """One field where a backend's plan departs from the reference's."""

    scenario: str
    field: str
    reference: Any
    backend: Any

    def __str__(self) -> str:
        return f"{self.scenario}: {self.field}: reference {self.reference!r}, backend {self.backend!r}"


def check_scenario(scenario: Scenario | str | Path, backend: Any) -> list[Difference]:
    """Compare ``backend.plan`` with the reference's plan, field by field.

    For downstream repos: ``assert not check_scenario("my-model.toml", MyBackend())``.
    A malformed file raises :class:`~pytest_kvconform.scenario.ScenarioError`.
    """
    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario)
    expected = ReferenceBackend().plan(scenario).to_dict()
    got = backend.plan(scenario).to_dict()
    return [
        Difference(scenario.name, k, expected[k], got.get(k)) for k in expected if expected[k] != got.get(k)
    ]
