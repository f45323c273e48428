"""Running rules on a backend and comparing them with the reference.

Used by the shipped suites and by downstream repos (``check_scenario``) that want the same
checks on their own scenario files. Every call of a backend goes through :func:`ask`, which
records who answered (:mod:`pytest_kvconform.provenance`) and turns what the backend raised into
how the test ends (:mod:`pytest_kvconform.verdict`): a declared decline or an offline gap is
:class:`~pytest_kvconform.verdict.Declined`, a rejection is an answer compared by kind
(:mod:`pytest_kvconform.rejections`), anything else is :class:`~pytest_kvconform.verdict.Crashed`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import provenance
from .backends.base import METHOD_FAMILY, RULE_FAMILIES
from .errors import RuleError
from .gaps import OfflineGap
from .reference.parallel import DRAFTER_PREFIX, LAYER_INDEX
from .reference.releases import LATEST, rule_set
from .reference.rules import reference_rules
from .reference.specs import MambaSpec
from .rejections import rejection_kind
from .requirements import INPUT_KINDS, KnownDeparture
from .scenario import Scenario, load_scenario
from .verdict import Crashed, Declined, Departure, NotApplicable, summary

__all__ = [
    "RULE_FAMILIES",
    "Declined",
    "Departure",
    "Difference",
    "NotApplicable",
    "ask",
    "assert_same",
    "assert_same_layers",
    "assert_same_outcome",
    "call_rule",
    "check_scenario",
    "declined_reason",
    "departure",
    "first_difference",
    "layer_spec_difference",
    "load_xfails",
    "message_view",
    "outcome",
    "plan_outcome",
    "plan_view",
    "served",
]


def declined_reason(
    backend: Any, rule: str, scenario: Scenario | None = None, method: str = ""
) -> str | None:
    """Why ``backend`` declines ``rule`` (its ``method``, on ``scenario``), from its declared
    ``declines``; None when it answers it. The reference never declines as the oracle."""
    if provenance.is_oracle(backend):
        return None
    declines = getattr(backend, "declines", None)
    return declines.reason(rule, scenario, method) if declines is not None else None


def decline_if_declared(backend: Any, rule: str, scenario: Scenario | None = None, method: str = "") -> None:
    """End the test as declined when ``backend`` declares that it does not do ``rule`` here."""
    reason = declined_reason(backend, rule, scenario, method)
    if reason is not None:
        if not provenance.is_oracle(backend):
            provenance.current().record(rule, method or rule, provenance.REFERENCE, reason)
        raise Declined(f"[{rule}] backend {backend.name!r} {reason}")


def ask(backend: Any, method: str, *inputs: Any, scenario: Scenario | None = None) -> provenance.Answer:
    """The backend's answer, recorded in the running test's ledger with who gave it. A declared
    decline or an offline gap ends the test as declined; anything raised is kept in the answer."""
    rule = METHOD_FAMILY.get(method, method)
    decline_if_declared(backend, rule, scenario, method)
    answer = provenance.ask(backend, method, *inputs, scenario=scenario)
    oracle = provenance.is_oracle(backend)
    if isinstance(answer.error, OfflineGap):
        if not oracle:
            provenance.current().record(rule, method, provenance.REFERENCE, str(answer.error), pid=answer.pid)
        raise Declined(f"[{rule}] backend {backend.name!r} cannot run this here: {answer.error}")
    if not oracle:
        provenance.current().record(rule, method, answer.by, pid=answer.pid)
    return answer


def _where(scenario: Scenario | None) -> str:
    return f" on scenario {scenario.name!r} ({scenario.source})" if scenario is not None else ""


def crash(rule: str, backend: Any, method: str, scenario: Scenario | None, error: BaseException) -> Crashed:
    """The test's end when a call raised outside the contract: rule, backend, method, scenario,
    the exception's one-line summary and where it was raised."""
    name = getattr(backend, "name", type(backend).__name__)
    return Crashed(
        f"[{rule}] backend {name!r}.{method} raised{_where(scenario)}: {summary(error)}", pytrace=False
    )


