"""``plan(scenario)``: every rule composed into one :class:`~pytest_kvconform.model.KVPlan`.

:func:`compose_plan` asks a rules object (the reference, or a backend) for each step and
nothing else: the block choice, the per-layer specs, the groups, the pool and admission, the
per-token pages, the kernel block and the one-sequence estimate. Each answer follows the
exception contract of :mod:`pytest_kvconform.errors`; a step the backend does not provide or
cannot answer takes the reference's answer, and the optional :class:`PlanTrace` records who
answered each step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import REJECTIONS, RuleError, RuleNotApplicable
from ..model import KVPlan
from ..scenario import Scenario
from .metal import one_sequence_tokens
from .specs import AttentionSpec, MambaSpec

if TYPE_CHECKING:
    from .releases import RuleSet
    from .rules import ReferenceRules


@dataclass(frozen=True)
class PlanStep:
    """Who answered one step of a composed plan."""

    family: str
    method: str
    #: "backend" (its own method), "inherited" (the reference's method, run on the backend's
    #: other rules), or "reference" (the backend declined; the reference's answer was used)
    answered_by: str
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.family}.{self.method}: {self.answered_by}" + (
            f" ({self.reason})" if self.reason else ""
        )


@dataclass
class PlanTrace:
    """The steps of one composed plan, in order, each recorded once."""

    steps: list[PlanStep] = field(default_factory=list)

    def record(self, step: PlanStep) -> None:
        if all((s.family, s.method) != (step.family, step.method) for s in self.steps):
            self.steps.append(step)

    def by(self, answered_by: str) -> list[PlanStep]:
        return [s for s in self.steps if s.answered_by == answered_by]


@functools.cache
def reference_rules(release: RuleSet | None = None) -> ReferenceRules:
    """The reference's rules, of ``release`` (default: the latest rule set)."""
    from .rules import ReferenceRules

    rules = ReferenceRules()
    if release is not None:
        rules.release = release
    return rules


def plan(scenario: Scenario) -> KVPlan:
    """The reference's plan of ``scenario``."""
    return reference_rules().plan(scenario=scenario)


def overrides(rules: Any, method: str) -> bool:
    """Whether ``rules`` answers ``method`` with code of its own (not the reference's)."""
    from .rules import ReferenceRules

    mine = getattr(type(rules), method, None)
    return mine is not None and mine is not getattr(ReferenceRules, method, None)


_RAISE = object()


class _Steps:
    """Calls one rule method of ``rules`` under the exception contract, recording who answered."""

    def __init__(self, rules: Any, scenario: Scenario, trace: PlanTrace | None) -> None:
        self.rules, self.scenario, self.trace = rules, scenario, trace
        self.not_provided = getattr(rules, "not_provided", {})
        self.name = getattr(rules, "name", type(rules).__name__)

    def __call__(self, family: str, method: str, *inputs: Any, rejected: Any = _RAISE) -> Any:
        reason = self.not_provided.get(family)
        reason = f"not provided: {reason}" if reason is not None else None
        if reason is None:
            try:
                value = getattr(self.rules, method)(*inputs, scenario=self.scenario)
            except RuleNotApplicable as exc:
                reason = f"not applicable: {exc}"
            except REJECTIONS:
                if rejected is _RAISE:
                    raise
                value = rejected
            except Exception as exc:
                raise RuleError(family, method, self.name, self.scenario, exc) from exc
            if reason is None:
                self._record(family, method, "backend")
                return value
        try:
            # the steps a backend declines are answered by the rules of the release it is judged by
            fallback = reference_rules(getattr(self.rules, "release", None))
            value = getattr(fallback, method)(*inputs, scenario=self.scenario)
        except REJECTIONS:
            if rejected is _RAISE:
                raise
            value = rejected
        self._record(family, method, "reference", reason or "")
        return value

    def _record(self, family: str, method: str, answered_by: str, reason: str = "") -> None:
        if self.trace is not None:
            if answered_by == "backend" and not overrides(self.rules, method):
                answered_by = "inherited"
            self.trace.record(PlanStep(family, method, answered_by, reason))


def compose_plan(rules: ReferenceRules | Any, scenario: Scenario, trace: PlanTrace | None = None) -> KVPlan:
    """Block choice -> layer specs -> groups -> pool and admission, then the per-token pages, the
    vllm-metal kernel block and one-sequence estimate, each answered by ``rules``."""
    rt = scenario.runtime
    policy = rules.policy_for(scenario)
    step = _Steps(rules, scenario, trace)
    choice = step("block_size", "choose_block_size")
    specs = step("layer_specs", "layer_specs")
    groups = step("grouping", "kv_cache_groups", specs)
    memory = step("memory", "check_memory", specs)

    attention = [s for s in specs.values() if isinstance(s, AttentionSpec)]
    kv = [s for s in attention if s.cache_role == "kv"]
    indexer = [s for s in attention if s.cache_role == "indexer"]
    states = [s for s in specs.values() if isinstance(s, MambaSpec)]
    block_size = min([g.block_size for g in groups if g.kind != "mamba"] or [g.block_size for g in groups])
    kernel_block = step("kernel_block", "kernel_block_size", block_size, rejected=0)  # 0: no kernel block

    per_token_of: dict[AttentionSpec, int] = {}

    def per_token(spec: AttentionSpec) -> int:
        if spec not in per_token_of:
            per_token_of[spec] = step("attention_page", "attention_page_bytes", spec.with_block_size(1))
        return per_token_of[spec]

    def layer_page(group: Any) -> int:
        if group.kind == "uniform_type":  # the group page sums its layers; report the largest layer
            return max(specs[name].page_size_bytes for name in group.layer_names)
        return group.page_size_bytes

    unpadded_state = dataclasses.replace(states[0], page_size_padded=None) if states else None
    state_real = step("state_page", "state_page_bytes", unpadded_state) if unpadded_state is not None else 0
    state_page = max((g.page_size_bytes for g in groups if g.kind == "mamba"), default=state_real)
    blocks_per_request = sum(g.blocks_per_request for g in groups)
    one_sequence = 0
    if not scenario.is_spec_level:
        one_sequence = step("one_sequence", "one_sequence_bytes", choice.block_size, choice.state_page_padded)
    return KVPlan(
        scenario=scenario.name,
        unify_policy=policy,
        block_size=block_size,
        kernel_block_size=kernel_block,
        kernel_blocks_per_block=block_size // kernel_block if kernel_block else 0,
        attn_bytes_per_token_per_layer=per_token(kv[0]) if kv else 0,
        indexer_bytes_per_token_per_layer=per_token(indexer[0]) if indexer else 0,
        state_bytes_per_layer=state_real,
        page_size_bytes=max(layer_page(g) for g in groups),
        state_padding_pct=round(100 * (state_page - state_real) / state_real, 4) if states else 0.0,
        kv_cache_groups=len(groups),
        group_size=max(len(g.layer_names) for g in groups),
        bytes_per_block=memory.bytes_per_block,
        kv_bytes_per_token=sum(per_token(s) * n for s, n in Counter(kv + indexer).items()),
        blocks_per_request=blocks_per_request,
        num_blocks=memory.num_blocks,
        max_concurrency=round(memory.max_concurrency, 2),
        one_sequence_tokens=one_sequence_tokens(rt.max_model_len, block_size),
        one_sequence_bytes=one_sequence,
        needed_bytes=memory.needed_bytes,
        available_bytes=memory.available_bytes,
        admission=memory.admission,
        max_model_len_estimate=memory.max_model_len_estimate,
        group_kinds=tuple(g.kind for g in groups),
    )
