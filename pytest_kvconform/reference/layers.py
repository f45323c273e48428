"""From a scenario to the per-layer specs the worker reports (``get_kv_cache_spec``).

Model-level scenarios go through the hybrid alignment first (``hybrid.py``): attention
layers take the aligned block size, state layers the padded page; their block size is
``mamba_block_size``, which vLLM sets to ``max_model_len`` in ``none`` mode and to the
attention block in ``align`` mode (``MambaModelConfig.verify_and_update_config``).
"""

from __future__ import annotations

from ..model import BlockChoice, HybridAlignment
from ..scenario import Scenario
from .attention import attention_spec, indexer_spec
from .hybrid import block_choice
from .mamba import Shapes, state_spec
from .parallel import verify_parallel
from .releases import LATEST, RuleSet
from .specs import AttentionSpec, KVCacheSpec, MambaSpec

_ATTENTION_KIND = {"A": "full_attention", "P": "full_attention", "S": "sliding_window",
                   "L": "chunked_local", "X": "cross_attention"}  # fmt: skip


def sliding_window_block_size(block_size: int, kernel_block_alignment: int, release: RuleSet = LATEST) -> int:
    """``_largest_kernel_block_within`` (vllm/model_executor/layers/attention/attention.py, vLLM
    0.30+) for a backend of ``MultipleOf(kernel_block_alignment)`` and no padded page: the
    largest aligned block whose page fits in ``block_size`` tokens' page, else the smallest kernel
    block. A sliding-window layer runs at ``(block // a) * a`` tokens, or at ``a`` when the
    block is smaller than the kernel block ``a``. In 0.25 ... 0.29 it runs at ``a``; before
    ``sliding_window_own_block`` (0.25) at the primary block (``cache_config.block_size``)."""
    a = kernel_block_alignment
    if not release.has("sliding_window_own_block"):
        return block_size
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
    verify_parallel(scenario, release)
    if scenario.is_spec_level:
        return _spec_level(scenario)
    model, rt = scenario.model, scenario.runtime
    assert model is not None
    choice = choice or block_choice(scenario, alignment, release)
    block, padded, mamba_block = choice.block_size, choice.state_page_padded, choice.mamba_block_size
    attn = model.attention
    built: dict[str, KVCacheSpec] = {}  # one spec object per kind: every such layer reports the same

    def spec(kind: str) -> KVCacheSpec:
        if kind not in built:
            if kind == "indexer":
                assert attn is not None
                built[kind] = indexer_spec(attn, block_size=block)
            elif kind == "mamba":
                built[kind] = state_spec(
                    scenario, block_size=mamba_block, page_size_padded=padded, shapes=shapes,
                    mamba2_checkpoint_block=release.has("mamba2_prefill_checkpoint_block"),
                    gdn_checkpoint_block=release.has("gdn_prefill_checkpoint_block"), release=release,
                )  # fmt: skip
            else:
                assert attn is not None
                # full-attention layers may have their own head size and KV heads (Gemma 4)
                built[kind] = attention_spec(
                    attn.for_layer(kind), kind=kind, block_size=block, kv_cache_dtype=rt.kv_cache_dtype,
                    model_dtype=model.dtype, tensor_parallel_size=rt.tensor_parallel_size,
                    registered_dtypes=rt.registered_kv_cache_dtypes, release=release,
                )  # fmt: skip
                if kind == "sliding_window":
                    window_block = sliding_window_block_size(block, rt.kernel_block_alignment, release)
                    built[kind] = built[kind].with_block_size(window_block)
        return built[kind]

    specs: dict[str, KVCacheSpec] = {}
    for i, code in enumerate(model.layers):
        if code in _ATTENTION_KIND:
            assert attn is not None
            specs[f"model.layers.{i}.self_attn"] = spec(_ATTENTION_KIND[code])
            if attn.indexer_head_dim and (attn.indexer_layers is None or attn.indexer_layers[i] == "I"):
                specs[f"model.layers.{i}.indexer"] = spec("indexer")
        if code in "MP":
            specs[f"model.layers.{i}.mixer"] = spec("mamba")
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
