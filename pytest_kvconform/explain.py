"""``kvconform explain``: a plan's trace step by step, two traces compared, one pool block as SVG.

Formats the :class:`~pytest_kvconform.reference.plan.PlanTrace` that composing a plan records
(no step is computed here): each step's numbers, the vLLM (or vllm-metal) function it mirrors
and who answered it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from .conformance import first_difference, first_layer_difference
from .model import BlockChoice, HybridAlignment, KVCacheGroup, MemoryCheck, PoolAllocation
from .reference.dtypes import DTYPE_SIZE
from .reference.plan import PlanTrace, Step, comparable
from .reference.specs import AttentionSpec, KVCacheSpec, MambaSpec
from .scenario import RuntimeSettings, Scenario


def describe_spec(spec: KVCacheSpec) -> str:
    """One line: the spec's kind, geometry and page bytes."""
    if isinstance(spec, MambaSpec):
        parts = " + ".join(
            f"{'x'.join(map(str, s))} {d} ({math.prod(s) * DTYPE_SIZE[d]} B)"
            for s, d in zip(spec.shapes, spec.dtypes, strict=True)
        )
        padded = f", padded to {spec.page_size_bytes} B" if spec.page_size_padded is not None else ""
        return f"{spec.kind}: state {parts} = {spec.real_page_size_bytes} B{padded}"
    assert isinstance(spec, AttentionSpec)
    role = f" ({spec.cache_role})" if spec.cache_role != "kv" else ""
    window = f", window {spec.sliding_window}" if spec.sliding_window else ""
    return (
        f"{spec.kind}{role}: block {spec.block_size} x {spec.bytes_per_token} B/token "
        f"({spec.num_kv_heads} KV heads, head {spec.head_size}, {spec.dtype}{window}) = "
        f"{spec.page_size_bytes} B page"
    )


def _platform(v: Scenario, trace: PlanTrace) -> list[str]:
    assert trace.scenario is not None
    before, after = dataclasses.asdict(trace.scenario.runtime), dataclasses.asdict(v.runtime)
    changed = [f"{k}: {before[k]!r} -> {after[k]!r}" for k in before if before[k] != after[k]]
    return changed or ["the platform leaves the config as given"]


def _alignment(v: HybridAlignment | None, trace: PlanTrace) -> list[str]:
    if v is None:
        return ["not a hybrid attention + state model: nothing to align"]
    rt = _runtime(trace)
    lines = [
        f"attention page per token {v.attn_page_bytes_per_token} B, state page {v.state_page_bytes} B",
        f"smallest block with attention page >= state page: {v.state_page_bytes} / "
        f"{v.attn_page_bytes_per_token} = {v.min_block_size:.2f} tokens",
        f"rounded up to the kernel alignment {rt.kernel_block_alignment} (never below --block-size "
        f"{rt.block_size}): block {v.block_size}",
        f"attention page {v.block_size} x {v.attn_page_bytes_per_token} = {v.page_size_bytes} B",
    ]
    if v.state_page_padded_bytes is not None:
        lines.append(f"state page padded {v.state_page_bytes} -> {v.state_page_padded_bytes} B "
                     f"(+{v.padding_pct:.2f}%)")  # fmt: skip
    return lines


def _choice(v: BlockChoice, trace: PlanTrace) -> list[str]:
    return [f"block_size {v.block_size}, mamba_block_size {v.mamba_block_size} (mamba_cache_mode "
            f"{_runtime(trace).mamba_cache_mode}), state page padded to {v.state_page_padded}"]  # fmt: skip


def _specs(v: dict[str, KVCacheSpec], trace: PlanTrace) -> list[str]:
    if not v:
        return ["none: no layer holds a KV cache"]
    return [f"{n} layer{'s' if n > 1 else ''} x {describe_spec(s)}" for s, n in Counter(v.values()).items()]


def _unified(v: dict[str, KVCacheSpec] | None, trace: PlanTrace) -> list[str]:
    policy = trace.plan.unify_policy if trace.plan is not None else _runtime(trace).unify_policy
    specs = trace.step("layer specs")
    before = sorted({s.page_size_bytes for s in specs.value.values()}) if specs is not None else []
    hma_off = []
    if _runtime(trace).disable_hybrid_kv_cache_manager:
        hma_off = ["not reached: with --disable-hybrid-kv-cache-manager the groups promote local "
                   "layers to full attention first (unify_hybrid_kv_cache_specs)"]  # fmt: skip
    if v is None:
        return [*hma_off, f"policy {policy}: pages {before}: cannot unify"]
    if not v:
        return ["no pages: nothing to unify"]
    after = sorted({(s.kind, s.block_size, s.page_size_bytes) for s in v.values()})
    return [
        *hma_off,
        f"policy {policy}: pages {before} -> " + ", ".join(f"{k} block {b}: {p} B" for k, b, p in after),
    ]


