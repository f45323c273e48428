"""A plan is a trace: :func:`compose_plan` runs the engine's sizing steps in the engine's order,
each answered by a rules object (the reference, or a backend), and records every step.

The steps (:data:`STEPS`): the engine's defaults for the settings the scenario leaves unset
(:mod:`.defaults`), the platform's config hook, the block choice (the hybrid alignment,
then the cache config after ``update_block_size_for_backend``), the worker's layer specs and
their per-token pages, unification, the groups, the worker's available memory, the pool and
admission check, the runner's kernel block of each group, vllm-metal's one-sequence estimate and
kernel block, and the allocation of one pool block. Each :class:`Step` holds its value, the vLLM
(or vllm-metal) function it mirrors and who answered (:mod:`pytest_kvconform.provenance`): the
backend's own code, the reference's code running for it, or the reference of the same release
because the backend declined. Each answer
follows the exception contract of :mod:`pytest_kvconform.errors`.

This module does not import :mod:`.rules`: the rules that answer a declined step come in as
``fallback``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import provenance
from ..errors import RuleError
from ..gaps import OfflineGap
from ..model import KVPlan
from ..rejections import rejection_kind
from ..scenario import Scenario
from .metal import one_sequence_tokens
from .specs import AttentionSpec, MambaSpec


def planning_module(release: str) -> str:
    """The module of vLLM's KV cache planning in ``release`` (split out of kv_cache_utils in 0.33)."""
    major, minor = map(int, release.split(".")[:2])
    return "vllm/v1/core/" + ("kv_cache_planning.py" if (major, minor) >= (0, 33) else "kv_cache_utils.py")


#: step -> (rule family, method, the function it mirrors; ``{planning}`` is the release's module)
STEPS: dict[str, tuple[str, str, str]] = {
    "engine defaults": ("platform", "engine_defaults",
                        "vllm/engine/arg_utils.py::EngineArgs."
                        "_set_default_chunked_prefill_and_prefix_caching_args, "
                        "vllm/model_executor/models/config.py::MambaModelConfig.verify_and_update_config, "
                        "vllm/config/vllm.py::VllmConfig.__post_init__ (async_scheduling is None)"),
    "platform config": ("platform", "check_and_update_config",
                        "vllm/platforms/interface.py::Platform.check_and_update_config"),
    "hybrid alignment": ("hybrid_alignment", "align_hybrid_block_size",
                         "vllm/platforms/interface.py::Platform._align_hybrid_block_size"),
    "block choice": ("block_size", "choose_block_size",
                     "vllm/platforms/interface.py::Platform.update_block_size_for_backend "
                     "(Phase 3: _align_heterogeneous_kv_block_size)"),
    "layer specs": ("layer_specs", "layer_specs",
                    "vllm/v1/worker/gpu_model_runner.py::GPUModelRunner.get_kv_cache_spec"),
    "attention page": ("attention_page", "attention_page_bytes",
                       "vllm/v1/kv_cache_interface.py::AttentionSpec.page_size_bytes"),
    "state page": ("state_page", "state_page_bytes",
                   "vllm/v1/kv_cache_interface.py::MambaSpec.page_size_bytes"),
    "unification": ("unification", "unify_page_sizes", "{planning}::unify_kv_cache_spec_page_size"),
    "groups": ("grouping", "kv_cache_groups", "{planning}::get_kv_cache_groups"),
    "available memory": ("memory", "determine_available_memory",
                         "vllm/v1/worker/gpu_worker.py::Worker.determine_available_memory"),
    "pool and admission": ("memory", "check_memory",
                           "{planning}::get_kv_cache_configs, _auto_fit_max_model_len, "
                           "_check_enough_kv_cache_memory, _estimate_max_model_len_from_groups"),
    "kernel block sizes": ("block_size", "kernel_block_sizes",
                           "vllm/v1/worker/utils.py::prepare_kernel_block_sizes (select_common_block_size)"),
    "one-sequence estimate": ("one_sequence", "one_sequence_bytes",
                              "vllm-metal v1/cache_policy.py::estimate_one_sequence_kv_bytes"),
    "kernel block": ("kernel_block", "kernel_block_size",
                     "vllm-metal attention/impls/sdpa.py::_pick_kernel_block_size"),
    "allocation": ("allocation", "allocate_kv_cache",
                   "vllm/v1/worker/gpu_model_runner.py::GPUModelRunner.initialize_kv_cache (one block)"),
}  # fmt: skip


