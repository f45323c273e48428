"""Offline config.json writers: one per architecture, in that family's own spelling.

A writer turns a scenario's ``[model]`` into the config.json (no weights) that makes vLLM see
the same geometry; :func:`hf_config_dict` looks the architecture up in :data:`WRITERS`. A
scenario the family's config cannot express raises :class:`UnsupportedByVllmError` naming the
field. Add a family with ``@writer("SomeForCausalLM")``.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from typing import Any

from ...scenario import ModelGeometry, Scenario
from .runtime import UnsupportedByVllmError

ConfigWriter = Callable[[Scenario, dict[str, Any]], dict[str, Any]]

#: architecture -> writer(scenario, common fields) -> config.json dict
WRITERS: dict[str, ConfigWriter] = {}


def writer(*architectures: str) -> Callable[[ConfigWriter], ConfigWriter]:
    def register(fn: ConfigWriter) -> ConfigWriter:
        for arch in architectures:
            WRITERS[arch] = fn
        return fn

    return register


def hf_config_dict(scenario: Scenario) -> dict[str, Any]:
    """The config.json that makes vLLM see the scenario's model (see :data:`WRITERS`)."""
    model, rt = scenario.model, scenario.runtime
    if model is None or model.attention is None:
        raise UnsupportedByVllmError(
            "no_model", f"{scenario.name}: a spec-level or attention-free scenario has no model"
        )
    write = WRITERS.get(model.architecture)
    if write is None:
        raise UnsupportedByVllmError(
            "no_config_writer",
            f"{model.architecture}: no config.json writer (have: {', '.join(sorted(WRITERS))})",
        )
    common: dict[str, Any] = {
        "architectures": [model.architecture], "num_hidden_layers": model.num_hidden_layers,
        # max_model_len = -1 derives the length from here: then exactly the scenario's
        "vocab_size": 1024,
        "max_position_embeddings": (  # the model's, where the scenario states it
            rt.max_model_len if rt.auto_fit_max_model_len
            else model.max_position_embeddings or max(rt.max_model_len, 4096)
        ),
        "torch_dtype": model.dtype, "intermediate_size": 256, "tie_word_embeddings": False,
    }  # fmt: skip
    config = write(scenario, common)
    if model.num_nextn_predict_layers:  # the MTP modules, which SpeculativeConfig reads
        if "text_config" in config:  # Qwen3.5/3.6
            config["text_config"]["mtp_num_hidden_layers"] = model.num_nextn_predict_layers
        else:
            config["num_nextn_predict_layers"] = model.num_nextn_predict_layers
    return config


def _state(scenario: Scenario, kind: str) -> Any:
    """The scenario's state geometry, which must be ``kind``; an attention-only model of a hybrid
    family gets that family's smallest state (its config.json needs the fields; no layer uses it)."""
    model = scenario.model
    assert model is not None
    if model.state is None:
        from ...scenario import StateGeometry

        head = model.attention.head_dim
        return StateGeometry(kind=kind, conv_kernel=4, intermediate_size=2 * head, n_groups=1, n_heads=2,
                             head_dim=head, d_state=16)  # fmt: skip
    if model.state.kind != kind:
        raise UnsupportedByVllmError(
            "no_config_writer", f"{model.architecture}: state kind {model.state.kind!r}, expected {kind!r}"
        )
    return model.state


def _no_state_dtype_field(scenario: Scenario) -> None:
    model = scenario.model
    assert model is not None
    if model.state is not None and model.state.ssm_dtype != "auto":
        raise UnsupportedByVllmError(
            "no_config_writer",
            f"{model.architecture}: config.json has no field for the state dtype {model.state.ssm_dtype}",
        )


def layer_list(model: ModelGeometry, attention: str, state: str, other: str | None = None) -> list[str]:
    """The layer string spelled with the family's names for each code."""
    names = {"A": attention, "M": state}
    if other is not None:
        names["-"] = other
    bad = sorted(set(model.layers) - set(names))
    if bad:
        raise UnsupportedByVllmError(
            "no_config_writer",
            f"{model.architecture}: layer code(s) {''.join(bad)!r} have no spelling in its config.json",
        )
    return [names[c] for c in model.layers]


