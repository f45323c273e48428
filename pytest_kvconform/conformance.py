"""Running rules on a backend and comparing them with the reference.

Used by the shipped suites and by downstream repos (``check_scenario``) that want the same
checks on their own scenario files.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from . import provenance
from .backends.base import METHOD_FAMILY, RULE_FAMILIES, ReferenceBackend
from .errors import REJECTIONS, RuleError, RuleNotApplicable
from .reference.specs import MambaSpec
from .scenario import Scenario, load_scenario

__all__ = [
    "REJECTIONS",
    "RULE_FAMILIES",
    "Departure",
    "Difference",
    "RuleNotApplicable",
    "assert_same",
    "assert_same_layers",
    "call_rule",
    "check_scenario",
    "departure",
    "discard",
    "first_difference",
    "known_failure",
    "layer_spec_difference",
    "outcome",
    "plan_with_trace",
    "skip_if_not_provided",
]


def discard(reason: str) -> None:
    """Count one generated input the backend cannot model, then let hypothesis reject it."""
    provenance.current().discarded[reason] += 1


def compared(*exercised: str) -> None:
    """Count one generated input that reached the comparison, and the rules it exercised."""
    ledger = provenance.current()
    ledger.compared += 1
    ledger.exercised.update(exercised)


def skip_if_not_provided(backend: Any, rule: str) -> None:
    """Skip the current test when ``backend`` does not provide ``rule`` (with its reason)."""
    reason = getattr(backend, "not_provided", {}).get(rule)
    if reason is not None:
        pytest.skip(f"backend {backend.name!r} does not provide rule {rule!r}: {reason}")


def _ask(backend: Any, method: str, *inputs: Any, scenario: Scenario | None) -> provenance.Answer:
    """The backend's answer, recorded in the running test's ledger with who gave it; not provided
    or not applicable skips."""
    rule = METHOD_FAMILY.get(method, method)
    skip_if_not_provided(backend, rule)
    if getattr(backend, method, None) is None:
        pytest.skip(f"backend {backend.name!r} has no method {method!r} (rule {rule!r})")
    answer = provenance.ask(backend, method, *inputs, scenario=scenario)
    if isinstance(answer.error, RuleNotApplicable):
        pytest.skip(f"[{rule}] backend {backend.name!r} cannot answer this input: {answer.error}")
    if not provenance.is_oracle(backend):
        provenance.current().record(rule, method, answer.by, pid=answer.pid)
    return answer


def call_rule(backend: Any, method: str, *inputs: Any, scenario: Scenario | None = None) -> Any:
    """``backend.<method>(*inputs, scenario=scenario)`` under the exception contract
    (:mod:`pytest_kvconform.errors`): not provided or not applicable skips, anything raised
    fails this test only, naming the rule, the method, the backend and the scenario. Who
    answered is recorded (:mod:`pytest_kvconform.provenance`)."""
    answer = _ask(backend, method, *inputs, scenario=scenario)
    if answer.error is None:
        return answer.value
    exc = answer.error
    where = f" on scenario {scenario.name!r} ({scenario.source})" if scenario is not None else ""
    rule = METHOD_FAMILY.get(method, method)
    pytest.fail(f"[{rule}] backend {backend.name!r}.{method} raised{where}: {type(exc).__name__}: {exc}",
                pytrace=False)  # fmt: skip


def outcome(backend: Any, method: str, *inputs: Any, scenario: Scenario | None = None) -> tuple[str, Any]:
    """``("ok", answer)`` or ``("rejects", exception type)``: a rejection (:data:`REJECTIONS`)
    is an answer to compare with the reference's; not applicable skips."""
    answer = _ask(backend, method, *inputs, scenario=scenario)
    if answer.error is None:
        return ("ok", answer.value)
    if isinstance(answer.error, REJECTIONS):
        return ("rejects", type(answer.error).__name__)
    raise answer.error