@dataclass(frozen=True)
class Step:
    """One step of a composed plan: what it computed and who computed it."""

    title: str
    family: str
    method: str
    mirrors: str
    #: "backend" (its own code), "inherited" (the reference's code, run for the backend) or
    #: "reference" (the backend declined; the reference of its release answered)
    answered_by: str
    value: Any
    reason: str = ""
    #: the rejection's kind (``rejections.KINDS``) when the rules rejected the input (``value`` is then None)
    rejected: str = ""

    def __str__(self) -> str:
        return f"{self.family}.{self.method}: {self.answered_by}" + (
            f" ({self.reason})" if self.reason else ""
        )


@dataclass
class PlanTrace:
    """The steps of one composed plan, in the engine's order, and the scenario they planned."""

    scenario: Scenario | None = None
    release: str = ""
    steps: list[Step] = field(default_factory=list)
    plan: KVPlan | None = None

    def by(self, answered_by: str) -> list[Step]:
        return [s for s in self.steps if s.answered_by == answered_by]

    def step(self, title: str) -> Step | None:
        return next((s for s in self.steps if s.title == title), None)


_RAISE = object()


class _Asker:
    """Asks ``rules`` for one step under the exception contract; records the step."""

    def __init__(self, rules: Any, fallback: Any, scenario: Scenario, trace: PlanTrace) -> None:
        self.rules, self.fallback, self.scenario, self.trace = rules, fallback, scenario, trace
        self.declines = getattr(rules, "declines", None)
        self.name = getattr(rules, "name", type(rules).__name__)
        self.ledger = provenance.current()
        self.oracle = provenance.is_oracle(rules)

    def __call__(self, title: str, *inputs: Any, rejected: Any = _RAISE, record: bool = True) -> Any:
        family, method, mirrors = STEPS[title]
        mirrors = mirrors.format(planning=planning_module(self.trace.release))
        reason = self.declines.reason(family, self.scenario, method) if self.declines is not None else None
        answer: provenance.Answer | None = None
        if reason is None:
            answer = provenance.ask(self.rules, method, *inputs, scenario=self.scenario)
            if isinstance(answer.error, OfflineGap):
                reason, answer = f"cannot run here: {answer.error}", None
            elif answer.error is not None and rejection_kind(answer.error) is None:
                exc = answer.error
                raise RuleError(family, method, self.name, self.scenario, exc) from exc
        if answer is None:  # declined: the rules of the release the backend is judged by answer
            answer = provenance.ask(self.fallback, method, *inputs, scenario=self.scenario)
            answer = dataclasses.replace(answer, by=provenance.REFERENCE)
        if not self.oracle:
            self.ledger.record(family, method, answer.by, reason or "", pid=answer.pid)
        value = answer.value
        if answer.error is not None:  # a rejection
            if rejected is _RAISE:
                raise answer.error
            value = rejected
        if record:
            self.trace.steps.append(Step(
                title, family, method, mirrors, answer.by, value, reason or "",
                (rejection_kind(answer.error) or "") if answer.error is not None else "",
            ))  # fmt: skip
        return value