def attention_fields(
    scenario: Scenario, hidden_size: int | None = None, *, per_layer: bool = False
) -> dict[str, Any]:
    """GQA heads, with ``hidden_size = num_attention_heads * head_dim`` (some families derive
    head_dim from the hidden size); with a given ``hidden_size`` the query heads follow from it.
    The full layers' own geometry (``global_head_dim``) only where the writer spells it (``per_layer``).
    Query heads the scenario does not give are chosen so that the TP size divides them."""
    model, tensor_parallel_size = scenario.model, scenario.runtime.tensor_parallel_size
    assert model is not None
    attn = model.attention
    assert attn is not None
    if attn.kind != "gqa" or attn.head_dim_v is not None:
        raise UnsupportedByVllmError(
            "no_config_writer", f"{model.architecture}: only GQA attention with head_dim_v == head_dim"
        )
    if attn.is_heterogeneous and not per_layer:
        raise UnsupportedByVllmError(
            "no_config_writer",
            f"{model.architecture}: its config.json has no global_head_dim / num_global_kv_heads (Gemma 4's)",
        )
    heads = attn.num_attention_heads or math.lcm(max(attn.num_kv_heads, 1) * 4, tensor_parallel_size)
    if hidden_size is not None:
        heads, rest = divmod(hidden_size, attn.head_dim)
        if rest or heads % attn.num_kv_heads:
            raise UnsupportedByVllmError(
                "no_config_writer",
                f"{model.architecture}: hidden size {hidden_size} is not a whole number of "
                f"{attn.head_dim}-wide heads grouped by {attn.num_kv_heads} KV heads",
            )
        if heads % tensor_parallel_size and not attn.num_attention_heads:
            raise UnsupportedByVllmError(
                "no_config_writer",
                f"{model.architecture}: its hidden size gives {heads} query heads, which tensor parallel "
                f"size {tensor_parallel_size} does not divide; set [model.attention].num_attention_heads",
            )
    return {"num_attention_heads": heads, "num_key_value_heads": attn.num_kv_heads, "head_dim": attn.head_dim,
            "hidden_size": heads * attn.head_dim}  # fmt: skip


def _dense_only(model: ModelGeometry) -> None:
    if model.state is not None or set(model.layers) - {"A"}:
        raise UnsupportedByVllmError(
            "no_config_writer",
            f"{model.architecture}: its config.json spells full-attention layers only, not {model.layers!r}",
        )


@writer("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
def dense_gqa(scenario: Scenario, common: dict[str, Any]) -> dict[str, Any]:
    """Dense decoders whose every layer is full GQA attention (configuration_llama and kin), or,
    for Mistral, every layer sliding (configuration_mistral's ``sliding_window``, Mistral-7B-v0.1's
    4096), spelled as ``layer_types`` too: vLLM's ``LlamaAttention`` reads a layer's window from it."""
    model = scenario.model
    assert model is not None and model.attention is not None
    sliding = model.architecture == "MistralForCausalLM" and set(model.layers) == {"S"}
    if not sliding:
        _dense_only(model)
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                  "Qwen3ForCausalLM": "qwen3"}[model.architecture]  # fmt: skip
    window = (
        {
            "sliding_window": model.attention.sliding_window,
            "layer_types": ["sliding_attention"] * len(model.layers),
        }
        if sliding
        else {}
    )
    return {**common, **attention_fields(scenario), "model_type": model_type, **window}


@writer("BertModel")
def bert(scenario: Scenario, common: dict[str, Any]) -> dict[str, Any]:
    """Encoder-only BERT (configuration_bert): multi-head attention whose layers hold no KV cache
    (vLLM's ``EncoderOnlyAttention``), so every layer is ``-``; vLLM serves it as a pooling model."""
    model = scenario.model
    assert model is not None and model.attention is not None
    if model.state is not None or set(model.layers) != {"-"}:
        raise UnsupportedByVllmError(
            "no_config_writer",
            f"{model.architecture}: an encoder-only model (every layer -), not {model.layers!r}",
        )
    heads = model.attention.num_kv_heads
    return {
        **common, "model_type": "bert", "hidden_size": heads * model.attention.head_dim,
        "num_attention_heads": heads, "max_position_embeddings": model.max_position_embeddings or 512,
        "type_vocab_size": 2, "hidden_act": "gelu", "layer_norm_eps": 1e-12,
        "position_embedding_type": "absolute",
    }  # fmt: skip