def outcome(backend: Any, method: str, *inputs: Any, scenario: Scenario | None = None) -> tuple[str, Any]:
    """``("ok", answer)`` or ``("rejects", kind)`` (:data:`~pytest_kvconform.rejections.KINDS`):
    a rejection is an answer, compared by kind with the reference's. Anything else raised crashes
    the test; the reference rejecting an input it does not model makes the test not applicable.
    A backend's ``plan`` is composed step by step where it composes (:func:`plan_outcome`)."""
    if method == "plan" and scenario is not None and not provenance.is_oracle(backend):
        return plan_outcome(backend, scenario)
    return _outcome(backend, method, ask(backend, method, *inputs, scenario=scenario), scenario)


def _outcome(
    backend: Any, method: str, answer: provenance.Answer, scenario: Scenario | None
) -> tuple[str, Any]:
    if answer.error is None:
        return ("ok", answer.value)
    kind = rejection_kind(answer.error)
    if kind is None:
        raise crash(METHOD_FAMILY.get(method, method), backend, method, scenario, answer.error)
    if kind == "not_modelled" and provenance.is_oracle(backend):
        raise NotApplicable(f"the reference does not model this input: {answer.error}")
    return ("rejects", kind)


def call_rule(backend: Any, method: str, *inputs: Any, scenario: Scenario | None = None) -> Any:
    """``backend.<method>(*inputs, scenario=scenario)``, where an answer is expected: a rejection
    departs (field ``rejection``), anything else raised crashes the test."""
    kind, value = outcome(backend, method, *inputs, scenario=scenario)
    if kind == "ok":
        return value
    rule = METHOD_FAMILY.get(method, method)
    assert_same(rule, backend, scenario, {method: "answers"}, {method: f"rejects: {value}"})


def plan_outcome(backend: Any, scenario: Scenario, reference: Any = None) -> tuple[str, Any]:
    """The backend's plan as :func:`outcome` gives it. A backend that composes (its ``plan`` is the
    reference's composition) is composed here step by step, each step recorded in the running
    test's ledger with who answered it; ``reference`` (default: the reference of the backend's
    judged release) answers the steps it declines. A backend with a ``plan`` of its own answers
    it whole."""
    from .reference.plan import compose_plan
    from .reference.rules import reference_rules

    decline_if_declared(backend, "plan", scenario)
    if not provenance.composes_plan(backend):
        return _outcome(backend, "plan", ask(backend, "plan", scenario=scenario), scenario)
    if reference is None:
        reference = reference_rules(getattr(backend, "release", None) or LATEST)
    try:
        return ("ok", compose_plan(backend, scenario, reference))
    except RuleError as exc:
        raise crash(exc.family, backend, exc.method, scenario, exc.error) from None
    except Exception as exc:
        kind = rejection_kind(exc)
        if kind is None:  # the reference's code, composing
            raise crash("plan", backend, "plan", scenario, exc) from None
        return ("rejects", kind)


def numbers_apply(backend: Any, scenario: Scenario, reference: Any = None) -> None:
    """Numbers a scenario states (its ``[expect]``, a regression's literals and golden) hold for
    its ``kernel_block_alignment``. When the backend's attention kernel declares another and the
    reference's plan at that alignment differs, they are not the backend's to meet: not
    applicable, naming the field that moves."""
    if provenance.is_oracle(backend):
        return
    from .reference.rules import reference_rules

    rules = reference or reference_rules(getattr(backend, "release", None) or LATEST)
    status, alignment = outcome(backend, "kernel_block_alignment", scenario=scenario)
    if status != "ok" and outcome(rules, "kernel_block_alignment", scenario=scenario) == (status, alignment):
        return  # both refuse the input alike (a setting the release does not take): the test compares that
    alignment = call_rule(backend, "kernel_block_alignment", scenario=scenario)  # a refusal alone departs
    stated = scenario.runtime.kernel_block_alignment
    if alignment == stated:
        return
    plans = [
        outcome(rules, "plan", scenario=s)
        for s in (scenario, scenario.with_runtime(kernel_block_alignment=alignment))
    ]
    views = [(kind, plan_view(value) if kind == "ok" else value) for kind, value in plans]
    moved = first_difference(views[0], views[1])
    if moved is not None:
        raise NotApplicable(
            f"the numbers {scenario.name!r} states are for kernel_block_alignment {stated}; backend "
            f"{backend.name!r}'s attention kernel declares {alignment}, where the reference's plan moves "
            f"({moved[0]}: {moved[1]!r} -> {moved[2]!r})"
        )


