"""``kvconform explain``: a scenario's sizing derivation step by step, and one pool block as SVG.

Each step shows its numbers (from the reference rules) and the function it mirrors, cited as the
reference modules' docstrings cite them (vLLM, or vllm-metal for its own rules).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .reference.metal import one_sequence_tokens
from .reference.specs import AttentionSpec, KVCacheSpec, MambaSpec
from .scenario import Scenario

#: rule family -> the title of the step it checks (a departure of that family is shown there)
STEP_OF_RULE = {
    "hybrid_alignment": "hybrid alignment",
    "block_size": "block choice",
    "state_page": "per-layer specs",
    "layer_specs": "per-layer specs",
    "attention_page": "per-layer specs",
    "max_memory": "groups",
    "unification": "unification",
    "grouping": "groups",
    "memory": "admission",
    "one_sequence": "one-sequence estimate",
    "kernel_block": "kernel block",
    "plan": "plan",
}


@dataclass
class Step:
    """One step of the derivation: its title, the function it mirrors and its numbers."""

    title: str
    mirrors: str
    lines: list[str] = field(default_factory=list)


def _planning(release: Any) -> str:
    """The module of vLLM's KV cache planning in ``release`` (split out of kv_cache_utils in 0.33)."""
    major, minor = map(int, release.release.split("."))
    return "vllm/v1/core/" + ("kv_cache_planning.py" if (major, minor) >= (0, 33) else "kv_cache_utils.py")