@writer("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")
def deepseek_mla(scenario: Scenario, common: dict[str, Any]) -> dict[str, Any]:
    """MLA decoders (``kv_lora_rank``, ``qk_rope_head_dim``; vLLM's ``get_head_size`` is their
    sum); the smallest MoE the model class accepts: the experts hold no KV cache."""
    model = scenario.model
    assert model is not None and model.attention is not None
    attn = model.attention
    _dense_only(model)
    if attn.kind != "mla" or attn.indexer_head_dim:
        raise UnsupportedByVllmError(
            "no_config_writer", f"{model.architecture}: MLA without a sparse indexer (kind {attn.kind!r})"
        )
    model_type = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                  "Glm4MoeLiteForCausalLM": "glm4_moe_lite"}[model.architecture]  # fmt: skip
    rope = attn.qk_rope_head_dim
    return {
        **common, "model_type": model_type, "hidden_size": 1024, "num_attention_heads": 8,
        "num_key_value_heads": 8, "kv_lora_rank": attn.kv_lora_rank, "qk_rope_head_dim": rope,
        # get_head_size distrusts qk_rope_head_dim == qk_nope_head_dim (a transformers bug).
        "qk_nope_head_dim": rope + 64, "v_head_dim": 128, "q_lora_rank": None, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "moe_intermediate_size": 64,
    }  # fmt: skip


@writer("GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM")
def deepseek_sparse_mla(scenario: Scenario, common: dict[str, Any]) -> dict[str, Any]:
    """MLA with the DSA lightning indexer (``index_head_dim``, ``index_n_heads``, ``index_topk``;
    configuration_glm_moe_dsa / vLLM's deepseek_v32 model)."""
    model = scenario.model
    assert model is not None and model.attention is not None
    attn = model.attention
    _dense_only(model)
    if attn.kind != "mla" or not attn.indexer_head_dim or attn.indexer_layers is not None:
        raise UnsupportedByVllmError(
            "no_config_writer", f"{model.architecture}: MLA with an indexer on every layer"
        )
    model_type = {"GlmMoeDsaForCausalLM": "glm_moe_dsa", "DeepseekV32ForCausalLM": "deepseek_v32"}[
        model.architecture
    ]
    rope = attn.qk_rope_head_dim
    return {
        **common, "model_type": model_type, "hidden_size": 1024, "num_attention_heads": 8,
        "num_key_value_heads": 8, "kv_lora_rank": attn.kv_lora_rank, "qk_rope_head_dim": rope,
        "qk_nope_head_dim": rope + 64, "v_head_dim": 128, "q_lora_rank": 512, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "moe_intermediate_size": 64, "index_head_dim": attn.indexer_head_dim, "index_n_heads": 4,
        "index_topk": 64,
    }  # fmt: skip


#: what each Gemma text config needs besides the shared fields (vLLM 0.23's Gemma2ForCausalLM
#: asserts tie_word_embeddings: every Gemma 2 ties its embeddings)
GEMMA_2_3 = {
    "Gemma2ForCausalLM": {"model_type": "gemma2", "tie_word_embeddings": True},
    "Gemma3ForCausalLM": {"model_type": "gemma3_text"},
}


@writer(*GEMMA_2_3)
def gemma2_3(scenario: Scenario, common: dict[str, Any]) -> dict[str, Any]:
    """``layer_types`` of sliding_attention/full_attention and ``sliding_window``
    (configuration_gemma2, ``Gemma2Config``; configuration_gemma3, ``Gemma3TextConfig``)."""
    model = scenario.model
    assert model is not None and model.attention is not None
    if model.state is not None or set(model.layers) - {"A", "S"}:
        raise UnsupportedByVllmError(
            "no_config_writer", f"{model.architecture}: layers are sliding (S) or full (A) only"
        )
    return {
        **common, **attention_fields(scenario), **GEMMA_2_3[model.architecture],
        "layer_types": ["sliding_attention" if c == "S" else "full_attention" for c in model.layers],
        "sliding_window": model.attention.sliding_window or 4096,
        "query_pre_attn_scalar": model.attention.head_dim,
    }  # fmt: skip


