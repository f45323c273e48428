"""Hybrid attention + state block-size alignment.

Mirrors ``Platform._align_hybrid_block_size`` (vllm/platforms/interface.py, vLLM 0.33.0):
the attention block grows to the smallest multiple of the kernel alignment whose page
covers the state page, and the state page is padded up to that attention page.
"""

from __future__ import annotations

import math

from ..model import BlockChoice, HybridAlignment
from ..scenario import Scenario
from .attention import attention_bytes_per_token, attention_spec
from .mamba import state_page_bytes
from .parallel import verify_parallel
from .releases import LATEST, SPECULATIVE_ROWS_LATE, RuleSet
from .specs import cdiv

#: vLLM's floor for the attention block of an MLA hybrid (``if use_mla: k = max(k, 128)``).
MLA_MIN_BLOCK_ALIGNMENT = 128


def align_hybrid_block_size(
    attn_page_bytes_per_token: int,
    state_page_bytes: int,
    *,
    kernel_block_alignment: int = 16,
    block_size: int = 16,
    use_mla: bool = False,
    extra_block_alignment: int = 1,
) -> HybridAlignment:
    """``_align_hybrid_block_size`` on plain numbers.

    ``k = max(kernel_block_alignment, block_size)`` (128 at least for MLA; lcm'd with the
    prefill checkpoint alignment in align mode), ``attn_bs = k * cdiv(state, k * a1)``,
    rounded up to the kernel alignment, never below ``block_size``. vLLM 0.33 and
    vllm-metal today align to 16; vllm-metal before its PR #262 hard-coded 32.
    """
    if attn_page_bytes_per_token <= 0 or state_page_bytes < 0:
        raise ValueError("attention page per token must be > 0 and the state page >= 0")
    a1, state = attn_page_bytes_per_token, state_page_bytes
    if state == 0:
        page = block_size * a1
        return HybridAlignment(block_size, a1, 0, page, None, 0.0)
    k = max(kernel_block_alignment, block_size)
    if use_mla:
        k = max(k, MLA_MIN_BLOCK_ALIGNMENT)
    k = math.lcm(k, extra_block_alignment)
    attn_bs = k * cdiv(state, k * a1)
    attn_bs = kernel_block_alignment * cdiv(attn_bs, kernel_block_alignment)
    new_block = max(block_size, attn_bs)
    page = new_block * a1
    assert page >= state
    return HybridAlignment(
        block_size=new_block, attn_page_bytes_per_token=a1, state_page_bytes=state,
        page_size_bytes=page, state_page_padded_bytes=None if page == state else page,
        min_block_size=state / a1,
    )  # fmt: skip


#: ``CacheConfig.DEFAULT_BLOCK_SIZE`` (vllm/config/cache.py): the block when none is given.
DEFAULT_BLOCK_SIZE = 16


def preferred_block_size(kernel_block_alignment: int, default: int = DEFAULT_BLOCK_SIZE) -> int:
    """Phase 1 of ``Platform.update_block_size_for_backend`` for one backend whose kernel block
    sizes are ``MultipleOf(kernel_block_alignment)``: ``get_preferred_block_size(default)`` is the
    default if the backend supports it, else its smallest kernel block (vllm/v1/attention/backend.py)."""
    return default if default % kernel_block_alignment == 0 else kernel_block_alignment


def requested_block_size(scenario: Scenario) -> int:
    """The block before the hybrid alignment: the user's ``--block-size``, else Phase 1's choice."""
    rt = scenario.runtime
    return rt.block_size if rt.user_specified_block_size else preferred_block_size(rt.kernel_block_alignment)


def hybrid_alignment(scenario: Scenario, release: RuleSet = LATEST) -> HybridAlignment | None:
    """The alignment ``release`` applies to a model-level hybrid scenario; None if not hybrid.

    The attention page is the real per-token page of one layer, packed formats included
    (for MLA ``fp8_ds_mla`` that is 656 B; vLLM 0.33's ``_align_hybrid_block_size`` prices 576, a vLLM bug).
    The MLA floor of 128 is vLLM 0.27's (``mla_hybrid_block_floor``).
    """
    model, rt = scenario.model, scenario.runtime
    if model is None or not model.is_hybrid:
        return None
    assert model.attention is not None
    verify_parallel(scenario, release)
    spec = attention_spec(
        model.attention, kind="full_attention", block_size=1, kv_cache_dtype=rt.kv_cache_dtype,
        model_dtype=model.dtype, tensor_parallel_size=rt.tensor_parallel_size,
        registered_dtypes=rt.registered_kv_cache_dtypes, release=release,
    )  # fmt: skip
    return align_hybrid_block_size(
        attention_bytes_per_token(spec),
        state_page_bytes(scenario, speculative_rows=release.has("alignment_counts_speculative_rows")
                         or model.architecture not in SPECULATIVE_ROWS_LATE, release=release),
        kernel_block_alignment=rt.kernel_block_alignment,
        block_size=requested_block_size(scenario),
        use_mla=model.use_mla and release.has("mla_hybrid_block_floor"),
        extra_block_alignment=rt.extra_block_alignment
        if rt.mamba_cache_mode == "align" and release.has("prefill_checkpoint_alignment") else 1,
    )  # fmt: skip


def block_choice(
    scenario: Scenario, alignment: HybridAlignment | None, release: RuleSet = LATEST
) -> BlockChoice:
    """The cache config's block sizes and padded state page after ``alignment`` (None for a
    non-hybrid: the requested block, unpadded). ``mamba_block_size`` is the attention block
    in ``align`` mode, else ``max_model_len`` (``MambaModelConfig.verify_and_update_config``).

    Before ``align_block_unbounded_by_batch`` (vLLM 0.27), ``VllmConfig.validate_block_size``
    refuses an ``align``-mode block above ``max_num_batched_tokens`` (``AssertionError``)."""
    rt = scenario.runtime
    block, padded = (requested_block_size(scenario), None) if alignment is None else (
        alignment.block_size, alignment.state_page_padded_bytes)  # fmt: skip
    if (
        scenario.model is not None
        and rt.mamba_cache_mode == "align"
        and block > rt.max_num_batched_tokens
        and not release.has("align_block_unbounded_by_batch")
    ):
        raise AssertionError(
            f"In Mamba cache align mode, block_size ({block}) must be <= max_num_batched_tokens "
            f"({rt.max_num_batched_tokens})."
        )
    return BlockChoice(block, block if rt.mamba_cache_mode == "align" else rt.max_model_len, padded)
