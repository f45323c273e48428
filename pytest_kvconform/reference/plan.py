"""``plan(scenario)``: every rule composed into one :class:`~pytest_kvconform.model.KVPlan`."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import TYPE_CHECKING, Any

from ..model import KVPlan
from ..scenario import Scenario
from .layers import layer_specs
from .metal import one_sequence_tokens
from .specs import AttentionSpec, MambaSpec

if TYPE_CHECKING:
    from .rules import ReferenceRules


def plan(scenario: Scenario) -> KVPlan:
    """The reference's plan of ``scenario``."""
    from .rules import ReferenceRules

    return compose_plan(ReferenceRules(), scenario)


def compose_plan(rules: ReferenceRules | Any, scenario: Scenario) -> KVPlan:
    """Hybrid alignment -> layer specs -> grouping -> pool and admission, each step answered by
    ``rules`` (the reference, or a backend answering with its own code), plus the vllm-metal
    kernel block and one-sequence estimate for the resulting block size."""
    rt = scenario.runtime
    policy = rules.policy_for(scenario)
    alignment = rules.align_hybrid_block_size(scenario)
    specs = layer_specs(scenario, alignment)
    groups = rules.kv_cache_groups(specs, rt, policy)
    memory = rules.check_memory(specs, rt, policy)

    attention = [s for s in specs.values() if isinstance(s, AttentionSpec)]
    kv = [s for s in attention if s.cache_role == "kv"]
    indexer = [s for s in attention if s.cache_role == "indexer"]
    states = [s for s in specs.values() if isinstance(s, MambaSpec)]
    block_size = min([g.block_size for g in groups if g.kind != "mamba"] or [g.block_size for g in groups])
    try:
        kernel_block = rules.kernel_block_size(block_size)
    except ValueError:
        kernel_block = 0  # no Metal kernel block divides it

    def per_token(spec: AttentionSpec) -> int:
        return rules.attention_page_bytes(spec.with_block_size(1))

    def layer_page(group: Any) -> int:
        if group.kind == "uniform_type":  # the group page sums its layers; report the largest layer
            return max(specs[name].page_size_bytes for name in group.layer_names)
        return group.page_size_bytes

    unpadded_state = dataclasses.replace(states[0], page_size_padded=None) if states else None
    state_real = rules.state_page_bytes(unpadded_state) if unpadded_state is not None else 0
    state_page = max((g.page_size_bytes for g in groups if g.kind == "mamba"), default=state_real)
    blocks_per_request = sum(g.blocks_per_request for g in groups)
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
        max_concurrency=round(memory.num_blocks / blocks_per_request, 2) if blocks_per_request else 0.0,
        one_sequence_tokens=one_sequence_tokens(rt.max_model_len, block_size),
        one_sequence_bytes=0 if scenario.is_spec_level else rules.one_sequence_bytes(scenario),
        needed_bytes=memory.needed_bytes,
        available_bytes=memory.available_bytes,
        admission=memory.admission,
        max_model_len_estimate=memory.max_model_len_estimate,
        group_kinds=tuple(g.kind for g in groups),
    )