def served(backend: Any, scenario: Scenario) -> Scenario:
    """``scenario`` as the backend serves it: at the kernel block alignment its attention kernel
    declares (``kernel_block_alignment``), which the reference then plans at too. The scenario
    file's alignment describes the hardware it was written for, not a plugin's. Where the backend
    refuses the input before it has a kernel (a TP split), the scenario as it is."""
    if provenance.is_oracle(backend) or declined_reason(
        backend, "block_size", scenario, "kernel_block_alignment"
    ):
        return scenario
    status, alignment = outcome(backend, "kernel_block_alignment", scenario=scenario)
    if status != "ok" or alignment == scenario.runtime.kernel_block_alignment:
        return scenario  # an engine that refuses the input: the test compares the refusal
    return scenario.with_runtime(kernel_block_alignment=int(alignment))


#: KVPlan fields that hold vLLM's words: compared by their kind and numbers, not their wording
MESSAGE_FIELDS = ("admission", "auto_fit_message")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def message_view(text: str) -> str:
    """A message as the comparison sees it: ``ok`` (or empty), else its rejection kind and the
    numbers in it. The device a plugin names ("1.0 GiB CPU", "GiB GPU") or a reworded sentence
    is not sizing; the decision and the numbers are."""
    if text in ("", "ok"):
        return text
    kind = rejection_kind(ValueError(text)) or "message"
    return f"{kind}: {' '.join(_NUMBER.findall(text))}"


def plan_view(plan: Any) -> dict[str, Any]:
    """A plan (a ``KVPlan`` or its ``to_dict()``) as compared: :data:`MESSAGE_FIELDS` by
    :func:`message_view`, the rest as they are."""
    d = dict(plan.to_dict() if hasattr(plan, "to_dict") else plan)
    for name in MESSAGE_FIELDS:
        if isinstance(d.get(name), str):
            d[name] = message_view(d[name])
    return d


def layer_key(name: str, spec: Any) -> tuple[int | str, str]:
    """``(layer index, role)`` of a layer name, so ``model.layers.3.self_attn.attn`` (vLLM's
    module prefix) and ``model.layers.3.self_attn`` (the reference's) are the same layer; the
    role is ``attention``, ``indexer`` or ``state``. A name without ``layers.N`` is its own key;
    ``mtp.layers.N`` (an MTP drafter numbering its layers from 0) is ``"mtp.N"``."""
    match = LAYER_INDEX.search(name)
    index: int | str = int(match.group(1)) if match else name
    if match and name.startswith(DRAFTER_PREFIX):  # an MTP drafter's own numbering (qwen3_next_mtp.py)
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


def assert_same(rule: str, backend: Any, scenario: Scenario | None, expected: Any, got: Any) -> None:
    """Fail the test with :func:`departure`'s line (as a :class:`Departure`) when ``got`` departs
    from ``expected``."""
    __tracebackhide__ = True  # the test's line, and hypothesis's counterexample note, stay shown
    message = departure(rule, backend, scenario, expected, got)
    if message is not None:
        field, want, have = first_difference(expected, got)  # type: ignore[misc]
        raise Departure(message, rule, field, want, have)


def assert_same_outcome(
    rule: str,
    backend: Any,
    scenario: Scenario | None,
    key: str,
    expected: tuple[str, Any],
    got: tuple[str, Any],
    view: Any = None,
) -> None:
    """Compare two :func:`outcome` answers: when either rejects, ``key`` is ``rejects: <kind>``
    or ``answers`` on each side; when both answer, their values (through ``view``, if given)."""
    __tracebackhide__ = True
    if expected[0] != "ok" or got[0] != "ok":
        shown = ({key: f"rejects: {a[1]}" if a[0] != "ok" else "answers"} for a in (expected, got))
        assert_same(rule, backend, scenario, *shown)
        return
    want, have = (view(a[1]) if view is not None else a[1] for a in (expected, got))
    assert_same(
        rule, backend, scenario, {key: want} if view is None else want, {key: have} if view is None else have
    )


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


