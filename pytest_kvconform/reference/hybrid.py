"""Phases 2 and 3 of ``Platform.update_block_size_for_backend`` (vllm/platforms/interface.py).

Phase 2, ``Platform._align_hybrid_block_size`` (vLLM 0.33.0): the attention block grows to the
smallest multiple of the kernel alignment whose page covers the state page, and the state page
is padded up to that attention page.

Phase 3, ``Platform._align_heterogeneous_kv_block_size`` (vLLM 0.25+): with
``kv_cache_dtype_skip_layers`` (layers kept at the model dtype; for TurboQuant/UltraQuant on a
dense model ``EngineArgs.create_engine_config`` adds ``TurboQuantConfig.get_boundary_skip_layers``)
the block grows until the quantized primary page covers the native page at the kernel block,
and sliding-window layers and a padded state page pad to that shared page.
"""

from __future__ import annotations

import dataclasses
import math

from ..model import BlockChoice, HybridAlignment
from ..scenario import AttentionGeometry, Scenario
from .attention import attention_bytes_per_token, attention_spec
from .dtypes import DTYPE_SIZE, storage_dtype
from .mamba import state_page_bytes
from .releases import LATEST, SPECULATIVE_ROWS_LATE, RuleSet
from .selection import refuse_before_sizing
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
    mamba_chunk_size: int = 0,
) -> HybridAlignment:
    """``_align_hybrid_block_size`` on plain numbers.

    ``k = max(kernel_block_alignment, block_size)`` (128 at least for MLA; lcm'd with the
    prefill checkpoint alignment in align mode), ``attn_bs = k * cdiv(state, k * a1)``,
    rounded up to the kernel alignment, never below ``block_size``. vLLM 0.33 and
    vllm-metal today align to 16; vllm-metal before its PR #262 hard-coded 32.
    ``mamba_cache_mode = "all"`` (vLLM 0.23 ... 0.31; ``mamba_chunk_size`` given): whole
    ``lcm(mamba_chunk_size, k)`` chunks covering ``cdiv(state, a1)`` tokens.
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
    if mamba_chunk_size:  # "all": prefix caching at Mamba chunk boundaries
        chunk = math.lcm(mamba_chunk_size, k)
        attn_bs = chunk * cdiv(cdiv(state, a1), chunk)
    else:
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


#: ``TurboQuantConfig.get_boundary_skip_layers``'s ``n``: layers kept native at each end.
BOUNDARY_SKIP_LAYERS = 2


def packs_boundary(kv_cache_dtype: str) -> bool:
    """Whether ``EngineArgs.create_engine_config`` adds boundary skip layers for this dtype
    (vllm/engine/arg_utils.py: ``turboquant_*``; ``ultraquant_4bit`` too, from its first release 0.32)."""
    return kv_cache_dtype.startswith("turboquant_") or kv_cache_dtype == "ultraquant_4bit"


def boundary_skip_layers(scenario: Scenario) -> tuple[str, ...]:
    """``TurboQuantConfig.get_boundary_skip_layers`` (vllm/model_executor/layers/quantization/
    turboquant/config.py, unchanged 0.23 ... 0.33) as ``EngineArgs.create_engine_config`` calls
    it for a packed dtype: none for a hybrid, else the first and last ``min(2, L // 2)`` layer
    indices of ``num_hidden_layers = L``."""
    model = scenario.model
    if model is None or not packs_boundary(scenario.runtime.kv_cache_dtype) or model.is_hybrid:
        return ()
    layers = model.num_hidden_layers
    n = min(BOUNDARY_SKIP_LAYERS, layers // 2)
    return tuple(str(i) for i in sorted({*range(n), *range(layers - n, layers)}))


def skip_layers(scenario: Scenario) -> tuple[str, ...]:
    """``cache_config.kv_cache_dtype_skip_layers`` as the engine leaves it: the scenario's
    ``--kv-cache-dtype-skip-layers`` plus :func:`boundary_skip_layers` (``sorted(set | set)``)."""
    return tuple(sorted({*scenario.runtime.kv_cache_dtype_skip_layers, *boundary_skip_layers(scenario)}))


def is_skip_layer(index: int, kind: str, skip: tuple[str, ...]) -> bool:
    """``Attention.__init__`` (attention.py): the layer's ``kv_cache_dtype`` becomes ``"auto"``
    when its index is listed, or when it has a sliding window and ``"sliding_window"`` is."""
    return str(index) in skip or (kind == "sliding_window" and "sliding_window" in skip)


def model_level_geometry(scenario: Scenario, release: RuleSet = LATEST) -> AttentionGeometry:
    """The attention geometry of ``ModelConfig.get_head_size`` / ``get_total_num_kv_heads``: from
    0.28 (``model_geometry_max_over_layers``) a heterogeneous checkpoint (Gemma 4's per-layer
    config) collapses each field to its max over layers (``ModelArchitectureConfig.from_layers``,
    vllm/config/model_arch.py); before, the text config's ``head_dim`` / ``num_key_value_heads``."""
    model = scenario.model
    assert model is not None and model.attention is not None
    attn = model.attention
    if not attn.is_heterogeneous or not release.has("model_geometry_max_over_layers"):
        return dataclasses.replace(attn, global_head_dim=None, num_global_kv_heads=None)
    full = attn.for_layer("full_attention")
    return dataclasses.replace(
        attn, head_dim=max(attn.head_dim, full.head_dim),
        num_kv_heads=max(attn.num_kv_heads, full.num_kv_heads),
        global_head_dim=None, num_global_kv_heads=None,
    )  # fmt: skip


def _native_bytes_per_token(scenario: Scenario, kv_cache_dtype: str, release: RuleSet) -> int:
    """``FullAttentionSpec(block_size=1, H, D, dtype).page_size_bytes`` with the model-level
    ``get_num_kv_heads`` / ``get_head_size``: ``H * 2D * dtype size``, no packing."""
    model, rt = scenario.model, scenario.runtime
    assert model is not None
    geo = model_level_geometry(scenario, release)
    heads = max(1, geo.num_kv_heads // rt.tensor_parallel_size)
    dtype = storage_dtype(kv_cache_dtype, model.dtype, rt.registered_kv_cache_dtypes, release)
    return heads * 2 * geo.head_dim * DTYPE_SIZE[dtype]


def _check_skip_layers_modelled(scenario: Scenario, skip: tuple[str, ...]) -> None:
    model = scenario.model
    if skip and model is not None and model.use_mla:
        raise ValueError("kv_cache_dtype_skip_layers on an MLA model: not modelled")


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
    refuse_before_sizing(scenario, release)
    spec = attention_spec(
        model.attention, kind="full_attention", block_size=1, kv_cache_dtype=rt.kv_cache_dtype,
        model_dtype=model.dtype, tensor_parallel_size=rt.tensor_parallel_size,
        registered_dtypes=rt.registered_kv_cache_dtypes, release=release,
    )  # fmt: skip
    a1 = attention_bytes_per_token(spec)
    skip = skip_layers(scenario)
    _check_skip_layers_modelled(scenario, skip)
    # backend_cls.customize_spec: a skip layer's backend (FlashAttention) packs neither FlashInfer's
    # nvfp4 nor Triton's per-token-head format (before 0.28 the spec itself packs the latter)
    packed = rt.kv_cache_dtype in ("nvfp4", "nvfp4_4over6") or (
        rt.kv_cache_dtype.endswith("_per_token_head") and release.has("heterogeneous_kv_backend_packing")
    )
    if packed and _first_attention_is_skip(scenario):
        a1 = _native_bytes_per_token(scenario, rt.kv_cache_dtype, release)
    if packs_boundary(rt.kv_cache_dtype) and skip:  # lcm, not max: the skip page need not divide
        a1 = math.lcm(a1, _native_bytes_per_token(scenario, "auto", release))
    return align_hybrid_block_size(
        a1,
        state_page_bytes(scenario, speculative_rows=release.has("alignment_counts_speculative_rows")
                         or model.architecture not in SPECULATIVE_ROWS_LATE, release=release),
        kernel_block_alignment=rt.kernel_block_alignment,
        block_size=requested_block_size(scenario),
        use_mla=model.use_mla and release.has("mla_hybrid_block_floor"),
        extra_block_alignment=rt.extra_block_alignment
        if rt.mamba_cache_mode == "align" and release.has("prefill_checkpoint_alignment") else 1,
        mamba_chunk_size=model.state.chunk_size if rt.mamba_cache_mode == "all" and model.state else 0,
    )  # fmt: skip


def align_heterogeneous_kv_block_size(
    primary_bytes_per_token: int,
    padded_bytes_per_token: int,
    *,
    kernel_block_alignment: int = 16,
    block_size: int = 16,
    state_page_padded: int | None = None,
) -> tuple[int, int | None, int | None]:
    """``Platform._align_heterogeneous_kv_block_size`` on plain numbers: the block, the
    ``skip_page_size_padded`` and the state page padded after it (None: unpadded).

    ``align = max(kernel block, block)``, ``required = max(padded * kernel block, state page
    padded)``, block ``align * cdiv(required, align * primary)`` (never lowered), shared page
    ``block * primary``; equal per-token pages change nothing."""
    primary, padded = primary_bytes_per_token, padded_bytes_per_token
    if padded < primary:
        raise AssertionError(
            f"padded-spec per-token page ({padded}B) < primary ({primary}B); a higher-precision "
            "padded spec must not be smaller than the quantized primary."
        )
    if padded == primary:
        return block_size, None, state_page_padded
    s = kernel_block_alignment
    align = max(s, block_size)
    required = max(padded * s, state_page_padded or 0)
    block = max(block_size, align * cdiv(required, align * primary))
    shared = block * primary
    return block, shared, None if state_page_padded is None else shared


def _first_attention_is_skip(scenario: Scenario) -> bool:
    """Whether ``backend_classes[0]`` (``_find_non_ssm_backends``: the first attention layer's
    backend) serves a skip layer, i.e. is a native backend."""
    model = scenario.model
    assert model is not None
    first = next((i for i, c in enumerate(model.layers) if c in _ATTENTION_CODES), None)
    if first is None:
        return False
    kind = "sliding_window" if model.layers[first] == "S" else "full_attention"
    return is_skip_layer(first, kind, skip_layers(scenario))


#: kv_cache_dtype values packed by their own backend's ``customize_spec`` (TurboQuant, UltraQuant,
#: FlashInfer nvfp4), which a skip layer's native backend does not apply.
BACKEND_PACKED = ("ultraquant_4bit", "nvfp4", "nvfp4_4over6")


def heterogeneous_primary_bytes_per_token(scenario: Scenario, release: RuleSet = LATEST) -> int:
    """Phase 3's primary page: ``backend_cls.customize_spec(FullAttentionSpec(1, H, D, dtype,
    mode))`` where ``backend_cls`` is the first attention layer's backend
    (``_find_non_ssm_backends``, layer order).

    A quantized layer runs on the one backend that packs its format (TurboQuant, Triton for
    ``*_per_token_head``, FlashInfer for nvfp4, UltraQuant), which prices it as its own spec does.
    A skip layer first (layer 0 of every dense TurboQuant model, a Gemma-style model's sliding
    layer 0 under ``--kv-cache-dtype-skip-layers sliding_window``) keeps the model dtype, and
    CUDA's priority (``_get_backend_priorities``, vllm/platforms/cuda.py) gives it FlashAttention
    (FlashInfer on SM 10.x), whose ``customize_spec`` packs nothing: the primary is ``H * 2D``
    bytes of the storage dtype, without TurboQuant's slot, Triton's per-token-head scales or the
    int4 halving. Before 0.28 (``heterogeneous_kv_backend_packing``) no backend prices it: the
    spec's own page, which holds the per-token-head scales itself and packs no backend format."""
    model, rt = scenario.model, scenario.runtime
    assert model is not None and model.attention is not None
    if release.has("heterogeneous_kv_backend_packing"):
        own = not _first_attention_is_skip(scenario)
    else:
        own = not (rt.kv_cache_dtype.startswith("turboquant_") or rt.kv_cache_dtype in BACKEND_PACKED)
    if not own:
        return _native_bytes_per_token(scenario, rt.kv_cache_dtype, release)
    spec = attention_spec(
        model_level_geometry(scenario, release), kind="full_attention", block_size=1,
        kv_cache_dtype=rt.kv_cache_dtype,
        model_dtype=model.dtype, tensor_parallel_size=rt.tensor_parallel_size,
        registered_dtypes=rt.registered_kv_cache_dtypes, release=release,
    )  # fmt: skip
    return attention_bytes_per_token(spec)


_ATTENTION_CODES = "ASLXP"


def block_choice(
    scenario: Scenario, alignment: HybridAlignment | None, release: RuleSet = LATEST
) -> BlockChoice:
    """The cache config's block sizes and padded state page after ``alignment`` (None for a
    non-hybrid: the requested block, unpadded). ``mamba_block_size`` is the attention block
    in ``align`` and ``all`` mode, else ``max_model_len`` (``MambaModelConfig.verify_and_update_config``).

    Before ``align_block_unbounded_by_batch`` (vLLM 0.27), ``VllmConfig.validate_block_size``
    refuses an ``align``-mode block above ``max_num_batched_tokens`` (``AssertionError``). Both
    run after the engine checked its parallel sizes and built the layers, which refuse first."""
    refuse_before_sizing(scenario, release)
    rt = scenario.runtime
    block, padded = (requested_block_size(scenario), None) if alignment is None else (
        alignment.block_size, alignment.state_page_padded_bytes)  # fmt: skip
    shared, phase2_block = None, block  # Phase 3 leaves mamba_block_size at Phase 2's block
    skip = skip_layers(scenario)
    model = scenario.model  # no attention layer: no backend, update_block_size_for_backend returns
    if (
        skip
        and model is not None
        and model.num_attention_layers
        and release.has("heterogeneous_kv_block_alignment")
    ):
        _check_skip_layers_modelled(scenario, skip)
        block, shared, padded = align_heterogeneous_kv_block_size(
            heterogeneous_primary_bytes_per_token(scenario, release),
            _native_bytes_per_token(scenario, "auto", release),
            kernel_block_alignment=rt.kernel_block_alignment, block_size=block, state_page_padded=padded,
        )  # fmt: skip
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
    mamba_block = phase2_block if rt.mamba_cache_mode in ("align", "all") else rt.max_model_len
    return BlockChoice(block, mamba_block, padded, shared)
