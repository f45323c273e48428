"""From a scenario to the per-layer specs the worker reports (``get_kv_cache_spec``).

Model-level scenarios go through the hybrid alignment first (``hybrid.py``): attention
layers take the aligned block size, state layers the padded page; their block size is
``mamba_block_size``, which vLLM sets to ``max_model_len`` in ``none`` mode and to the
attention block in ``align`` mode (``MambaModelConfig.verify_and_update_config``).
"""

from __future__ import annotations

import dataclasses

from ..model import BlockChoice, HybridAlignment
from ..scenario import Scenario
from .attention import attention_spec, indexer_spec
from .hybrid import block_choice, is_skip_layer, skip_layers
from .mamba import Shapes, state_spec
from .releases import LATEST, RuleSet
from .selection import ATTENTION_KIND, refuse_before_sizing
from .specs import AttentionSpec, KVCacheSpec, MambaSpec
from .speculative import draft_layer_names


def sliding_window_block_size(
    block_size: int,
    kernel_block_alignment: int,
    release: RuleSet = LATEST,
    shared_page: int | None = None,
    bytes_per_token: int = 1,
) -> int:
    """``_largest_kernel_block_within`` (vllm/model_executor/layers/attention/attention.py, vLLM
    0.30+) for a backend of ``MultipleOf(kernel_block_alignment)`` and no padded page: the
    largest aligned block whose page fits in ``block_size`` tokens' page, else the smallest kernel
    block. A sliding-window layer runs at ``(block // a) * a`` tokens, or at ``a`` when the
    block is smaller than the kernel block ``a``. In 0.25 ... 0.29 it runs at ``a``; before
    ``sliding_window_own_block`` (0.25) at the primary block (``cache_config.block_size``).
    With Phase 3's ``shared_page`` (``skip_page_size_padded``) the budget is that page: from 0.30
    the largest multiple of ``a`` whose ``bytes_per_token`` page fits it (``a`` at least)."""
    a = kernel_block_alignment
    if not release.has("sliding_window_own_block"):
        return block_size
    if shared_page is not None:
        fits = shared_page // bytes_per_token // a * a
        return max(a, fits) if release.has("sliding_window_block_follows_primary") else a
    if block_size < a or not release.has("sliding_window_block_follows_primary"):
        return a
    return block_size // a * a


def layer_specs(
    scenario: Scenario,
    alignment: HybridAlignment | None = None,
    *,
    choice: BlockChoice | None = None,
    shapes: Shapes | None = None,
    release: RuleSet = LATEST,
) -> dict[str, KVCacheSpec]:
    """Layer name -> spec, in layer order (names as vLLM's ``model.layers.{i}.*`` prefixes).

    Attention layers take ``choice.block_size``, state layers ``choice.mamba_block_size`` and the
    padded page; ``choice`` defaults to :func:`~.hybrid.block_choice` of ``alignment`` and the
    state ``shapes`` to :func:`~.mamba.state_shapes`.
    """
    refuse_before_sizing(scenario, release)
    if scenario.is_spec_level:
        return _spec_level(scenario)
    model, rt = scenario.model, scenario.runtime
    assert model is not None
    choice = choice or block_choice(scenario, alignment, release)
    block, padded, mamba_block = choice.block_size, choice.state_page_padded, choice.mamba_block_size
    attn = model.attention
    skip = skip_layers(scenario)
    built: dict[tuple[str, bool], KVCacheSpec] = {}  # one spec object per kind: such layers report the same

    def spec(kind: str, skipped: bool = False) -> KVCacheSpec:
        key = (kind, skipped)
        if key not in built:
            if kind == "indexer":
                assert attn is not None
                built[key] = indexer_spec(attn, block_size=block)
            elif kind == "mamba":
                built[key] = state_spec(
                    scenario, block_size=mamba_block, page_size_padded=padded, shapes=shapes,
                    mamba2_checkpoint_block=release.has("mamba2_prefill_checkpoint_block"),
                    gdn_checkpoint_block=release.has("gdn_prefill_checkpoint_block"), release=release,
                )  # fmt: skip
            else:
                assert attn is not None
                # full-attention layers may have their own head size and KV heads (Gemma 4);
                # a skip layer keeps the model dtype (kv_cache_dtype "auto")
                one = attention_spec(
                    attn.for_layer(kind), kind=kind, block_size=block,
                    kv_cache_dtype="auto" if skipped else rt.kv_cache_dtype,
                    model_dtype=model.dtype, tensor_parallel_size=rt.tensor_parallel_size,
                    registered_dtypes=rt.registered_kv_cache_dtypes, release=release,
                )  # fmt: skip
                if kind == "sliding_window":
                    shared = choice.skip_page_size_padded
                    per_token = one.with_block_size(1).real_page_size_bytes
                    window_block = sliding_window_block_size(
                        block, rt.kernel_block_alignment, release, shared, per_token
                    )
                    one = dataclasses.replace(one.with_block_size(window_block), page_size_padded=shared)
                built[key] = one
        return built[key]

    specs: dict[str, KVCacheSpec] = {}
    for i, code in enumerate(model.layers):
        if code in ATTENTION_KIND:
            assert attn is not None
            kind = ATTENTION_KIND[code]
            specs[f"model.layers.{i}.self_attn"] = spec(kind, is_skip_layer(i, kind, skip))
            if attn.indexer_head_dim and (attn.indexer_layers is None or attn.indexer_layers[i] == "I"):
                specs[f"model.layers.{i}.indexer"] = spec("indexer")
        if code in "MP":
            specs[f"model.layers.{i}.mixer"] = spec("mamba")
    # the MTP drafter's decoder layers, after the target's: full attention of the target's geometry
    # (an MLA latent for an MLA model), with the DSA indexer when the model has one (deepseek_v2.py
    # DeepseekV2MLAAttention: an MTP layer always builds it); see speculative.num_draft_layers
    for name in draft_layer_names(scenario):
        if attn is None:
            raise ValueError(f"{scenario.name}: MTP draft layers need the model's [model.attention] geometry")
        specs[f"{name}.self_attn"] = spec("full_attention")
        if attn.indexer_head_dim:
            specs[f"{name}.indexer"] = spec("indexer")
    return specs


def _spec_level(scenario: Scenario) -> dict[str, KVCacheSpec]:
    specs: dict[str, KVCacheSpec] = {}
    for i, e in enumerate(scenario.layer_specs):
        for j in range(e.count):
            name = f"layer_specs.{i}.{j}"
            if e.kind == "mamba":
                specs[name] = MambaSpec(
                    block_size=e.block_size, shapes=e.shapes, dtypes=e.dtypes,
                    num_speculative_blocks=e.num_speculative_blocks,
                )  # fmt: skip
            else:
                specs[name] = AttentionSpec(
                    kind=e.kind, block_size=e.block_size, num_kv_heads=e.num_kv_heads,
                    head_size=e.head_size, head_size_v=e.head_size_v, dtype=e.dtype,
                    state_content_bytes=e.state_content_bytes, sliding_window=e.sliding_window,
                    attention_chunk_size=e.attention_chunk_size,
                )  # fmt: skip
    return specs