GEMMA4 = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")


@writer(*GEMMA4)
def gemma4(scenario: Scenario, common: dict[str, Any]) -> dict[str, Any]:
    """``layer_types``, ``sliding_window`` and the full layers' ``global_head_dim`` and
    ``num_global_key_value_heads`` (configuration_gemma4, ``Gemma4TextConfig``): its
    ``__post_init__`` builds ``per_layer_config`` (full layers: ``head_dim = global_head_dim``; with
    ``attention_k_eq_v``, ``num_key_value_heads = num_global_key_value_heads``), which
    ``Gemma4DecoderLayer`` reads per layer (vllm/model_executor/models/gemma4.py). The multimodal
    ``Gemma4ForConditionalGeneration`` is written as its text model ``Gemma4ForCausalLM``: the
    vision tower holds no KV cache. ``global_head_dim`` defaults to 512 in transformers, so it is
    always written (the sliding head size when the scenario has none)."""
    model = scenario.model
    assert model is not None and model.attention is not None
    attn = model.attention
    if model.state is not None or set(model.layers) - {"A", "S"}:
        raise UnsupportedByVllmError(
            "no_config_writer", f"{model.architecture}: layers are sliding (S) or full (A) only"
        )
    if model.layers[-1] != "A":
        raise UnsupportedByVllmError(
            "no_config_writer",
            f"{model.architecture}: Gemma4TextConfig forces the last layer to full attention",
        )
    fields, arch = attention_fields(scenario, per_layer=True), model.architecture
    if not attn.num_attention_heads and attn.num_global_kv_heads:  # the full layers group them too
        fields["num_attention_heads"] = math.lcm(fields["num_attention_heads"], attn.num_global_kv_heads)
    fields["hidden_size"] = 1024  # Gemma 4 keeps head_dim apart from hidden_size / heads
    return {
        **common, **fields, "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
        **({} if arch == "Gemma4ForCausalLM" else {"kvconform_substitutes": arch}),
        "layer_types": ["sliding_attention" if c == "S" else "full_attention" for c in model.layers],
        "sliding_window": attn.sliding_window or 4096,
        "global_head_dim": attn.global_head_dim or attn.head_dim,
        "num_global_key_value_heads": attn.num_global_kv_heads or attn.num_kv_heads,
        "attention_k_eq_v": True,  # gates num_global_key_value_heads; K and V are still both cached
        "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0, "enable_moe_block": False,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1_000_000.0},
        },
    }  # fmt: skip