def compose_plan(rules: Any, scenario: Scenario, fallback: Any, trace: PlanTrace | None = None) -> KVPlan:
    """The engine's sizing steps of ``scenario``, each answered by ``rules`` (``fallback`` for a
    step it declines), as one :class:`~pytest_kvconform.model.KVPlan`; ``trace`` receives the
    steps."""
    trace = trace if trace is not None else PlanTrace()
    trace.release = fallback.release.release
    trace.scenario = scenario
    step = _Asker(rules, fallback, scenario, trace)

    defaulted = step("engine defaults")  # what the file leaves unset, as `vllm serve` sets it
    scenario = step.scenario = trace.scenario = defaulted if isinstance(defaulted, Scenario) else scenario
    configured = step("platform config")
    scenario = step.scenario = configured if isinstance(configured, Scenario) else scenario
    policy = rules.policy_for(scenario)
    step("hybrid alignment")
    choice = step("block choice")
    specs = step("layer specs")

    attention = [s for s in specs.values() if isinstance(s, AttentionSpec)]
    kv = [s for s in attention if s.cache_role == "kv"]
    indexer = [s for s in attention if s.cache_role == "indexer"]
    states = [s for s in specs.values() if isinstance(s, MambaSpec)]
    per_token_of: dict[AttentionSpec, int] = {}

    def per_token(spec: AttentionSpec) -> int:
        if spec not in per_token_of:
            first = not per_token_of
            if spec.page_size_padded is None:
                per_token_of[spec] = step("attention page", spec.with_block_size(1), record=first)
            else:  # a page fixed by the backend (a plugin's own layout) holds block_size tokens
                per_token_of[spec] = step("attention page", spec, record=first) // spec.block_size
        return per_token_of[spec]

    attn_per_token = per_token(kv[0]) if kv else 0
    indexer_per_token = per_token(indexer[0]) if indexer else 0
    kv_bytes_per_token = sum(per_token(s) * n for s, n in Counter(kv + indexer).items())
    unpadded_state = dataclasses.replace(states[0], page_size_padded=None) if states else None
    state_real = step("state page", unpadded_state) if unpadded_state is not None else 0

    step("unification", specs, rejected=None)  # grouping unifies again (and raises its rejection)
    groups = step("groups", specs)
    if groups:  # EngineCore._initialize_kv_caches probes the worker only when there is a KV cache
        available = step("available memory")
        if available != scenario.runtime.kv_cache_memory_bytes:  # the worker's probe feeds the pool
            scenario = step.scenario = scenario.with_runtime(kv_cache_memory_bytes=available)
    memory = step("pool and admission", specs)
    step("kernel block sizes", groups)  # the runner's, before it allocates: refuses an unserved block

    # the scheduler's block: the smallest group block (attention first); no groups: the cache config's
    block_size = min(
        [g.block_size for g in groups if g.kind != "mamba"]
        or [g.block_size for g in groups]
        or [choice.block_size]
    )
    one_sequence = 0
    if not scenario.is_spec_level:
        one_sequence = step("one-sequence estimate", choice.block_size, choice.state_page_padded)
    kernel_block = step("kernel block", block_size, rejected=0)  # 0: no kernel block

    state_page = max((g.page_size_bytes for g in groups if g.kind == "mamba"), default=state_real)

    def layer_page(group: Any) -> int:
        if group.kind == "uniform_type":  # the group page sums its layers; report the largest layer
            return max(specs[name].page_size_bytes for name in group.layer_names)
        return group.page_size_bytes

    rt = scenario.runtime
    # max_model_len = -1: auto-fit chose the length the engine serves; what one request needs follows it
    fitted = memory.max_model_len if memory.max_model_len not in (None, rt.max_model_len) else None
    blocks_per_request = sum(g.blocks_per_request for g in groups)
    if fitted is not None:
        blocks_per_request = memory.needed_bytes // memory.bytes_per_block
    plan = KVPlan(
        scenario=scenario.name,
        unify_policy=policy,
        block_size=block_size,
        kernel_block_size=kernel_block,
        kernel_blocks_per_block=block_size // kernel_block if kernel_block else 0,
        attn_bytes_per_token_per_layer=attn_per_token,
        indexer_bytes_per_token_per_layer=indexer_per_token,
        state_bytes_per_layer=state_real,
        page_size_bytes=max((layer_page(g) for g in groups), default=0),
        state_padding_pct=round(100 * (state_page - state_real) / state_real, 4) if states else 0.0,
        kv_cache_groups=len(groups),
        group_size=max((len(g.layer_names) for g in groups), default=0),
        bytes_per_block=memory.bytes_per_block,
        kv_bytes_per_token=kv_bytes_per_token,
        blocks_per_request=blocks_per_request,
        num_blocks=memory.num_blocks,
        max_concurrency=round(memory.max_concurrency, 2),
        one_sequence_tokens=one_sequence_tokens(fitted or rt.max_model_len, block_size),
        one_sequence_bytes=one_sequence,
        needed_bytes=memory.needed_bytes,
        available_bytes=memory.available_bytes,
        admission=memory.admission,
        max_model_len_estimate=memory.max_model_len_estimate,
        group_kinds=tuple(g.kind for g in groups),
        auto_fit_max_model_len=memory.max_model_len or 0,
        auto_fit_message=memory.auto_fit,
    )
    step("allocation", plan, 1, rejected=None)  # one block of the pool the engine's config asks for
    trace.plan = plan
    return plan


#: how a step's value is compared between two traces (names and handles left out)
def comparable(step: Step) -> Any:
    """The part of a step's value two backends must agree on."""
    value = step.value
    if step.rejected:
        return f"rejects ({step.rejected})"
    view: Callable[[Any], Any] | None = _VIEWS.get(step.method)
    return view(value) if view is not None and value is not None else value


def _groups_view(groups: Any) -> list[tuple[Any, ...]]:
    return [(g.kind, g.block_size, g.page_size_bytes, len(g.layer_names), g.bytes_per_block,
             g.blocks_per_request) for g in groups]  # fmt: skip


def _compared_fields(value: Any) -> dict[str, Any]:
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.compare}


_VIEWS: dict[str, Callable[[Any], Any]] = {
    "engine_defaults": lambda s: dataclasses.asdict(s.runtime),
    "check_and_update_config": lambda s: dataclasses.asdict(s.runtime),
    "kv_cache_groups": _groups_view,
    "allocate_kv_cache": _compared_fields,
}
