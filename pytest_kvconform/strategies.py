"""Hypothesis strategies for ``kv-scenario/1`` scenarios, and TOML output of a counterexample.

A failing differential test reports its shrunk input as TOML text (``scenario_toml``), ready to
paste into a scenario file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hypothesis import strategies as st

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


@st.composite
def attention_tables(draw: st.DrawFn) -> dict[str, Any]:
    if draw(st.booleans()):
        return {"kind": "gqa", "num_kv_heads": draw(st.sampled_from([1, 2, 4, 8])),
                "head_dim": draw(st.sampled_from([64, 128, 192, 256]))}  # fmt: skip
    return {"kind": "mla", "kv_lora_rank": draw(st.sampled_from([256, 512])), "qk_rope_head_dim": 64}


@st.composite
def state_tables(draw: st.DrawFn) -> dict[str, Any]:
    def one_of(*values: Any) -> Any:
        return draw(st.sampled_from(values))

    kind = one_of("mamba1", "mamba2", "gdn", "kda", "short_conv")
    table: dict[str, Any] = {"kind": kind, "conv_kernel": one_of(2, 3, 4)}
    if kind == "mamba1":
        table.update(intermediate_size=one_of(1024, 2048, 4096), d_state=one_of(16, 64))
    elif kind == "mamba2":
        table.update(
            n_groups=one_of(1, 2, 8), n_heads=one_of(32, 48, 64, 128), head_dim=64, d_state=one_of(64, 128),
            ssm_dtype=one_of("auto", "float32"),
        )  # fmt: skip
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


@st.composite
def scenario_dicts(draw: st.DrawFn, hybrid: bool | None = None) -> dict[str, Any]:
    """A valid model-level scenario as parsed TOML tables (attention-only or hybrid)."""
    is_hybrid = draw(st.booleans()) if hybrid is None else hybrid
    n = draw(st.integers(2, 12))
    attention = draw(attention_tables())
    if is_hybrid:
        period = draw(st.integers(2, 4))
        layers = "".join("A" if (i + 1) % period == 0 else "M" for i in range(n))
        if "A" not in layers:
            layers = layers[:-1] + "A"
    else:
        layers = "A" * n
    dtype = draw(st.sampled_from(["bfloat16", "float16"]))
    architecture = "DeepseekV2ForCausalLM" if attention["kind"] == "mla" else "LlamaForCausalLM"
    model = {"architecture": architecture, "dtype": dtype, "num_hidden_layers": n, "layers": layers,
             "attention": attention}  # fmt: skip
    if is_hybrid:
        state = draw(state_tables())
        model["architecture"] = draw(st.sampled_from(HYBRID_ARCHITECTURES[state["kind"]]))
        if state["kind"] == "mamba2":  # a Mamba-2 mixer has intermediate = heads * head_dim
            state["intermediate_size"] = state["n_heads"] * state["head_dim"]
        if model["architecture"] in ("GraniteMoeHybridForCausalLM", "Qwen3NextForCausalLM"):
            state["ssm_dtype"] = "auto"  # their configs have no state-dtype field
        model["state"] = state
    dtypes = _MLA_DTYPES if attention["kind"] == "mla" else _GQA_DTYPES
    runtime = {
        "max_model_len": draw(st.integers(1, 1 << 17)),
        "block_size": draw(st.sampled_from([16, 32, 64])),
        "kernel_block_alignment": draw(st.sampled_from([16, 32, 64])),
        "kv_cache_dtype": draw(st.sampled_from(dtypes)),
        "num_speculative_tokens": draw(st.integers(0, 2)),
        "kv_cache_memory_bytes": draw(st.integers(1 << 20, 64 << 30)),
        "mamba_cache_mode": draw(st.sampled_from(["none", "align"])),
    }
    return {"schema": "kv-scenario/1", "name": "generated", "model": model, "runtime": runtime}


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