@writer("GraniteMoeHybridForCausalLM")
def granite_moe_hybrid(scenario: Scenario, common: dict[str, Any]) -> dict[str, Any]:
    """``layer_types`` of attention/mamba and ``mamba_*`` (configuration_granitemoehybrid)."""
    model, st = scenario.model, _state(scenario, "mamba2")
    assert model is not None
    _no_state_dtype_field(scenario)
    expand = 2 if st.intermediate_size % 2 == 0 else 1
    return {
        # GraniteMoeHybridAttention derives head_dim = hidden_size // num_attention_heads.
        **common, **attention_fields(scenario, st.intermediate_size // expand),
        "model_type": "granitemoehybrid", "mamba_expand": expand,
        "layer_types": layer_list(model, "attention", "mamba"),
        "mamba_n_heads": st.n_heads, "mamba_d_head": st.head_dim, "mamba_d_state": st.d_state,
        "mamba_n_groups": st.n_groups, "mamba_d_conv": st.conv_kernel, "num_local_experts": 0,
        **({"mamba_chunk_size": st.chunk_size} if st.chunk_size else {}),
    }  # fmt: skip


@writer("NemotronHForCausalLM")
def nemotron_h(scenario: Scenario, common: dict[str, Any]) -> dict[str, Any]:
    """``hybrid_override_pattern`` of ``*``/``M``/``-`` and ``mamba_ssm_cache_dtype``."""
    model, st = scenario.model, _state(scenario, "mamba2")
    assert model is not None
    if st.intermediate_size != st.n_heads * st.head_dim:
        raise UnsupportedByVllmError(
            "no_config_writer",
            f"{model.architecture}: vLLM derives intermediate_size = mamba_num_heads * mamba_head_dim "
            f"({st.n_heads * st.head_dim}), the scenario has {st.intermediate_size}",
        )
    return {
        **common, **attention_fields(scenario), "model_type": "nemotron_h",
        "hidden_size": st.intermediate_size // 2, "expand": 2,
        "hybrid_override_pattern": "".join(layer_list(model, "*", "M", "-")),
        "mamba_num_heads": st.n_heads, "mamba_head_dim": st.head_dim, "ssm_state_size": st.d_state,
        "n_groups": st.n_groups, "conv_kernel": st.conv_kernel,
        "mamba_ssm_cache_dtype": model.dtype if st.ssm_dtype == "auto" else st.ssm_dtype,
        **({"chunk_size": st.chunk_size} if st.chunk_size else {}),
    }  # fmt: skip


QWEN35 = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


def _dense_moe(tensor_parallel_size: int) -> dict[str, Any]:
    """The smallest MoE the family's model class accepts at this TP size (it refuses more TP ranks
    than experts): the experts hold no KV cache."""
    return {
        "num_experts": max(4, tensor_parallel_size),
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
    }


def qwen35_model_class_importable() -> bool:
    """vLLM's Qwen3.5 model classes import torchvision (via qwen3_vl); the CPU recipe removes it."""
    return importlib.util.find_spec("torchvision") is not None


@writer("Qwen3NextForCausalLM", *QWEN35)
def qwen_gdn(scenario: Scenario, common: dict[str, Any]) -> dict[str, Any]:
    """``layer_types`` of full/linear_attention and ``linear_*`` (Qwen3.5: inside
    ``text_config``, plus ``mamba_ssm_dtype``)."""
    model, st = scenario.model, _state(scenario, "gdn")
    assert model is not None
    arch = model.architecture
    text = {
        **attention_fields(scenario), "num_hidden_layers": model.num_hidden_layers, "vocab_size": 1024,
        "hidden_size": 1024, "intermediate_size": 256,
        "max_position_embeddings": common["max_position_embeddings"],
        "layer_types": layer_list(model, "full_attention", "linear_attention"),
        "linear_num_key_heads": st.num_key_heads, "linear_num_value_heads": st.num_value_heads,
        "linear_key_head_dim": st.key_head_dim, "linear_value_head_dim": st.value_head_dim,
        "linear_conv_kernel_dim": st.conv_kernel, "torch_dtype": model.dtype,
    }  # fmt: skip
    if arch in QWEN35 and not qwen35_model_class_importable():
        # vLLM's qwen3_5.py imports qwen3_vl, whose image processor needs torchvision, which
        # the CPU install must remove. Qwen3Next's model class computes the GDN state with the
        # same calls; offline.py then applies Qwen3.5's mamba_ssm_dtype rule with vLLM's own
        # Qwen3_5ForConditionalGenerationConfig.
        text.update(
            architectures=["Qwen3NextForCausalLM"],
            model_type="qwen3_next",
            **_dense_moe(scenario.runtime.tensor_parallel_size),
            kvconform_substitutes=arch,
        )
        if st.ssm_dtype != "auto":
            text["mamba_ssm_dtype"] = st.ssm_dtype
        return text
    if arch == "Qwen3NextForCausalLM":
        _no_state_dtype_field(scenario)
        return {
            **common,
            **text,
            "model_type": "qwen3_next",
            **_dense_moe(scenario.runtime.tensor_parallel_size),
        }
    moe = arch == "Qwen3_5MoeForConditionalGeneration"
    text["model_type"] = "qwen3_5_moe_text" if moe else "qwen3_5_text"
    if moe:
        text.update(_dense_moe(scenario.runtime.tensor_parallel_size))
    if st.ssm_dtype != "auto":
        text["mamba_ssm_dtype"] = st.ssm_dtype
    return {"architectures": [arch], "model_type": "qwen3_5_moe" if moe else "qwen3_5",
            "text_config": text, "torch_dtype": model.dtype}  # fmt: skip


@writer("KimiLinearForCausalLM")
def kimi_linear(scenario: Scenario, common: dict[str, Any]) -> dict[str, Any]:
    """MLA attention layers + KDA state layers.

    The config class is vLLM's own ``KimiLinearConfig`` (vllm/transformers_utils/configs/
    kimi_linear.py, registered for ``model_type = "kimi_linear"``), so no transformers class and
    no hub access is needed. vLLM reads the MLA latent from ``kv_lora_rank`` +
    ``qk_rope_head_dim`` (``get_head_size``; ``use_mla`` because ``kimi_linear`` is a
    DeepSeek-MLA model type) and the KDA state from ``linear_attn_config`` (``num_heads``,
    ``head_dim``, ``short_conv_kernel_size``; ``kda_state_shape``). Layers are listed 1-based in
    ``kda_layers`` / ``full_attn_layers``. The KDA recurrent state is float32 unless
    ``--mamba-ssm-cache-dtype`` says otherwise: the config has no field for it.
    """
    model, st = scenario.model, _state(scenario, "kda")
    assert model is not None and model.attention is not None
    attn = model.attention
    if attn.kind != "mla" or attn.indexer_head_dim:
        raise UnsupportedByVllmError(
            "no_config_writer",
            f"{model.architecture}: full-attention layers are MLA without an indexer (kind {attn.kind!r})",
        )
    codes = layer_list(model, "A", "M")
    rope = attn.qk_rope_head_dim
    return {
        **common, "model_type": "kimi_linear", "hidden_size": 1024, "num_attention_heads": 8,
        "num_key_value_heads": 8, "kv_lora_rank": attn.kv_lora_rank, "qk_rope_head_dim": rope,
        # get_head_size distrusts qk_rope_head_dim == qk_nope_head_dim (a transformers bug).
        "qk_nope_head_dim": rope + 64, "v_head_dim": 128, "q_lora_rank": None, "mla_use_nope": True,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, c in enumerate(codes) if c == "M"],
            "full_attn_layers": [i + 1 for i, c in enumerate(codes) if c == "A"],
            "num_heads": st.num_heads, "head_dim": st.head_dim, "short_conv_kernel_size": st.conv_kernel,
        },
    }  # fmt: skip