def describe_spec(spec: KVCacheSpec) -> str:
    """One line: the spec's kind, geometry and page bytes."""
    if isinstance(spec, MambaSpec):
        parts = " + ".join(
            f"{'x'.join(map(str, s))} {d} ({math.prod(s) * _size(d)} B)"
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


def _size(dtype: str) -> int:
    from .reference.dtypes import DTYPE_SIZE

    return DTYPE_SIZE[dtype]


def derivation(reference: Any, scenario: Scenario) -> list[Step]:
    """The reference's derivation of ``scenario``; a rejection propagates (``REJECTIONS``)."""
    rt, release = scenario.runtime, reference.release
    planning = _planning(release)
    steps = []
    align = reference.align_hybrid_block_size(scenario=scenario)
    step = Step("hybrid alignment", "vllm/platforms/interface.py::Platform._align_hybrid_block_size")
    if align is None:
        step.lines.append("not a hybrid attention + state model: nothing to align")
    else:
        step.lines += [
            f"attention page per token {align.attn_page_bytes_per_token} B, "
            f"state page {align.state_page_bytes} B",
            f"smallest block with attention page >= state page: {align.state_page_bytes} / "
            f"{align.attn_page_bytes_per_token} = {align.min_block_size:.2f} tokens",
            f"rounded up to the kernel alignment {rt.kernel_block_alignment} (never below "
            f"--block-size {rt.block_size}): block {align.block_size}",
            f"attention page {align.block_size} x {align.attn_page_bytes_per_token} = "
            f"{align.page_size_bytes} B",
        ]
        if align.state_page_padded_bytes is not None:
            step.lines.append(
                f"state page padded {align.state_page_bytes} -> {align.state_page_padded_bytes} B "
                f"(+{align.padding_pct:.2f}%)"
            )
    steps.append(step)

    choice = reference.choose_block_size(scenario=scenario)
    steps.append(Step("block choice", "vllm/platforms/interface.py::Platform.update_block_size_for_backend", [
        f"block_size {choice.block_size}, mamba_block_size {choice.mamba_block_size} "
        f"(mamba_cache_mode {rt.mamba_cache_mode}), state page padded to {choice.state_page_padded}",
    ]))  # fmt: skip

    specs = reference.layer_specs(scenario=scenario)
    counts = Counter(specs.values())
    steps.append(Step(
        "per-layer specs",
        "vllm/model_executor/layers/attention/attention.py::Attention.get_kv_cache_spec, "
        "vllm/model_executor/layers/mamba/abstract.py::MambaBase.get_kv_cache_spec",
        [f"{n} layer{'s' if n > 1 else ''} x {describe_spec(s)}" for s, n in counts.items()],
    ))  # fmt: skip

    policy = reference.policy_for(scenario)
    mirrors = {"pad-to-max": f"{planning}::unify_kv_cache_spec_page_size",
               "scale-only": "vllm/v1/core/kv_cache_utils.py::unify_kv_cache_spec_page_size (before #45181)",
               "lcm": "vllm#40128 (proposal, unmerged)"}.get(policy, policy)  # fmt: skip
    before = sorted({s.page_size_bytes for s in specs.values()})
    try:
        unified = reference.unify_page_sizes(specs, scenario=scenario)
        after = sorted({(s.kind, s.block_size, s.page_size_bytes) for s in unified.values()})
        line = f"policy {policy}: pages {before} -> " + ", ".join(
            f"{k} block {b}: {p} B" for k, b, p in after
        )
    except (ValueError, NotImplementedError, AssertionError) as exc:
        line = f"policy {policy}: pages {before}: cannot unify ({type(exc).__name__}: {exc})"
    steps.append(Step("unification", mirrors, [line]))

    groups = reference.kv_cache_groups(specs, scenario=scenario)
    kinds = Counter((g.kind, g.block_size, g.page_size_bytes, len(g.layer_names)) for g in groups)
    per_block = max(g.bytes_per_block for g in groups)
    steps.append(Step("groups", f"{planning}::get_kv_cache_groups", [
        *(f"{n} group{'s' if n > 1 else ''} {k}: block {b}, page {p} B, {m} layers"
          for (k, b, p, m), n in kinds.items()),
        f"bytes per block = largest group's pages: {per_block} B",
        "blocks per request: " + " + ".join(str(g.blocks_per_request) for g in groups)
        + f" = {sum(g.blocks_per_request for g in groups)}",
    ]))  # fmt: skip

    memory = reference.check_memory(specs, scenario=scenario)
    given = (f"num_gpu_blocks_override {rt.num_gpu_blocks_override}" if rt.num_gpu_blocks_override
             else f"{rt.kv_cache_memory_bytes} B // {memory.bytes_per_block} B")  # fmt: skip
    steps.append(Step("pool", f"{planning}::get_kv_cache_configs, "
                      "vllm/v1/core/kv_cache_utils.py::get_max_concurrency_for_kv_cache_config", [
        f"num_blocks = {given} = {memory.num_blocks} (block 0 is the null block)",
        f"max concurrency {memory.max_concurrency:.2f} requests of {rt.max_model_len} tokens",
    ]))  # fmt: skip
    steps.append(Step("admission", f"{planning}::_check_enough_kv_cache_memory, "
                      "_estimate_max_model_len_from_groups", [
        f"needed {memory.needed_bytes} B for one {rt.max_model_len}-token request, "
        f"available {memory.available_bytes} B",
        f"admission: {memory.admission}",
        f"largest max_model_len that fits: {memory.max_model_len_estimate}",
    ]))  # fmt: skip

    block = min([g.block_size for g in groups if g.kind != "mamba"] or [g.block_size for g in groups])
    if not scenario.is_spec_level:
        one = reference.one_sequence_bytes(choice.block_size, choice.state_page_padded, scenario=scenario)
        steps.append(Step("one-sequence estimate",
                          "vllm-metal v1/cache_policy.py::estimate_one_sequence_kv_bytes",
                          [f"{one_sequence_tokens(rt.max_model_len, block)} tokens "
                           f"(cdiv({rt.max_model_len}, {block}) x {block}): {one} B"]))  # fmt: skip
    try:
        kernel = reference.kernel_block_size(block)
        line = f"logical block {block} -> kernel block {kernel} ({block // kernel} kernel blocks per block)"
    except (ValueError, NotImplementedError, AssertionError) as exc:
        line = f"logical block {block}: no kernel block ({type(exc).__name__}: {exc})"
    steps.append(Step("kernel block", "vllm-metal attention/impls/sdpa.py::_pick_kernel_block_size", [line]))
    return steps


def format_steps(steps: list[Step]) -> str:
    out = []
    for i, step in enumerate(steps, 1):
        out.append(f"{i}. {step.title}  [{step.mirrors}]")
        out += [f"     {line}" for line in step.lines]
    return "\n".join(out)


# ----------------------------------------------------------------------------- SVG


def block_svg(reference: Any, scenario: Scenario) -> str:
    """One block of the pool of a hybrid scenario, as SVG text: its page slots (one per layer of a
    group, each tensor shared by one layer of every group), then one attention page and one state
    page drawn to scale, with the state page's padding. Raises ``ValueError`` for a scenario
    without both kinds of page."""
    specs = reference.layer_specs(scenario=scenario)
    groups = reference.kv_cache_groups(specs, scenario=scenario)
    attention = next((s for s in specs.values() if isinstance(s, AttentionSpec)), None)
    state = next((s for s in specs.values() if isinstance(s, MambaSpec)), None)
    if attention is None or state is None:
        raise ValueError(
            f"{scenario.name}: not a hybrid attention + state model: no padded state page to draw"
        )
    unified = reference.unify_page_sizes(specs, scenario=scenario)
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
