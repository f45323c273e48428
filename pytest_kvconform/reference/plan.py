"""``plan(scenario)``: every rule composed into one :class:`~pytest_kvconform.model.KVPlan`."""

from __future__ import annotations

from ..model import KVPlan
from ..scenario import Scenario
from .grouping import get_kv_cache_groups, group_size
from .hybrid import hybrid_alignment
from .layers import layer_specs
from .memory import blocks_per_request, check_memory, max_concurrency
from .metal import one_sequence_kv_bytes, one_sequence_tokens, pick_kernel_block_size
from .specs import AttentionSpec, MambaSpec


def plan(scenario: Scenario) -> KVPlan:
    """Hybrid alignment -> layer specs -> unification and grouping -> pool and admission,
    plus the Metal kernel block and one-sequence estimate for the resulting block size."""
    rt = scenario.runtime
    alignment = hybrid_alignment(scenario)
    specs = layer_specs(scenario, alignment)
    groups = get_kv_cache_groups(specs, rt.unify_policy)
    memory = check_memory(groups, rt)
    final = [s for g in groups for s in g.specs]
    kv = [s for s in specs.values() if isinstance(s, AttentionSpec) and s.cache_role == "kv"]
    indexer = [s for s in specs.values() if isinstance(s, AttentionSpec) and s.cache_role == "indexer"]
    states = [s for s in final if isinstance(s, MambaSpec)]
    attention_blocks = [s.block_size for s in final if isinstance(s, AttentionSpec)]
    block_size = min(attention_blocks or [s.block_size for s in final])
    try:
        kernel_block = pick_kernel_block_size(block_size)
    except ValueError:
        kernel_block = 0  # no Metal kernel block divides it
    padding_pct = 0.0
    if states:
        real = states[0].real_page_size_bytes
        padding_pct = round(100 * (states[0].page_size_bytes - real) / real, 4)
    one_seq = 0
    if not scenario.is_spec_level:
        padded = alignment.state_page_padded_bytes if alignment is not None else None
        one_seq = one_sequence_kv_bytes(scenario, block_size, padded)
    return KVPlan(
        scenario=scenario.name,
        unify_policy=rt.unify_policy,
        block_size=block_size,
        kernel_block_size=kernel_block,
        kernel_blocks_per_block=block_size // kernel_block if kernel_block else 0,
        attn_bytes_per_token_per_layer=kv[0].bytes_per_token if kv else 0,
        indexer_bytes_per_token_per_layer=indexer[0].bytes_per_token if indexer else 0,
        state_bytes_per_layer=states[0].real_page_size_bytes if states else 0,
        page_size_bytes=max(s.page_size_bytes for s in final),
        state_padding_pct=padding_pct,
        kv_cache_groups=len(groups),
        group_size=group_size(groups),
        bytes_per_block=memory.bytes_per_block,
        kv_bytes_per_token=sum(s.bytes_per_token for s in kv + indexer),
        blocks_per_request=blocks_per_request(groups, rt),
        num_blocks=memory.num_blocks,
        max_concurrency=round(max_concurrency(memory.num_blocks, groups, rt), 2),
        one_sequence_tokens=one_sequence_tokens(rt.max_model_len, block_size),
        one_sequence_bytes=one_seq,
        needed_bytes=memory.needed_bytes,
        available_bytes=memory.available_bytes,
        admission=memory.admission,
        max_model_len_estimate=memory.max_model_len_estimate,
        group_kinds=tuple(g.kind for g in groups),
    )