#: the keys of an ``[[xfail]]`` table (``--kvconform-xfails``)
#: a known departure is a bug, or a difference the plugin makes on purpose and documents
KINDS_OF_DEPARTURE = ("bug", "deliberate")
XFAIL_KEYS = ("backend", "rule", "test", "when", "field", "reference", "value", "kind", "reason")


def load_xfails(path: Path, backend_name: str) -> list[KnownDeparture]:
    """Known departures kept as data, outside the backend's code (``--kvconform-xfails``)::

        [[xfail]]
        backend = "metal"              # optional: only for this backend
        rule = "plan"
        test = "test_plan[glm-5-*]"    # ``*`` matches anything (or ``when``, an input kind)
        field = "bytes_per_block"      # the field it departs in (``*`` globs)
        reference = "1152"             # optional: the reference's value, as reports show it
        value = "656"                  # optional: the backend's value
        kind = "deliberate"            # optional: "bug" (default) or "deliberate" (the plugin
                                       # departs on purpose and documents it; reports list it apart)
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
    out: list[KnownDeparture] = []
    for i, entry in enumerate(entries):
        where = f"{path}: xfail[{i}]"
        if not isinstance(entry, dict) or set(entry) - set(XFAIL_KEYS):
            unknown = sorted(set(entry) - set(XFAIL_KEYS)) if isinstance(entry, dict) else entry
            raise ValueError(f"{where}: unknown key(s) {unknown}; expected {', '.join(XFAIL_KEYS)}")
        if any(not isinstance(v, str) for v in entry.values()):
            raise ValueError(f"{where}: every value must be a string")
        missing = [k for k in ("rule", "field", "reason") if not entry.get(k)]
        if missing:
            raise ValueError(f"{where}: {', '.join(missing)} missing (a known departure names its field)")
        if entry["rule"] not in (*RULE_FAMILIES, "*"):
            raise ValueError(f"{where}.rule: expected * or one of {', '.join(RULE_FAMILIES)}")
        if "test" not in entry and "when" not in entry:
            raise ValueError(f"{where}: give the tests (test = glob) or the input kind (when)")
        when = entry.get("when")
        if when is not None and when not in INPUT_KINDS:
            raise ValueError(f"{where}.when: expected one of {', '.join(INPUT_KINDS)}")
        if entry.get("kind", "bug") not in KINDS_OF_DEPARTURE:
            raise ValueError(f"{where}.kind: expected one of {', '.join(KINDS_OF_DEPARTURE)}")
        if entry.get("backend", backend_name) != backend_name:
            continue
        out.append(
            KnownDeparture(
                rule=entry["rule"],
                field=entry["field"],
                reason=entry["reason"],
                test=entry.get("test", "*"),
                when=INPUT_KINDS[when] if when else None,
                reference=entry.get("reference"),
                value=entry.get("value"),
                deliberate=entry.get("kind") == "deliberate",
            )
        )
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


def check_scenario(
    scenario: Scenario | str | Path, backend: Any, release: str | None = None
) -> list[Difference]:
    """Compare ``backend.plan`` with the reference's plan under ``release``'s rules (a vLLM
    version such as ``"0.30"``; default: the backend's ``release`` where it has one, else the
    newest), field by field (messages by their kind and numbers, :func:`plan_view`).

    For downstream repos: ``assert not check_scenario("my-model.toml", MyBackend(), "0.32")``.
    A malformed file raises :class:`~pytest_kvconform.scenario.ScenarioError`; a version with no
    rule set, ``ValueError``.
    """
    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario)
    rules = reference_rules(rule_set(release) if release else getattr(backend, "release", None))
    expected = plan_view(rules.plan(scenario=scenario))
    got = plan_view(backend.plan(scenario))
    return [
        Difference(scenario.name, k, expected[k], got.get(k)) for k in expected if expected[k] != got.get(k)
    ]
