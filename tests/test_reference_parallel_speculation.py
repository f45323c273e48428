"""Decode context parallelism, speculative retained tokens and plugin-registered KV dtypes.

Expected numbers are derived here by hand from the vLLM 0.33.0 code each test cites (the same code
is in 0.32.0 unless a test says otherwise); none is copied from running the reference.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from pytest_kvconform.reference import plan
from pytest_kvconform.reference.layers import layer_specs
from pytest_kvconform.reference.rules import ReferenceRules
from pytest_kvconform.reference.speculative import extra_retained_tokens, num_prefill_lookahead_tokens
from pytest_kvconform.scenario import Scenario, ScenarioError, scenario_from_dict


def scenario(layers: str = "A" * 4, *, nextn: int = 0, attention: dict[str, Any] | None = None,
             **runtime: Any) -> Scenario:  # fmt: skip
    model: dict[str, Any] = {
        "architecture": "LlamaForCausalLM", "dtype": "bfloat16", "num_hidden_layers": len(layers),
        "layers": layers,
        "attention": {"kind": "gqa", "num_kv_heads": 8, "head_dim": 128, **(attention or {})},
    }  # fmt: skip
    if model["attention"]["kind"] == "mla":
        model["attention"] = attention
    if nextn:
        model["num_nextn_predict_layers"] = nextn
    # the format's values, not the engine's defaults (reference.defaults)
    runtime = {"mamba_cache_mode": "none", "max_concurrent_batches": 1, **runtime}
    return scenario_from_dict({"schema": "kv-scenario/1", "name": "t", "model": model, "runtime": runtime})


# -- decode context parallelism: FullAttentionSpec.max_memory_usage_bytes divides the tokens


def test_dcp_divides_the_tokens_of_a_full_attention_cache() -> None:
    """L = 8192, DCP 2 (TP 16 > 8 KV heads): cdiv(8192, 2) = 4096 tokens = 256 blocks of 16, not 512."""
    s = scenario(max_model_len=8192, tensor_parallel_size=16, decode_context_parallel_size=2,
                 attention={"num_attention_heads": 64})  # fmt: skip
    assert plan(s).blocks_per_request == 256
    assert plan(scenario(max_model_len=8192, tensor_parallel_size=16)).blocks_per_request == 512


def test_dcp_rounds_the_sharded_length_up() -> None:
    """L = 1000, DCP 4, MLA: cdiv(1000, 4) = 250 tokens -> cdiv(250, 16) = 16 blocks (not 1000/64 = 15.6)."""
    s = scenario(max_model_len=1000, tensor_parallel_size=4, decode_context_parallel_size=4,
                 attention={"kind": "mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64})  # fmt: skip
    assert plan(s).blocks_per_request == 16


@pytest.mark.parametrize(
    ("kv_heads", "tp", "dcp", "query_heads", "message"),
    [
        (8, 6, 4, 0, "tp_size=6 must be divisible by dcp_size=4."),
        (8, 8, 2, 0, "(8) to be greater than the model's total number of KV heads (8)"),
        (8, 16, 4, 0, "`--decode-context-parallel-size` (4) exceeds the maximum supported value (2)"),
        # 12 query heads / 4 KV heads = 3 per KV head, TP 12 allows DCP up to 3: DCP 2 does not divide 3
        (4, 12, 2, 12, "heads per KV head (3) must be divisible by `--decode-context-parallel-size` (2)"),
    ],
)  # fmt: skip
def test_dcp_layouts_vllm_refuses(kv_heads: int, tp: int, dcp: int, query_heads: int, message: str) -> None:
    """ParallelConfig (vllm/config/parallel.py) and ModelConfig.verify_with_parallel_config
    (vllm/config/model.py)."""
    s = scenario(tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                 attention={"num_kv_heads": kv_heads, "num_attention_heads": query_heads})  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(message)):
        layer_specs(s)


def test_dcp_with_a_sliding_window_is_refused() -> None:
    """SlidingWindowSpec.max_memory_usage_bytes asserts "DCP not support sliding window."."""
    s = scenario("SA", tensor_parallel_size=16, decode_context_parallel_size=2,
                 attention={"sliding_window": 512})  # fmt: skip
    with pytest.raises(ValueError, match="DCP not support sliding window"):
        plan(s)


# -- speculative decoding: num_prefill_lookahead_tokens and SlidingWindowSpec.extra_retained_tokens


@pytest.mark.parametrize(
    ("method", "nextn", "spec_tokens", "lookahead"),
    [
        ("ngram", 0, 3, 0),  # not an EAGLE-family drafter
        ("eagle", 0, 3, 1),  # EAGLE reads the next token only
        ("mtp", 1, 3, 1),  # one MTP module run three times: not multi-module
        ("mtp", 3, 3, 3),  # a chain of 3 modules: num_speculative_tokens
        ("mtp", 3, 2, 2),  # min(3, 2) = 2 > 1: num_speculative_tokens
        ("auto", 2, 2, 2),  # auto -> mtp, the model ships 2 modules
        ("auto", 0, 2, 0),  # auto -> ngram
    ],
)
def test_prefill_lookahead(method: str, nextn: int, spec_tokens: int, lookahead: int) -> None:
    """VllmConfig.num_prefill_lookahead_tokens (vllm/config/vllm.py) with SpeculativeConfig.use_eagle
    and use_multi_module_mtp (vllm/config/speculative.py)."""
    s = scenario(nextn=nextn, num_speculative_tokens=spec_tokens, speculative_method=method)
    assert num_prefill_lookahead_tokens(s) == lookahead
    assert extra_retained_tokens(s) == max(0, lookahead - 1)


def test_multi_module_mtp_retains_tokens_below_the_window() -> None:
    """get_kv_cache_configs tags sliding-window specs with extra = lookahead - 1 = 2 (3 MTP modules,
    3 tokens); SlidingWindowSpec.max_admission_blocks_per_request: window 128, F = 2048, block 16:
    cdiv(min(127 + 2 + 2048, 8192), 16) + 1 = cdiv(2177, 16) + 1 = 138 (137 without the 2 tokens).
    A full-attention layer needs cdiv(8192, 16) = 512. With mtp the drafter adds its 3 MTP layers
    (full attention, speculative.num_draft_layers): buckets 1 S and 4 A, 4 >= 1.5 x 1, so group size
    1 and 1 + 4 groups: 138 + 4 x 512 = 2186; ngram has no draft layers: 137 + 512 = 649."""
    base = {"max_model_len": 8192, "attention": {"sliding_window": 128}}
    mtp = scenario("SA", nextn=3, num_speculative_tokens=3, speculative_method="mtp", **base)  # type: ignore[arg-type]
    ngram = scenario("SA", nextn=3, num_speculative_tokens=3, speculative_method="ngram", **base)  # type: ignore[arg-type]
    assert plan(mtp).blocks_per_request == 138 + 4 * 512
    assert plan(ngram).blocks_per_request == 137 + 512
    groups = ReferenceRules().kv_cache_groups(layer_specs(mtp), scenario=mtp)
    assert sorted(g.blocks_per_request for g in groups) == [138, 512, 512, 512, 512]


# -- register_kv_cache_dtype (vllm/config/cache.py, vLLM 0.33)


def registered(dtype: str = "metal_q8", torch_dtype: str = "int8", **runtime: Any) -> Scenario:
    return scenario(kv_cache_dtype=dtype, registered_kv_cache_dtypes={"metal_q8": torch_dtype}, **runtime)


def test_a_registered_dtype_is_priced_from_its_torch_dtype() -> None:
    """8 KV heads x (128 + 128) x 1 B (int8) = 2048 B per token per layer; bf16 would be 4096."""
    assert plan(registered()).attn_bytes_per_token_per_layer == 2048
    assert plan(registered(torch_dtype="float32")).attn_bytes_per_token_per_layer == 8192
    assert plan(scenario()).attn_bytes_per_token_per_layer == 4096


def test_an_unregistered_dtype_is_a_scenario_error() -> None:
    with pytest.raises(ScenarioError, match=r"runtime\.kv_cache_dtype: expected one of auto, .*metal_q8;"):
        registered(dtype="metal_q9")


def test_a_registered_dtype_needs_a_known_torch_dtype() -> None:
    with pytest.raises(ScenarioError, match=r"runtime\.registered_kv_cache_dtypes\.metal_q8: expected one"):
        registered(torch_dtype="int3")


def test_an_mtp_drafter_numbering_its_layers_from_0_sits_on_the_last_stage() -> None:
    """Qwen3.5's MTP layer is ``mtp.layers.0`` (one MTP module, qwen3_5_mtp.py): the last
    stage's runner builds the drafter, so its worker reports it, not the first stage's (whose
    layer 0 shares the index). 40 layers over 2 stages: 0-19 and 20-39. (Qwen3.5's MTP model
    implements SupportsPP from vLLM 0.30; Qwen3-Next's in no release: refused.)"""
    from pytest_kvconform.reference.parallel import pipeline_stages
    from pytest_kvconform.scenario import load_scenario

    s = load_scenario("qwen3.5-35b-a3b-mtp1").with_runtime(pipeline_parallel_size=2)
    specs = layer_specs(s)
    first, last = pipeline_stages(specs, s)
    drafter = {name for name in specs if name.startswith("mtp.")}
    assert drafter == {"mtp.layers.0.self_attn"}
    assert drafter <= last and not drafter & first
    assert "model.layers.3.self_attn" in first and "model.layers.39.self_attn" in last
    assert len(first) + len(last) == len(specs)


@pytest.mark.parametrize(("name", "release", "refused"), [
    ("qwen3-next-80b-a3b-mtp2-tp4", "0.33", True),  # Qwen3NextMTP: no SupportsPP in 0.23 ... 0.33
    ("qwen3.5-35b-a3b-mtp1", "0.29", True),  # Qwen3_5MTP and DeepSeekMTP implement it from 0.30
    ("qwen3.5-35b-a3b-mtp1", "0.30", False),
    ("deepseek-v3-mtp1", "0.29", True),
    ("deepseek-v3-mtp1", "0.30", False),
])  # fmt: skip
def test_pipeline_stages_need_an_mtp_drafter_with_pipeline_support(
    name: str, release: str, refused: bool
) -> None:
    """ModelConfig.verify_with_parallel_config refuses the draft model's config when its MTP model
    does not implement SupportsPP (read in each wheel's *_mtp.py), as for a target."""
    from pytest_kvconform.conformance import outcome
    from pytest_kvconform.reference.releases import rule_set
    from pytest_kvconform.reference.rules import reference_rules
    from pytest_kvconform.scenario import load_scenario

    s = load_scenario(name).with_runtime(pipeline_parallel_size=2, max_concurrent_batches=2)
    answer = outcome(reference_rules(rule_set(release)), "plan", scenario=s)
    assert (answer[0] == "rejects" and answer[1] == "unsupported_combination") is refused, answer