@writer("Lfm2ForCausalLM")
def lfm2(scenario: Scenario, common: dict[str, Any]) -> dict[str, Any]:
    """``layer_types`` of conv/full_attention, ``conv_L_cache`` the conv kernel; the short conv's
    width is the hidden size, from which ``Lfm2Attention`` also derives its head_dim."""
    model, st = scenario.model, _state(scenario, "short_conv")
    assert model is not None
    return {
        **common, **attention_fields(scenario, st.conv_dim), "model_type": "lfm2",
        "layer_types": layer_list(model, "full_attention", "conv"), "conv_L_cache": st.conv_kernel,
        "conv_dim": st.conv_dim, "block_dim": st.conv_dim, "block_ff_dim": 256,
    }  # fmt: skip


@writer("JambaForCausalLM")
def jamba(scenario: Scenario, common: dict[str, Any]) -> dict[str, Any]:
    """A periodic ``attn_layer_period`` / ``attn_layer_offset`` and ``mamba_*``."""
    model, st = scenario.model, _state(scenario, "mamba1")
    assert model is not None
    attn = [i for i, c in enumerate(model.layers) if c == "A"]
    period = attn[1] - attn[0] if len(attn) > 1 else model.num_hidden_layers
    if not attn or attn != list(range(attn[0], model.num_hidden_layers, period)) or attn[0] >= period:
        raise UnsupportedByVllmError(
            "no_config_writer", f"{model.architecture}: attention layers are not periodic ({model.layers})"
        )
    expand = 2 if st.intermediate_size % 2 == 0 else 1
    return {
        # JambaAttentionDecoderLayer derives head_dim = hidden_size // num_attention_heads.
        **common, **attention_fields(scenario, st.intermediate_size // expand), "model_type": "jamba",
        "mamba_expand": expand,
        "attn_layer_period": period, "attn_layer_offset": attn[0], "mamba_d_state": st.d_state,
        "mamba_d_conv": st.conv_kernel, "mamba_dt_rank": 64, "num_experts": 1, "expert_layer_period": 1,
        "expert_layer_offset": 0,
    }  # fmt: skip
