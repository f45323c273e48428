"""Hypothesis strategies for ``kv-scenario/1`` scenarios, and TOML output of a counterexample.

A failing differential test reports its shrunk input as TOML text (``scenario_toml``), ready to
paste into a scenario file.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

from hypothesis import strategies as st

from .reference.hybrid import skip_layers
from .scenario import Scenario, scenario_from_dict

_GQA_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8_per_token_head", "turboquant_k8v4", "turboquant_4bit_nc",
               "turboquant_3bit_nc", "nvfp4", "ultraquant_4bit")  # fmt: skip
_MLA_DTYPES = ("auto", "fp8", "fp8_ds_mla", "nvfp4_ds_mla")
#: Real hybrid architectures per state kind, so backends that build a config.json can (vLLM).
HYBRID_ARCHITECTURES = {
    "mamba1": ("JambaForCausalLM",),
    "mamba2": ("GraniteMoeHybridForCausalLM", "NemotronHForCausalLM"),
    "gdn": ("Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration"),
    "kda": ("KimiLinearForCausalLM",),
    "short_conv": ("Lfm2ForCausalLM",),
}
#: Dense architectures: full-attention GQA, GQA with sliding-window layers, the same with the full
#: layers' own head size and KV heads (Gemma 4's global_head_dim / num_global_key_value_heads), MLA.
DENSE_ARCHITECTURES = {"gqa": ("LlamaForCausalLM", "Qwen3ForCausalLM"), "sliding": ("Gemma3ForCausalLM",),
                       "sliding-global": ("Gemma4ForCausalLM",),
                       "mla": ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")}  # fmt: skip
#: The hybrid layers of these families derive head_dim from their hidden size (which the state
#: geometry fixes): the attention must split it into whole heads.
_HEAD_DIM_FROM_HIDDEN = ("GraniteMoeHybridForCausalLM", "JambaForCausalLM", "Lfm2ForCausalLM")
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)
#: Architectures whose checkpoints ship MTP modules vLLM drafts with (``method="mtp"``).
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration")


@functools.cache
def _choice(values: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    return st.sampled_from(values)


def _pick(draw: st.DrawFn, values: Iterable[Any]) -> Any:
    """``draw(st.sampled_from(values))`` from one strategy per choice list: hypothesis works out a
    new strategy's properties on its first draw, and these draws run thousands of times a run."""
    return draw(_choice(tuple(values)))


