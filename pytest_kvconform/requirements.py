"""What a backend does not do, and where it knowingly departs: declared once per backend.

Modelled on SQLAlchemy's testing ``Requirements`` class (one place per dialect says what it does
not support, and every test reads it): a backend declares

* :class:`Declines`: the rule families it has no code for, and the kinds of input (:class:`InputKind`)
  it does not serve, per rule family; every test of such a rule on such an input ends *declined*
  with that reason, and a composed plan takes the reference's answer for that step (reported);
* :class:`KnownDeparture`: where its answer differs from the reference's on purpose or by a
  known bug: the rule, the tests (a name glob) or the input kind, and the field it departs in.
  Such a test departs in that field or fails; a known departure that no longer happens fails too.

Input kinds are computed from the scenario by the harness (:data:`INPUT_KINDS`); a backend may
define kinds of its own (an :class:`InputKind` with a predicate) for its declarations.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from .scenario import Scenario


@dataclass(frozen=True)
class InputKind:
    """A kind of input, decided from the scenario: ``MLA(scenario)`` is True for an MLA model."""

    name: str
    description: str
    applies: Callable[[Scenario], bool] = field(compare=False, repr=False)

    def __call__(self, scenario: Scenario | None) -> bool:
        return scenario is not None and bool(self.applies(scenario))


def _spec_level(s: Scenario) -> bool:
    return s.is_spec_level


def _mla(s: Scenario) -> bool:
    return s.model is not None and s.model.use_mla


def _sparse_attention(s: Scenario) -> bool:
    return (
        s.model is not None
        and s.model.use_mla
        and bool(s.model.attention and s.model.attention.indexer_head_dim)
    )


def _hybrid(s: Scenario) -> bool:
    return s.model is not None and s.model.is_hybrid


def _state(s: Scenario) -> bool:
    return s.model is not None and s.model.num_state_layers > 0


def _sliding_window(s: Scenario) -> bool:
    return s.model is not None and "S" in s.model.layers


def _no_paged_attention(s: Scenario) -> bool:
    return s.model is None or s.model.attention is None or s.model.num_attention_layers == 0


def _no_kv_cache(s: Scenario) -> bool:
    return s.model is not None and not s.model.num_attention_layers and not s.model.num_state_layers


def _quantized_kv(s: Scenario) -> bool:
    return s.runtime.kv_cache_dtype not in ("auto", s.model.dtype if s.model is not None else "auto")


def _tensor_parallel(s: Scenario) -> bool:
    return s.runtime.tensor_parallel_size > 1


def _pipeline_parallel(s: Scenario) -> bool:
    return s.runtime.pipeline_parallel_size > 1


def _speculative(s: Scenario) -> bool:
    return s.runtime.num_speculative_tokens > 0


def _registered_kv_cache_dtype(s: Scenario) -> bool:
    return s.runtime.kv_cache_dtype in dict(s.runtime.registered_kv_cache_dtypes)


def _unify_policy(s: Scenario) -> bool:
    return s.runtime.unify_policy != "pad-to-max"


# Predicates are module-level functions, so a declaration pickles (a backend in its own process).
SPEC_LEVEL = InputKind("spec_level", "a spec-level scenario (its pages named, no model)", _spec_level)
MLA = InputKind("mla", "an MLA model (one latent per token)", _mla)
SPARSE_ATTENTION = InputKind(
    "sparse_attention", "MLA with a sparse-attention indexer (DeepSeek-V3.2, GLM-5)", _sparse_attention
)
HYBRID = InputKind("hybrid", "attention layers next to state layers (Mamba, GDN, KDA, short conv)", _hybrid)
STATE = InputKind("state", "state layers (Mamba, GDN, KDA, short conv)", _state)
SLIDING_WINDOW = InputKind("sliding_window", "sliding-window attention layers", _sliding_window)
NO_PAGED_ATTENTION = InputKind(
    "no_paged_attention",
    "no paged attention layer (attention-free, or a spec-level scenario)",
    _no_paged_attention,
)
NO_KV_CACHE = InputKind(
    "no_kv_cache", "no layer holds a KV cache (an encoder-only model: vLLM plans one block)", _no_kv_cache
)
QUANTIZED_KV = InputKind(
    "quantized_kv", "a kv_cache_dtype other than the model's (fp8, int8, packed formats)", _quantized_kv
)
TENSOR_PARALLEL = InputKind("tensor_parallel", "tensor_parallel_size > 1", _tensor_parallel)
PIPELINE_PARALLEL = InputKind("pipeline_parallel", "pipeline_parallel_size > 1", _pipeline_parallel)
SPECULATIVE = InputKind("speculative", "speculative decoding (num_speculative_tokens > 0)", _speculative)
REGISTERED_KV_CACHE_DTYPE = InputKind(
    "registered_kv_cache_dtype", "a kv_cache_dtype a platform registers (register_kv_cache_dtype)",
    _registered_kv_cache_dtype,
)  # fmt: skip
POLICY_NOT_PAD_TO_MAX = InputKind(
    "unify_policy", "a page unification policy other than vLLM's pad-to-max (scale-only, lcm)", _unify_policy
)

#: the input kinds the harness knows, by name (``--kvconform-xfails`` entries name them in ``when``)
INPUT_KINDS: dict[str, InputKind] = {
    k.name: k
    for k in (
        SPEC_LEVEL,
        MLA,
        SPARSE_ATTENTION,
        HYBRID,
        STATE,
        SLIDING_WINDOW,
        NO_PAGED_ATTENTION,
        NO_KV_CACHE,
        QUANTIZED_KV,
        TENSOR_PARALLEL,
        PIPELINE_PARALLEL,
        SPECULATIVE,
        REGISTERED_KV_CACHE_DTYPE,
        POLICY_NOT_PAD_TO_MAX,
    )
}

#: a rule family, ``*`` (every family), optionally with the kind of input it applies to
DeclineKey = str | tuple[str, InputKind]


class Declines:
    """Rule families a backend has no code for (or one method of a family, ``"family.method"``),
    and input kinds it does not serve, each with the reason: ``Declines({"one_sequence": "vLLM
    core has no such estimate", ("allocation", TENSOR_PARALLEL): "one device holds every head"})``.
    ``a | b`` adds ``b``'s entries; ``a.without("allocation")`` drops a family's."""

    def __init__(self, entries: Mapping[DeclineKey, str] | None = None) -> None:
        self.entries: dict[DeclineKey, str] = dict(entries or {})
        for key, reason in self.entries.items():
            rule = key if isinstance(key, str) else key[0]
            if not isinstance(reason, str) or not reason:
                raise ValueError(f"Declines[{key!r}]: the reason must be a non-empty string")
            if not isinstance(rule, str) or (not isinstance(key, str) and not isinstance(key[1], InputKind)):
                raise ValueError(f"Declines: key {key!r}: expected a rule family or (family, InputKind)")

    def reason(self, rule: str, scenario: Scenario | None = None, method: str = "") -> str | None:
        """Why the backend declines ``rule`` (or its ``method``: a key ``"family.method"``) on
        ``scenario``, or None."""
        for key, why in self.entries.items():
            if isinstance(key, str):
                if key in (rule, "*") or (method and key == f"{rule}.{method}"):
                    return f"does not provide {key if '.' in key else rule}: {why}"
            elif key[0] in (rule, "*") and key[1](scenario):
                return f"does not serve {key[1].description} ({key[1].name}) for {rule}: {why}"
        return None

    def families(self) -> dict[str, str]:
        """The rule families declined whole, with their reasons."""
        return {key: why for key, why in self.entries.items() if isinstance(key, str)}

    def __or__(self, other: Declines) -> Declines:
        return Declines({**self.entries, **other.entries})

    def without(self, *rules: str) -> Declines:
        return Declines(
            {
                k: v
                for k, v in self.entries.items()
                if (k if isinstance(k, str) else k[0]).partition(".")[0] not in rules
            }
        )

    def __repr__(self) -> str:
        return f"Declines({self.entries!r})"


def _glob(pattern: str) -> re.Pattern[str]:
    """``*`` matches anything; every other character is literal (``[`` of a test id too)."""
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")), re.DOTALL)


@dataclass(frozen=True)
class KnownDeparture:
    """A departure the backend is known to make: in ``rule``'s tests named like ``test`` (``*``
    matches anything) or on inputs of kind ``when``, the first differing field is ``field`` (a
    glob) and, where given, the values are ``reference`` and ``value`` (as shown in reports)."""

    rule: str
    field: str
    reason: str
    test: str = "*"
    when: InputKind | None = None
    reference: str | None = None
    value: str | None = None
    #: the plugin departs on purpose and documents why (not a bug; reports say so)
    deliberate: bool = False

    def covers(self, rule: str, test: str, scenario: Scenario | None) -> bool:
        """Whether this entry is about that test (of that rule, on that input)."""
        if self.rule not in (rule, "*") or not _glob(self.test).fullmatch(test):
            return False
        return self.when is None or self.when(scenario)

    def matches(self, difference: Mapping[str, str]) -> bool:
        """Whether a departure (``field``, ``reference``, ``backend``, values as ``repr``) is this one."""
        if not _glob(self.field).fullmatch(str(difference.get("field", ""))):
            return False
        return all(
            want is None or _same_value(want, str(difference.get(key, "")))
            for want, key in ((self.reference, "reference"), (self.value, "backend"))
        )

    def describe(self) -> str:
        values = ", ".join(
            f"{who} {v}" for who, v in (("reference", self.reference), ("backend", self.value)) if v
        )
        values = f" ({values})" if values else ""
        why = f"deliberate: {self.reason}" if self.deliberate else self.reason
        return f"departs in {self.field}{values}: {why}"


def _same_value(want: str, shown: str) -> bool:
    """A stated value (``*`` globs) against a report's ``repr``: ``16`` matches ``16``, ``abc``
    matches ``'abc'``."""
    pattern = _glob(want)
    return bool(pattern.fullmatch(shown) or pattern.fullmatch(shown.strip("'\"")))


def known_departures_for(
    entries: Iterable[KnownDeparture], rule: str, test: str, scenario: Scenario | None
) -> list[KnownDeparture]:
    """The entries about one test (several may pin different fields of it)."""
    return [e for e in entries if e.covers(rule, test, scenario)]
