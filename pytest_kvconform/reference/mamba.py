"""State pages of Mamba-1, Mamba-2, GDN, KDA and short-conv layers.

Mirrors ``MambaStateShapeCalculator`` and ``MambaStateDtypeCalculator``
(vllm/model_executor/layers/mamba/mamba_utils.py) and ``MambaBase.get_kv_cache_spec``
(mamba/abstract.py) of vLLM 0.33.0. The conv state keeps the default "SD" orientation
``(rows, dim)``; "DS" has the same bytes.
"""

from __future__ import annotations

from ..rejections import Rejected
from ..scenario import Scenario, StateGeometry
from .dtypes import mamba_dtypes
from .releases import LATEST, RuleSet
from .specs import MambaSpec

Shapes = tuple[tuple[int, ...], ...]


def divide(numerator: int, denominator: int) -> int:
    """``vllm.distributed.utils.divide``: exact division or an error naming both numbers."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def extra_groups_for_head_shards(n_groups: int, tp: int) -> int:
    """``extra_groups_for_head_shards``: groups added so each TP rank holds whole groups.

    Like vLLM it assumes ``n_groups < tp`` or ``n_groups % tp == 0``; for other inputs it
    returns vLLM's (negative) value unchanged.
    """
    return 0 if n_groups % tp == 0 else tp - n_groups


#: The model classes implementing ``SupportsMambaPrefixCaching`` (vllm/model_executor/models/,
#: vLLM 0.23 ... 0.31): the ones ``mamba_cache_mode = "all"`` keeps.
MAMBA_PREFIX_CACHING = frozenset({
    "MambaForCausalLM", "Mamba2ForCausalLM", "BambaForCausalLM", "JambaForCausalLM", "NemotronHForCausalLM",
    "GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM", "Zamba2ForCausalLM",
})  # fmt: skip


def verify_mamba_cache_mode(scenario: Scenario, release: RuleSet = LATEST) -> None:
    """``--mamba-cache-mode all``: from vLLM 0.32 (``mamba_cache_mode_all_removed``) not a
    ``MambaCacheMode`` (vllm/config/cache.py: "align" | "none"), refused when the config is built.
    Before, ``MambaModelConfig.verify_and_update_config`` keeps it for a model class that supports
    Mamba prefix caching and falls back to "align" for any other, which is not modelled (state
    "align"). A model without state layers reads no mode."""
    model = scenario.model
    if scenario.runtime.mamba_cache_mode != "all":
        return
    if release.has("mamba_cache_mode_all_removed"):
        raise Rejected(
            "unsupported_setting",
            "mamba_cache_mode 'all': vLLM 0.32 and later accept 'align' or 'none' "
            "(CacheConfig.mamba_cache_mode)",
        )
    if model is not None and model.num_state_layers and model.architecture not in MAMBA_PREFIX_CACHING:
        raise Rejected(
            "not_modelled",
            f"mamba_cache_mode 'all' on {model.architecture}: vLLM falls back to 'align' (no Mamba prefix "
            "caching support); state mamba_cache_mode = 'align'",
        )


def verify_mamba2_split(scenario: Scenario) -> None:
    """``MambaMixer2.__init__`` (vllm/model_executor/layers/mamba/mamba_mixer2.py, 0.23 ... 0.33)
    asserts its TP split while the model is built: the TP size divides the heads, and the groups
    unless there is one group (replicated to every rank)."""
    model, tp = scenario.model, scenario.runtime.tensor_parallel_size
    state = model.state if model is not None else None
    if state is None or state.kind != "mamba2":
        return
    if state.n_heads % tp:
        raise AssertionError("Tensor parallel world size must divide num heads.")
    if state.n_groups % tp and state.n_groups != 1:
        raise AssertionError(
            "If tensor parallel world size does not divide num_groups, then num_groups must equal 1."
        )


def state_shapes(state: StateGeometry, tp: int = 1, num_spec: int = 0, release: RuleSet = LATEST) -> Shapes:
    """Per-layer state tensor shapes (``MambaStateShapeCalculator.<kind>_state_shape``).

    KDA conv states have speculative rows from vLLM 0.27 (``kda_conv_speculative_rows``), short-conv
    ones from 0.29 (``short_conv_speculative_rows``); before, ``K - 1`` rows."""
    rows = state.conv_kernel - 1 + num_spec
    late = {"kda": "kda_conv_speculative_rows", "short_conv": "short_conv_speculative_rows"}
    if state.kind in late and not release.has(late[state.kind]):
        rows = state.conv_kernel - 1
    if state.kind == "mamba1":
        inner = divide(state.intermediate_size, tp)
        return ((state.conv_kernel - 1, inner), (inner, state.d_state))  # no speculative rows
    if state.kind == "mamba2":
        groups = state.n_groups + extra_groups_for_head_shards(state.n_groups, tp)
        conv_dim = state.intermediate_size + 2 * groups * state.d_state
        return ((rows, divide(conv_dim, tp)), (divide(state.n_heads, tp), state.head_dim, state.d_state))
    if state.kind == "gdn":
        conv_dim = state.key_head_dim * state.num_key_heads * 2 + state.value_head_dim * state.num_value_heads
        return (
            (rows, divide(conv_dim, tp)),
            (divide(state.num_value_heads, tp), state.value_head_dim, state.key_head_dim),
        )
    if state.kind == "kda":
        conv_dim = 3 * state.num_heads * state.head_dim
        return ((rows, divide(conv_dim, tp)), (divide(state.num_heads, tp), state.head_dim, state.head_dim))
    if state.kind == "short_conv":
        return ((rows, divide(state.conv_dim, tp)),)
    raise ValueError(f"unknown state kind {state.kind!r}")


def state_spec(
    scenario: Scenario,
    *,
    block_size: int,
    page_size_padded: int | None = None,
    shapes: Shapes | None = None,
    mamba2_checkpoint_block: bool = True,
    gdn_checkpoint_block: bool = True,
    release: RuleSet = LATEST,
) -> MambaSpec:
    """The ``MambaSpec`` one state layer reports (``MambaBase.get_kv_cache_spec``).

    Mamba-2 mixers export one prefill checkpoint block (``MambaMixer2``, vLLM 0.32+; not
    without ``mamba2_checkpoint_block``), and so do Qwen GDN layers in align mode with FlashInfer's
    GDN prefill, which the scenario says with ``extra_block_alignment`` > 1
    (``QwenGatedDeltaNetAttention.get_kv_cache_spec``, layers/mamba/gdn/qwen_gdn_linear_attn.py,
    vLLM 0.33; not without ``gdn_checkpoint_block``); speculative tokens add conv rows and
    ``num_speculative_blocks`` pages. ``shapes`` defaults to :func:`state_shapes` of the scenario;
    shapes and dtypes follow ``release``.
    """
    model, rt = scenario.model, scenario.runtime
    assert model is not None and model.state is not None
    state = model.state
    if shapes is None:
        shapes = state_shapes(state, rt.tensor_parallel_size, rt.num_speculative_tokens, release)
    conv, ssm = mamba_dtypes(
        state.kind, model.dtype, rt.mamba_cache_dtype, rt.mamba_ssm_cache_dtype, state.ssm_dtype, release
    )
    dtypes = (conv,) if state.kind == "short_conv" else (conv, ssm)
    return MambaSpec(
        block_size=block_size, shapes=shapes, dtypes=dtypes, page_size_padded=page_size_padded,
        mamba_type=state.kind, num_speculative_blocks=rt.num_speculative_tokens,
        num_prefill_checkpoint_blocks=int(
            (state.kind == "mamba2" and mamba2_checkpoint_block)
            or (state.kind == "gdn" and gdn_checkpoint_block and rt.mamba_cache_mode == "align"
                and rt.extra_block_alignment > 1)
        ),
    )  # fmt: skip


def state_page_bytes(scenario: Scenario, *, speculative_rows: bool = True, release: RuleSet = LATEST) -> int:
    """Unpadded state page of one layer (``MambaSpec.page_size_bytes`` without padding) under
    ``release``; without ``speculative_rows``, the conv state has no rows for speculative tokens."""
    model, rt = scenario.model, scenario.runtime
    assert model is not None and model.state is not None
    rows = rt.num_speculative_tokens if speculative_rows else 0
    shapes = state_shapes(model.state, rt.tensor_parallel_size, rows, release)
    spec = state_spec(scenario, block_size=rt.max_model_len, shapes=shapes, release=release)
    return spec.real_page_size_bytes