def plan_with_trace(backend: Any, scenario: Scenario, reference: Any) -> Any:
    """The backend's plan under the exception contract. A backend that composes (its ``plan``
    is the reference's composition) is composed here step by step, each step recorded in the
    running test's ledger with who answered it; ``reference`` (the judged release's rules)
    answers the steps it declines. A backend with a ``plan`` of its own answers it whole."""
    from .reference.plan import compose_plan

    skip_if_not_provided(backend, "plan")
    if not provenance.composes_plan(backend):
        return call_rule(backend, "plan", scenario=scenario)
    try:
        return compose_plan(backend, scenario, reference)
    except RuleNotApplicable as exc:
        pytest.skip(f"[plan] backend {backend.name!r} cannot answer this input: {exc}")
    except RuleError as exc:
        message = str(exc)
    except REJECTIONS as exc:
        message = f"[plan] backend {backend.name!r} rejects {scenario.name!r}: {type(exc).__name__}: {exc}"
    pytest.fail(message, pytrace=False)


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_key(name: str, spec: Any) -> tuple[int | str, str]:
    """``(layer index, role)`` of a layer name, so ``model.layers.3.self_attn.attn`` (vLLM's
    module prefix) and ``model.layers.3.self_attn`` (the reference's) are the same layer; the
    role is ``attention``, ``indexer`` or ``state``. A name without ``layers.N`` is its own key;
    ``mtp.layers.N`` (an MTP drafter numbering its layers from 0) is ``"mtp.N"``."""
    match = _LAYER_INDEX.search(name)
    index: int | str = int(match.group(1)) if match else name
    if match and name.startswith("mtp."):  # an MTP drafter's own numbering (qwen3_next_mtp.py)
        index = f"mtp.{index}"
    if isinstance(spec, MambaSpec):
        return index, "state"
    return index, "indexer" if getattr(spec, "cache_role", "kv") == "indexer" else "attention"


def spec_fields(spec: Any) -> dict[str, Any]:
    """What a layer's spec is compared on, causes before effects: its kind and block, its
    geometry and dtypes, then the page bytes they make."""
    pages = {"page_size_bytes": spec.page_size_bytes, "real_page_size_bytes": spec.real_page_size_bytes}
    if isinstance(spec, MambaSpec):
        return {"kind": spec.kind, "block_size": spec.block_size, "shapes": tuple(map(tuple, spec.shapes)),
                "dtypes": tuple(spec.dtypes), "num_speculative_blocks": spec.num_speculative_blocks,
                **pages}  # fmt: skip
    v = (0 if spec.is_mla else spec.head_size) if spec.head_size_v is None else spec.head_size_v
    geometry = {"num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size, "head_size_v": v,
                "dtype": spec.dtype, "sliding_window": spec.sliding_window,
                "attention_chunk_size": spec.attention_chunk_size}  # fmt: skip
    return {"kind": spec.kind, "block_size": spec.block_size, **geometry,
            "bytes_per_token": spec.bytes_per_token, **pages}  # fmt: skip


def first_difference(expected: Any, got: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first place where ``got`` departs from ``expected``, as ``(path, expected, got)``:
    mappings key by key (``expected``'s order, then ``got``'s extra keys), dataclasses field by
    field, sequences item by item (``[i]``), anything else by ``==``; None when equal."""
    if dataclasses.is_dataclass(expected) and dataclasses.is_dataclass(got):
        expected, got = _fields(expected), _fields(got)
    if isinstance(expected, Mapping) and isinstance(got, Mapping):
        for key in [*expected, *(k for k in got if k not in expected)]:
            a, b = expected.get(key, _MISSING), got.get(key, _MISSING)
            diff = first_difference(a, b, f"{path}.{key}" if path else str(key))
            if diff is not None:
                return diff
        return None
    if isinstance(expected, list | tuple) and isinstance(got, list | tuple) and len(expected) == len(got):
        for i, (a, b) in enumerate(zip(expected, got, strict=True)):
            diff = first_difference(a, b, f"{path}[{i}]")
            if diff is not None:
                return diff
        return None
    return None if expected == got else (path or "value", expected, got)


def departure(rule: str, backend: Any, scenario: Scenario | None, expected: Any, got: Any) -> str | None:
    """None when ``got`` equals ``expected``, else one line naming the rule, the backend, the
    scenario and the first differing field with both values."""
    diff = first_difference(expected, got)
    if diff is None:
        return None
    where = f" on scenario {scenario.name!r} ({scenario.source})" if scenario is not None else ""
    return f"[{rule}] backend {backend.name!r}{where}: {diff[0]}: reference {diff[1]!r}, backend {diff[2]!r}"


class Departure(pytest.fail.Exception):  # type: ignore[misc,name-defined]
    """A test failure that is a departure from the reference: :func:`departure`'s line, plus the
    rule, the first differing field and both values (the report records them)."""

    __module__ = "builtins"  # shown as ``Departure: [rule] ...``, as pytest shows ``Failed: ...``

    def __init__(
        self, message: str, rule: str, field: str, reference: Any, backend: Any, pytrace: bool = True
    ) -> None:
        super().__init__(message, pytrace=pytrace)
        self.rule, self.field, self.reference, self.backend = rule, field, reference, backend

    def to_dict(self) -> dict[str, str]:
        """JSON-serialisable (it travels as a user property under xdist): the values as ``repr``."""
        return {"field": self.field, "reference": repr(self.reference), "backend": repr(self.backend)}


def assert_same(rule: str, backend: Any, scenario: Scenario | None, expected: Any, got: Any) -> None:
    """Fail the test with :func:`departure`'s line (as a :class:`Departure`) when ``got`` departs
    from ``expected``."""
    __tracebackhide__ = True  # the test's line, and hypothesis's counterexample note, stay shown
    message = departure(rule, backend, scenario, expected, got)
    if message is not None:
        field, want, have = first_difference(expected, got)  # type: ignore[misc]
        raise Departure(message, rule, field, want, have)


def _fields(value: Any) -> dict[str, Any]:
    """A dataclass's compared fields (not what a frozen spec caches on itself, nor handles)."""
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.compare}


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def first_layer_difference(
    expected: Mapping[str, Any], got: Mapping[str, Any]
) -> tuple[str, Any, Any] | None:
    """Compare two ``layer name -> spec`` maps layer by layer (:func:`layer_key`): the first
    difference as ``(field, reference, backend)``, the field naming the layer, or None."""
    want = {layer_key(n, s): spec_fields(s) for n, s in expected.items()}
    have = {layer_key(n, s): spec_fields(s) for n, s in got.items()}
    missing, extra = [k for k in want if k not in have], [k for k in have if k not in want]
    if missing or extra:
        return "layers (layer index, role)", f"missing {missing[:5]}", f"unexpected {extra[:5]}"
    for key, fields in want.items():
        diff = first_difference(fields, have[key])
        if diff is not None:
            return f"layer {key[0]} ({key[1]}): {diff[0]}", diff[1], diff[2]
    return None