def _groups(v: list[KVCacheGroup], trace: PlanTrace) -> list[str]:
    if not v:
        return ["no groups: no layer holds a KV cache (attention-free)"]
    kinds = Counter((g.kind, g.block_size, g.page_size_bytes, len(g.layer_names)) for g in v)
    return [
        *(f"{n} group{'s' if n > 1 else ''} {k}: block {b}, page {p} B, {m} layers"
          for (k, b, p, m), n in kinds.items()),
        f"bytes per block = largest group's pages: {max(g.bytes_per_block for g in v)} B",
        "blocks per request: " + " + ".join(str(g.blocks_per_request) for g in v)
        + f" = {sum(g.blocks_per_request for g in v)}",
    ]  # fmt: skip


def _memory(v: MemoryCheck, trace: PlanTrace) -> list[str]:
    rt = _runtime(trace)
    if not v.bytes_per_block:
        return [
            "attention-free: the engine probes no memory and checks nothing; "
            f"num_blocks = {v.num_blocks} (BlockPool's null block)"
        ]
    given = (f"num_gpu_blocks_override {rt.num_gpu_blocks_override}" if rt.num_gpu_blocks_override
             else f"{rt.kv_cache_memory_bytes} B // {v.bytes_per_block} B")  # fmt: skip
    return [
        f"num_blocks = {given} = {v.num_blocks} (block 0 is the null block)",
        f"max concurrency {v.max_concurrency:.2f} requests of {rt.max_model_len} tokens",
        f"needed {v.needed_bytes} B for one {rt.max_model_len}-token request, "
        f"available {v.available_bytes} B",
        f"admission: {v.admission}",
        f"largest max_model_len that fits: {v.max_model_len_estimate}",
    ]


def _one_sequence(v: int, trace: PlanTrace) -> list[str]:
    assert trace.plan is not None
    tokens, block = trace.plan.one_sequence_tokens, trace.plan.block_size
    return [f"{tokens} tokens (cdiv({_runtime(trace).max_model_len}, {block}) x {block}): {v} B"]


def _kernel(v: int, trace: PlanTrace) -> list[str]:
    assert trace.plan is not None
    block = trace.plan.block_size
    if not v:
        return [f"logical block {block}: no kernel block (rejected)"]
    return [f"logical block {block} -> kernel block {v} ({block // v} kernel blocks per block)"]


def _allocation(v: PoolAllocation | None, trace: PlanTrace) -> list[str]:
    if v is None:
        return ["rejected"]
    return [f"one block: {v.bytes_per_block} B per block, {v.bytes_held} B held"]


def _runtime(trace: PlanTrace) -> RuntimeSettings:
    configured = trace.step("platform config")
    scenario = configured.value if configured is not None else trace.scenario
    assert scenario is not None
    return scenario.runtime  # type: ignore[no-any-return]


#: step title -> the lines that explain its value
FORMATS: dict[str, Callable[[Any, PlanTrace], list[str]]] = {
    "engine defaults": lambda v, trace: (
        list(v.defaults_applied) or ["the scenario states every such setting"]
    ),
    "platform config": _platform,
    "hybrid alignment": _alignment,
    "block choice": _choice,
    "layer specs": _specs,
    "attention page": lambda v, trace: [f"{v} B per token per layer (first attention spec, block 1)"],
    "state page": lambda v, trace: [f"{v} B per state layer, unpadded"],
    "unification": _unified,
    "groups": _groups,
    "available memory": lambda v, trace: [f"{v} B for the KV cache"],
    "pool and admission": _memory,
    "kernel block sizes": lambda v, trace: [
        "kernel block per group: " + (", ".join(f"{k} (x{n})" for k, n in Counter(v).items()) or "no groups")
    ],
    "one-sequence estimate": _one_sequence,
    "kernel block": _kernel,
    "allocation": _allocation,
}


def format_trace(trace: PlanTrace, provenance: bool = False) -> str:
    """The trace step by step: title, the function it mirrors, its numbers (and who answered)."""
    out = []
    for i, step in enumerate(trace.steps, 1):
        who = f"  ({_who(step)})" if provenance else ""
        out.append(f"{i}. {step.title}  [{step.mirrors}]{who}")
        out += [f"     {line}" for line in FORMATS[step.title](step.value, trace)]
    return "\n".join(out)


def _who(step: Step) -> str:
    names = {"backend": "the backend's own code", "inherited": "inherited: the reference's code ran for it",
             "reference": "the reference: the backend declined"}  # fmt: skip
    return names[step.answered_by] + (f", {step.reason}" if step.reason else "")


