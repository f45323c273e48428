"""Phase 3 of ``Platform.update_block_size_for_backend``: heterogeneous KV dtypes from
``kv_cache_dtype_skip_layers`` (``_align_heterogeneous_kv_block_size``, vllm/platforms/interface.py,
vLLM 0.25+), TurboQuant's boundary skip layers of a dense model (``TurboQuantConfig.
get_boundary_skip_layers``, added by ``EngineArgs.create_engine_config``), the scenario key, and the
release changes. Numbers derived by hand in the comments (docs/scenario-derivations.md, section 9,
for the packaged llama-3.1-8b-instruct-turboquant-k8v4.toml)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from pytest_kvconform.reference.hybrid import align_heterogeneous_kv_block_size, boundary_skip_layers
from pytest_kvconform.reference.releases import rule_set
from pytest_kvconform.reference.rules import reference_rules
from pytest_kvconform.scenario import Scenario, ScenarioError, load_scenario, scenario_from_dict

# Qwen3.5-like GDN (16 key / 32 value heads x 128, conv 4, fp32 state): conv (3, 8192) bf16 = 49,152
# + SSM (32, 128, 128) fp32 = 2,097,152 -> 2,146,304 B; attention 4 KV heads x 256
GDN = {"kind": "gdn", "num_key_heads": 16, "num_value_heads": 32, "key_head_dim": 128,
       "value_head_dim": 128, "conv_kernel": 4, "ssm_dtype": "float32"}  # fmt: skip


def scenario(layers: str, heads: int, head_dim: int, state: dict | None = None, **runtime: Any) -> Scenario:
    model: dict[str, Any] = {"architecture": "Test", "dtype": "bfloat16", "num_hidden_layers": len(layers),
                             "layers": layers, "attention": {"kind": "gqa", "num_kv_heads": heads,
                                                             "head_dim": head_dim}}  # fmt: skip
    if state is not None:
        model["state"] = state
    rt = {"mamba_cache_mode": "none", "max_concurrent_batches": 1, "max_model_len": 4096, **runtime}
    return scenario_from_dict({"schema": "kv-scenario/1", "name": "t", "model": model, "runtime": rt}, "<t>")


def test_the_phase_on_plain_numbers() -> None:
    # notes' example: primary 2048 (8 x 256 x uint8), native 4096; required 4096 x 16 = 65,536;
    # 16 x cdiv(65,536, 16 x 2048) = 32; shared 32 x 2048 = 65,536
    assert align_heterogeneous_kv_block_size(2048, 4096) == (32, 65_536, None)
    # the true packed k8v4 page 8 x 196 = 1568: 16 x cdiv(65,536, 25,088) = 16 x 3 = 48
    assert align_heterogeneous_kv_block_size(1568, 4096)[0] == 48
    # equal pages: nothing changes; a larger user block is kept (align = max(16, 64) = 64:
    # 64 x cdiv(65,536, 64 x 2048) = 64)
    assert align_heterogeneous_kv_block_size(4096, 4096, block_size=16) == (16, None, None)
    assert align_heterogeneous_kv_block_size(2048, 4096, block_size=64) == (64, 131_072, None)
    with pytest.raises(AssertionError, match="padded-spec per-token page"):
        align_heterogeneous_kv_block_size(4096, 2048)


@pytest.mark.parametrize(
    ("layers", "dtype", "expected"),
    [
        ("A" * 32, "turboquant_k8v4", ("0", "1", "30", "31")),  # n = min(2, 16) = 2
        ("AAA", "turboquant_3bit_nc", ("0", "2")),  # n = min(2, 3 // 2) = 1
        ("A", "turboquant_k8v4", ()),  # n = min(2, 0) = 0
        ("A" * 8, "ultraquant_4bit", ("0", "1", "6", "7")),
        ("A" * 8, "fp8", ()),  # only the packed formats
    ],
)
def test_boundary_skip_layers(layers: str, dtype: str, expected: tuple[str, ...]) -> None:
    assert boundary_skip_layers(scenario(layers, 8, 128, kv_cache_dtype=dtype)) == expected


def test_a_hybrid_gets_no_boundary_layers() -> None:
    assert boundary_skip_layers(scenario("MMMA" * 4, 4, 256, GDN, kv_cache_dtype="turboquant_k8v4")) == ()


def test_the_packaged_dense_model_and_its_releases() -> None:
    s = load_scenario("llama-3.1-8b-instruct-turboquant-k8v4")
    assert s.runtime.kv_cache_dtype_skip_layers == ()  # the engine adds 0, 1, 30, 31
    # 0.25+: block 32 (section 9); 0.23, 0.24: no Phase 3, block 16
    for release, block, shared in (("0.33", 32, 65_536), ("0.28", 32, 65_536), ("0.25", 32, 65_536),
                                   ("0.24", 16, None), ("0.23", 16, None)):  # fmt: skip
        choice = reference_rules(rule_set(release)).choose_block_size(scenario=s)
        assert (choice.block_size, choice.skip_page_size_padded) == (block, shared), release
    specs = reference_rules().layer_specs(scenario=s)
    pages = [specs[f"model.layers.{i}.self_attn"].page_size_bytes for i in range(32)]
    # skip layers 32 x 4096 = 131,072; TurboQuant 32 x 8 x 196 = 50,176
    assert pages == [131_072] * 2 + [50_176] * 28 + [131_072] * 2


def test_the_first_layers_backend_prices_the_primary_page() -> None:
    # Hybrid MMMAMMMA, skip layer 7 only: layer 3 (TurboQuant) is backend_classes[0].
    # Phase 2: a1 = lcm(4 x 388, 4 x 512 x 2) = lcm(1552, 4096) = 397,312; 16 x cdiv(2,146,304,
    # 16 x 397,312) = 16; the state page padded to 16 x 397,312 = 6,356,992.
    # Phase 3 from 0.28 (the backend packs): primary 1552; 16 x cdiv(6,356,992, 16 x 1552) = 16 x 256
    # = 4096; shared 4096 x 1552 = 6,356,992. 0.25 ... 0.27: primary 4 x 512 x 1 = 2048:
    # 16 x cdiv(6,356,992, 32,768) = 16 x 194 = 3104; shared 3104 x 2048 = 6,356,992.
    s = scenario("MMMAMMMA", 4, 256, GDN, kv_cache_dtype="turboquant_k8v4", kv_cache_dtype_skip_layers=["7"])
    for release, block in (("0.33", 4096), ("0.28", 4096), ("0.27", 3104), ("0.25", 3104)):
        choice = reference_rules(rule_set(release)).choose_block_size(scenario=s)
        assert (choice.block_size, choice.state_page_padded, choice.skip_page_size_padded) == (
            block, 6_356_992, 6_356_992), release  # fmt: skip
    # 0.24: Phase 2 only
    assert reference_rules(rule_set("0.24")).choose_block_size(scenario=s).block_size == 16
    # the only attention layer skipped: a native first backend prices 2048 in every release -> 3104
    s3 = scenario("MMMAMMMA", 4, 256, GDN, kv_cache_dtype="turboquant_k8v4",
                  kv_cache_dtype_skip_layers=["3", "7"])  # fmt: skip
    assert reference_rules().choose_block_size(scenario=s3).block_size == 3104


@pytest.mark.parametrize(
    ("value", "problem"),
    [(["0", 1], "expected a list of strings"), ("0", "expected a list of strings"),
     (["first"], 'expected layer indices ("0") or "sliding_window"')],
)  # fmt: skip
def test_bad_skip_layers_are_one_line_errors(value: object, problem: str) -> None:
    with pytest.raises(ScenarioError, match=re.escape(problem)) as info:
        scenario("AAAA", 8, 128, kv_cache_dtype="fp8", kv_cache_dtype_skip_layers=value)
    assert "\n" not in str(info.value)


def test_skip_layers_on_mla_are_refused() -> None:
    model = {"architecture": "Test", "dtype": "bfloat16", "num_hidden_layers": 4, "layers": "AAAA",
             "attention": {"kind": "mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64}}  # fmt: skip
    rt = {"kv_cache_dtype": "fp8", "kv_cache_dtype_skip_layers": ["0"], "mamba_cache_mode": "none",
          "max_concurrent_batches": 1}  # fmt: skip
    s = scenario_from_dict({"schema": "kv-scenario/1", "name": "m", "model": model, "runtime": rt}, "<m>")
    with pytest.raises(ValueError, match="not modelled"):
        reference_rules().choose_block_size(scenario=s)


def test_a_skip_layer_first_prices_phase_2_unpacked() -> None:
    # Jamba-like MA, nvfp4, both layers skipped: backend_classes[0] is a native backend, whose
    # customize_spec does not pack nvfp4, so _align_hybrid_block_size prices 1 x 128 x 1 = 128 B,
    # not FlashInfer's 2 x 36 = 72. Mamba1 state (I 1024, conv 2, N 16): conv (1, 1024) bf16 =
    # 2,048 + SSM (1024, 16) bf16 = 32,768 -> 34,816; 16 x cdiv(34,816, 16 x 128) = 16 x 17 = 272
    # (exact: no padding). Phase 3: primary 128, native 256, align 272: 272 x cdiv(4,096, 272 x 128)
    # = 272; shared 272 x 128 = 34,816. (vLLM 0.32 through the vllm backend answers 272 too.)
    state = {"kind": "mamba1", "conv_kernel": 2, "intermediate_size": 1024, "d_state": 16}
    s = scenario("MA", 1, 64, state, kv_cache_dtype="nvfp4", kv_cache_dtype_skip_layers=["0", "1"])
    choice = reference_rules().choose_block_size(scenario=s)
    assert (choice.block_size, choice.state_page_padded, choice.skip_page_size_padded) == (272, None, 34_816)