def layer_spec_difference(expected: Mapping[str, Any], got: Mapping[str, Any]) -> str | None:
    """:func:`first_layer_difference` as one line, or None."""
    diff = first_layer_difference(expected, got)
    if diff is None:
        return None
    if diff[0].startswith("layers "):
        return f"layers differ: {diff[1]}, {diff[2]} (layer index, role)"
    return f"{diff[0]}: reference {diff[1]!r}, backend {diff[2]!r}"


def assert_same_layers(
    backend: Any, scenario: Scenario, expected: Mapping[str, Any], got: Mapping[str, Any]
) -> None:
    """:func:`layer_spec_difference` as a :class:`Departure` naming the backend and the scenario."""
    __tracebackhide__ = True
    diff = first_layer_difference(expected, got)
    if diff is not None:
        where = f"on scenario {scenario.name!r} ({scenario.source})"
        message = f"[layer_specs] backend {backend.name!r} {where}: {layer_spec_difference(expected, got)}"
        raise Departure(message, "layer_specs", *diff)


def known_failure(backend: Any, item: pytest.Item, extra: Mapping[str, str] | None = None) -> str | None:
    """The reason a test is a known failure of ``backend``: its ``known_failures`` data, plus
    ``extra`` entries (``--kvconform-xfails`` files).

    Keys are ``"<rule>::<test name>"`` where ``*`` in the name matches anything and every other
    character is literal (so ``[`` of a parametrize id needs no escaping), e.g.
    ``"plan::test_plan[glm-5-fp8-ds-mla]"`` or ``"hybrid_alignment::*glm-5*"``.
    """
    rule_marker = item.get_closest_marker("kvconform_rule")
    rule = rule_marker.args[0] if rule_marker is not None else ""
    return known_failure_of(backend, rule, item.name, extra)


def known_failure_of(
    backend: Any, rule: str, test: str, extra: Mapping[str, str] | None = None
) -> str | None:
    """:func:`known_failure` of the test called ``test`` (e.g. ``test_plan[glm-5-fp8-ds-mla]``)."""
    entries = {**getattr(backend, "known_failures", {}), **(extra or {})}
    for key, reason in entries.items():
        key_rule, _, pattern = key.partition("::")
        regex = ".*".join(re.escape(part) for part in (pattern or "*").split("*"))
        if key_rule == rule and re.fullmatch(regex, test):
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
        key = f"{entry['rule']}::{entry['test']}"
        if entry.get("backend", backend_name) == backend_name:
            if key in out:
                raise ValueError(f"{path}: xfail[{i}]: a second entry for {entry['test']!r}")
            out[key] = entry["reason"]
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