def gqa_table(draw: st.DrawFn, hidden_size: int | None = None) -> dict[str, Any]:
    """GQA geometry; with ``hidden_size``, one whose heads split it exactly."""
    head_dim = _pick(draw, [64, 128] if hidden_size else [64, 128, 192, 256])
    kv_heads = [k for k in (1, 2, 4, 8) if hidden_size is None or (hidden_size // head_dim) % k == 0]
    return {"kind": "gqa", "num_kv_heads": _pick(draw, kv_heads), "head_dim": head_dim}


def mla_table(draw: st.DrawFn) -> dict[str, Any]:
    return {"kind": "mla", "kv_lora_rank": _pick(draw, [256, 512]), "qk_rope_head_dim": 64}


@st.composite
def state_tables(draw: st.DrawFn, kind: str | None = None) -> dict[str, Any]:
    def one_of(*values: Any) -> Any:
        return _pick(draw, values)

    kind = kind or one_of(*HYBRID_ARCHITECTURES)
    table: dict[str, Any] = {"kind": kind, "conv_kernel": one_of(2, 3, 4)}
    if kind == "mamba1":
        table.update(intermediate_size=one_of(1024, 2048, 4096), d_state=one_of(16, 64))
    elif kind == "mamba2":
        table.update(
            n_groups=one_of(1, 1, 2, 8), n_heads=one_of(32, 48, 64, 128), head_dim=64,
            d_state=one_of(64, 128), ssm_dtype=one_of("auto", "float32"),
        )  # fmt: skip
        table["intermediate_size"] = table["n_heads"] * table["head_dim"]  # a Mamba-2 mixer's
    elif kind == "gdn":
        table.update(
            num_key_heads=one_of(8, 16), num_value_heads=one_of(16, 32, 48), key_head_dim=128,
            value_head_dim=128, ssm_dtype=one_of("auto", "float32"),
        )  # fmt: skip
    elif kind == "kda":
        table.update(num_heads=one_of(16, 32), head_dim=128)
    else:
        table.update(conv_dim=one_of(1024, 2048, 4096))
    return table


def _hidden_size(architecture: str, state: dict[str, Any]) -> int | None:
    if architecture not in _HEAD_DIM_FROM_HIDDEN:
        return None
    if state["kind"] == "short_conv":
        return int(state["conv_dim"])
    return int(state["intermediate_size"]) // 2  # mamba_expand 2


@st.composite
def scenario_dicts(draw: st.DrawFn, hybrid: bool | None = None) -> dict[str, Any]:
    """A valid model-level scenario as parsed TOML tables: a real architecture with attention
    geometry it can spell (dense GQA, GQA with sliding-window layers, MLA, or an attention + state
    hybrid), served at a tensor-parallel size of 1, 2, 4 or 8, with or without speculative tokens,
    a ``--block-size`` or vLLM's default, and a batch budget the sliding windows feel."""
    is_hybrid = draw(st.booleans()) if hybrid is None else hybrid
    n = draw(st.integers(2, 12))
    dtype = _pick(draw, ["bfloat16", "float16"])
    state: dict[str, Any] | None = None
    if is_hybrid:
        state = draw(state_tables())
        architecture = _pick(draw, HYBRID_ARCHITECTURES[state["kind"]])
        attention = (
            mla_table(draw) if state["kind"] == "kda" else gqa_table(draw, _hidden_size(architecture, state))
        )
        if architecture in ("GraniteMoeHybridForCausalLM", "Qwen3NextForCausalLM"):
            state["ssm_dtype"] = "auto"  # their configs have no state-dtype field
        period = draw(st.integers(2, 4))
        layers = "".join("A" if (i + 1) % period == 0 else "M" for i in range(n))
        if "A" not in layers:
            layers = layers[:-1] + "A"
    else:
        family = _pick(draw, sorted(DENSE_ARCHITECTURES))
        architecture = _pick(draw, DENSE_ARCHITECTURES[family])
        attention = mla_table(draw) if family == "mla" else gqa_table(draw)
        layers = "A" * n
        if family.startswith("sliding"):  # Gemma 3/4's pattern: every k-th layer global, the others local
            dtype = "bfloat16"  # vLLM refuses float16 for gemma3_text (numerical instability)
            period = draw(st.integers(2, 6))
            layers = "".join("A" if (i + 1) % period == 0 else "S" for i in range(n))
            attention["sliding_window"] = _pick(draw, [128, 512, 1024, 4096])
        if family == "sliding-global":  # the full layers' own geometry; Gemma 4 ends on a full layer
            layers = layers[:-1] + "A"
            attention["global_head_dim"] = _pick(draw, [128, 256, 512])
            attention["num_global_kv_heads"] = _pick(draw, [1, 2, 4, 8])
    model = {"architecture": architecture, "dtype": dtype, "num_hidden_layers": n, "layers": layers,
             "attention": attention}  # fmt: skip
    if state is not None:
        model["state"] = state
    dtypes = _MLA_DTYPES if attention["kind"] == "mla" else _GQA_DTYPES
    runtime = {
        "max_model_len": draw(st.integers(1, 1 << 17)),
        "tensor_parallel_size": _pick(draw, TENSOR_PARALLEL_SIZES),
        "kernel_block_alignment": _pick(draw, [16, 32, 64]),
        # vLLM's default half the time: for a backend that stores the model dtype only (metal) 8 of
        # 9 GQA inputs would otherwise be known departures, not compared
        "kv_cache_dtype": "auto" if draw(st.booleans()) else _pick(draw, dtypes[1:]),
        "num_speculative_tokens": _pick(draw, [0, 0, 1, 2]),
        "kv_cache_memory_bytes": draw(st.integers(1 << 20, 64 << 30)),
        "mamba_cache_mode": _pick(draw, ["none", "align"]),
        "max_num_batched_tokens": _pick(draw, [512, 2048, 8192]),
    }
    if architecture in MTP_ARCHITECTURES:
        model["num_nextn_predict_layers"] = _pick(draw, [0, 1, 2])
    if not is_hybrid and "S" not in layers:  # DCP ranks dividing TP (vLLM refuses the rest)
        tp = runtime["tensor_parallel_size"]
        ranks = [1, 1, *(d for d in (2, 4) if tp % d == 0)]
        runtime["decode_context_parallel_size"] = _pick(draw, ranks)
    if draw(st.booleans()):  # a --block-size; else vLLM's default and Phase 1
        runtime["block_size"] = _pick(draw, [16, 32, 64, 128])
    if draw(st.integers(0, 3)) == 0:  # max_model_len = -1: auto-fit from the length vLLM derives
        model["max_position_embeddings"] = runtime["max_model_len"]
        runtime["max_model_len"] = -1
    if attention["kind"] == "gqa" and draw(st.integers(0, 3)) == 0:  # --kv-cache-dtype-skip-layers
        names = [str(i) for i in range(n)] + (["sliding_window"] if "S" in layers else [])
        runtime["kv_cache_dtype_skip_layers"] = sorted(draw(st.sets(st.sampled_from(names), min_size=1)))
    if runtime["max_model_len"] != -1 and draw(st.integers(0, 5)) == 0:  # pipeline stages (no auto-fit
        # over stages: not modelled); a pipeline of P keeps P batches in flight, the engine's default
        # (async scheduling) is not modelled: stated
        pp = _pick(draw, [p for p in (2, 3, 4) if p <= n])
        runtime["pipeline_parallel_size"] = runtime["max_concurrent_batches"] = pp
    if (is_hybrid or "S" in layers) and draw(st.integers(0, 5)) == 0:  # --disable-hybrid-kv-cache-manager
        runtime["disable_hybrid_kv_cache_manager"] = True
    return {"schema": "kv-scenario/1", "name": "generated", "model": model, "runtime": runtime}


def _head_shape(attention: Any) -> tuple[int, int]:
    return attention.head_dim, attention.num_kv_heads


def exercised_rules(scenario: Scenario) -> tuple[str, ...]:
    """The TP-, speculation-, window- and block-dependent rules a generated scenario reaches
    (the summary counts compared inputs per entry, so a strategy that stops reaching one shows)."""
    rt, model = scenario.runtime, scenario.model
    if model is None:  # spec-level: MLA next to regular sliding-window layers (the fallback's input)
        kinds = {e.kind for e in scenario.layer_specs}
        return SPEC_LEVEL_RULES if {"mla", "sliding_window"} <= kinds else ()
    attn, state, tp = model.attention, model.state, rt.tensor_parallel_size
    gqa = attn is not None and attn.kind == "gqa"
    hits = (
        tp > 1,
        gqa and attn.num_kv_heads < tp,
        state is not None and state.kind == "mamba2" and state.n_groups % tp != 0,
        rt.num_speculative_tokens > 0,
        rt.num_speculative_tokens > 0 and model.num_nextn_predict_layers > 0,
        "S" in model.layers,
        rt.decode_context_parallel_size > 1,
        rt.user_specified_block_size,
        model.is_hybrid,
        model.use_mla,
        rt.kv_cache_dtype != "auto",
        gqa and "A" in model.layers and _head_shape(attn.for_layer("full_attention")) != _head_shape(attn),
        rt.auto_fit_max_model_len,
        gqa and rt.kv_cache_dtype != "auto" and bool(skip_layers(scenario)),
        _has_draft_layers(scenario),
        rt.pipeline_parallel_size > 1,
        rt.disable_hybrid_kv_cache_manager,
        False,  # spec-level only
    )
    return tuple(name for name, hit in zip(EXERCISABLE_RULES, hits, strict=True) if hit)


#: What :func:`exercised_rules` reports, in this order.
EXERCISABLE_RULES = (
    "tensor parallel (TP > 1)",
    "replicated KV heads (KV heads < TP)",
    "Mamba2 extra groups (n_groups % TP != 0)",
    "speculative tokens",
    "MTP drafter",
    "sliding window",
    "decode context parallel",
    "--block-size given",
    "hybrid state pages",
    "MLA",
    "quantized KV cache",
    "per-layer attention geometry",
    "auto-fit max_model_len (-1)",
    "heterogeneous KV dtypes (skip layers)",
    "MTP draft layers (model-level)",
    "pipeline stages (PP > 1)",
    "hybrid KV cache manager disabled",
    "MLA next to sliding-window layers (spec-level)",
)

#: The rules only :func:`mla_sliding_spec_dicts` reaches (spec-level); the others, :func:`scenario_dicts`.
SPEC_LEVEL_RULES = ("MLA next to sliding-window layers (spec-level)",)


def _has_draft_layers(scenario: Scenario) -> bool:
    """Whether the worker's specs include the MTP drafter's layers (``speculative.num_draft_layers``)."""
    from .reference.speculative import num_draft_layers

    try:
        return num_draft_layers(scenario) > 0
    except ValueError:  # a draft of its own checkpoint: the plan rejects it
        return False


@st.composite
def mla_sliding_spec_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """A spec-level scenario of MLA layers next to regular sliding-window layers, as an MLA target
    with a sliding-window draft would register them (no single architecture has both: see
    reference/grouping.py): the pages unification refuses (an MLA page that does not divide the
    largest, vLLM 0.29+) reach the full-allocation fallback
    (``_try_get_full_allocation_fallback_groups``); the others group as before."""

    def one_of(*values: Any) -> Any:
        return _pick(draw, values)

    mla_block = one_of(16, 32, 64)
    mla = {"kind": "mla", "count": draw(st.integers(1, 4)), "block_size": mla_block, "num_kv_heads": 1,
           "head_size": one_of(576, 320), "dtype": one_of("bfloat16", "float16")}  # fmt: skip
    window = {"kind": "sliding_window", "count": draw(st.integers(1, 4)), "block_size": one_of(16, 32, 64),
              "num_kv_heads": one_of(1, 2, 4, 8), "head_size": one_of(64, 128, 256),
              "dtype": one_of("bfloat16", "float32"), "sliding_window": one_of(128, 512, 4096)}  # fmt: skip
    if draw(st.integers(0, 3)) == 0:  # now and then full attention instead (no fallback: unify pads it)
        window["kind"] = "full_attention"
        del window["sliding_window"]
    runtime = {
        "max_model_len": draw(st.integers(1, 1 << 17)),
        "block_size": mla_block,
        "kv_cache_memory_bytes": draw(st.integers(1 << 24, 64 << 30)),
        "max_num_batched_tokens": one_of(512, 2048, 8192),
        "mamba_cache_mode": "none",
        "max_concurrent_batches": 1,
    }
    return {"schema": "kv-scenario/1", "name": "generated-mla-sliding", "layer_specs": [mla, window],
            "runtime": runtime}  # fmt: skip


def scenarios(hybrid: bool | None = None) -> st.SearchStrategy[Scenario]:
    return scenario_dicts(hybrid).map(lambda d: scenario_from_dict(d, "<hypothesis>"))


def scenario_toml(data: Mapping[str, Any]) -> str:
    """Render scenario tables as ``kv-scenario/1`` TOML (enough for generated scenarios)."""
    lines: list[str] = []

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return str(v)

    def table(name: str, t: Mapping[str, Any]) -> None:
        if name:
            lines.extend(["", f"[{name}]"])
        lines.extend(f"{k} = {value(v)}" for k, v in t.items() if not isinstance(v, Mapping))
        for k, v in t.items():
            if isinstance(v, Mapping):
                table(f"{name}.{k}" if name else k, v)

    table("", data)
    return "\n".join(lines).strip() + "\n"