def step_difference(reference: Step, backend: Step) -> tuple[str, Any, Any] | None:
    """The first field where ``backend``'s answer to a step departs from ``reference``'s."""
    if reference.method in ("layer_specs", "unify_page_sizes") and not (
        reference.rejected or backend.rejected
    ):
        if reference.value is None or backend.value is None:
            return first_difference(reference.value, backend.value)
        return first_layer_difference(reference.value, backend.value)
    return first_difference(comparable(reference), comparable(backend))


def compare_traces(reference: PlanTrace, backend: PlanTrace) -> tuple[list[str], int | None]:
    """One line per step of ``backend``'s trace: who answered and whether it agrees with the
    reference's step; the number of the first departing step (None when none departs)."""
    theirs = {s.title: s for s in backend.steps}
    lines, first = [], None
    width = max(len(s.title) for s in reference.steps)
    for i, ours in enumerate(reference.steps, 1):
        step = theirs.get(ours.title)
        if step is None:
            lines.append(f"{i:>2}. {ours.title:<{width}}  not asked")
            continue
        diff = step_difference(ours, step)
        verdict = (
            "agrees" if diff is None else f"DEPARTS: {diff[0]}: reference {diff[1]!r}, backend {diff[2]!r}"
        )
        if diff is not None and first is None:
            first = i
        lines.append(f"{i:>2}. {ours.title:<{width}}  {_who(step)}: {verdict}")
    return lines, first


# ----------------------------------------------------------------------------- SVG


def block_svg(trace: PlanTrace) -> str:
    """One block of the pool of a hybrid scenario's trace, as SVG text: its page slots (one per
    layer of a group, each tensor shared by one layer of every group), then one attention page and
    one state page drawn to scale, with the state page's padding. Raises ``ValueError`` for a
    scenario without both kinds of page."""
    scenario = trace.scenario
    assert scenario is not None
    specs, groups = _value(trace, "layer specs"), _value(trace, "groups")
    attention = next((s for s in specs.values() if isinstance(s, AttentionSpec)), None)
    state = next((s for s in specs.values() if isinstance(s, MambaSpec)), None)
    if attention is None or state is None:
        raise ValueError(
            f"{scenario.name}: not a hybrid attention + state model: no padded state page to draw"
        )
    unified = _value(trace, "unification") or specs
    attention = unified.get(next(n for n, s in specs.items() if s is attention), attention)
    state = unified.get(next(n for n, s in specs.items() if s is state), state)
    page = max(attention.page_size_bytes, state.page_size_bytes)
    slots = max(len(g.layer_names) for g in groups)
    per_block = max(g.bytes_per_block for g in groups)
    width, left, bar = 760, 150, 600

    def x(nbytes: int) -> float:
        return left + bar * nbytes / page

    def rect(x0: float, y: int, w: float, fill: str, label: str) -> str:
        return (f'<rect x="{x0:.1f}" y="{y}" width="{max(w, 0.5):.1f}" height="28" fill="{fill}" '
                f'stroke="#333"><title>{label}</title></rect>')  # fmt: skip

    def text(x0: float, y: int, s: str, size: int = 12) -> str:
        return f'<text x="{x0:.1f}" y="{y}" font-family="monospace" font-size="{size}">{s}</text>'

    a_real, s_real = attention.real_page_size_bytes, state.real_page_size_bytes
    parts = [
        text(10, 20, f"{scenario.name}: one pool block = {slots} pages x {page} B = {per_block} B", 13),
        text(10, 54, "block"),
        *(rect(left + i * bar / slots, 36, bar / slots, "#ddd", f"page slot {i}: {page} B")
          for i in range(slots)),
        text(10, 98, "attention"),
        rect(x(0), 80, x(a_real) - left, "#4a90d9", f"attention page: {a_real} B"),
        *([rect(x(a_real), 80, x(page) - x(a_real), "#f5a623", f"padding: {page - a_real} B")]
          if page > a_real else []),
        text(left, 126, f"attention page {attention.block_size} tokens x {attention.bytes_per_token} B"
             f" = {a_real} B"),
        text(10, 160, "state"),
        rect(x(0), 142, x(s_real) - left, "#7ed321", f"state page: {s_real} B"),
        *([rect(x(s_real), 142, x(page) - x(s_real), "#f5a623", f"padding: {page - s_real} B")]
          if page > s_real else []),
        text(left, 188, f"state page {s_real} B + padding {page - s_real} B "
             f"({100 * (page - s_real) / s_real:.2f}%)"),
    ]  # fmt: skip
    body = "\n  ".join(parts)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="200" '
            f'viewBox="0 0 {width} 200">\n  {body}\n</svg>\n')  # fmt: skip


def _value(trace: PlanTrace, title: str) -> Any:
    step = trace.step(title)
    return step.value if step is not None else None
