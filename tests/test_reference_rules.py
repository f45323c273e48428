"""Worked numbers of the reference, each pinned to where the number was published.

Every expected value below is written out by hand from vLLM's or vllm-metal's source, from a public
PR/issue/test, or derived here from the formula of the function cited; none is copied from running
the reference. Citation forms:

* ``vLLM 0.33.0 <function>`` - the vLLM 0.33.0 wheel; ``vllm/...`` paths are relative to its root;
* ``vllm-metal <file>, <function>`` - vllm-project/vllm-metal @ 211a1e4 (``vllm_metal/...`` paths);
* ``vllm#N`` / ``vllm-metal#N`` - pull requests and issues of vllm-project/vllm and vllm-project/vllm-metal.

The "regressions" section at the end pins defects this suite found in the reference.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections import Counter
from typing import Any

import pytest

from pytest_kvconform.model import KVPlan
from pytest_kvconform.reference import plan
from pytest_kvconform.reference.attention import (
    attention_spec,
    indexer_head_size,
    indexer_spec,
    turboquant_slot_bytes,
)
from pytest_kvconform.reference.dtypes import kv_cache_dtype_bytes, mamba_dtypes, storage_dtype
from pytest_kvconform.reference.grouping import get_kv_cache_groups, group_size, group_size_for
from pytest_kvconform.reference.hybrid import align_hybrid_block_size, hybrid_alignment
from pytest_kvconform.reference.layers import layer_specs
from pytest_kvconform.reference.mamba import divide, state_page_bytes, state_shapes
from pytest_kvconform.reference.memory import (
    bytes_per_block,
    check_memory,
    estimate_max_model_len,
    format_gib,
    needed_bytes,
)
from pytest_kvconform.reference.metal import (
    build_block_tables,
    linear_cache_bytes_per_slot,
    metal_turboquant_page_size_bytes,
    one_sequence_kv_bytes,
    pick_kernel_block_size,
)
from pytest_kvconform.reference.specs import AttentionSpec, MambaSpec
from pytest_kvconform.reference.unify import unify_page_sizes
from pytest_kvconform.rejections import rejection_kind
from pytest_kvconform.scenario import (
    KV_CACHE_DTYPES,
    AttentionGeometry,
    RuntimeSettings,
    Scenario,
    StateGeometry,
    load_scenario,
    packaged_scenario_names,
    scenario_from_dict,
)

GiB = 1 << 30
MiB = 1 << 20


def make_scenario(model: dict[str, Any], runtime: dict[str, Any] | None = None, name: str = "t") -> Scenario:
    """A model-level scenario from TOML-like dicts (the loader validates it)."""
    data: dict[str, Any] = {"schema": "kv-scenario/1", "name": name, "model": model}
    # the derivations here assume the format's values, not the engine's defaults (reference.defaults)
    data["runtime"] = {"mamba_cache_mode": "none", "max_concurrent_batches": 1, **(runtime or {})}
    return scenario_from_dict(data, f"<{name}>")


def gqa(num_kv_heads: int, head_dim: int, **extra: Any) -> dict[str, Any]:
    return {"kind": "gqa", "num_kv_heads": num_kv_heads, "head_dim": head_dim, **extra}


def model(layers: str, attention: dict | None = None, state: dict | None = None, dtype: str = "bfloat16"):
    m: dict[str, Any] = {
        "architecture": "Test",
        "dtype": dtype,
        "num_hidden_layers": len(layers),
        "layers": layers,
    }
    if attention is not None:
        m["attention"] = attention
    if state is not None:
        m["state"] = state
    return m


# Public model configs (config.json on the Hugging Face Hub).
# ibm-granite/granite-4.0-h-tiny (hidden 1536, 12 heads -> head_dim 128, 4 KV heads, Mamba2).
GRANITE_TINY_STATE = {"kind": "mamba2", "intermediate_size": 3072, "n_groups": 1, "n_heads": 48,
                      "head_dim": 64, "d_state": 128, "conv_kernel": 4}  # fmt: skip
# ibm-granite/granite-4.0-h-small (hidden 4096, 8 KV heads, 128 Mamba heads; expand 2 -> I 8192).
GRANITE_SMALL_STATE = {"kind": "mamba2", "intermediate_size": 8192, "n_groups": 1, "n_heads": 128,
                       "head_dim": 64, "d_state": 128, "conv_kernel": 4}  # fmt: skip
# Qwen/Qwen3-Next-80B-A3B: GDN 16 key / 32 value heads x 128, conv kernel 4.
QWEN_NEXT_GDN = {"kind": "gdn", "num_key_heads": 16, "num_value_heads": 32, "key_head_dim": 128,
                 "value_head_dim": 128, "conv_kernel": 4}  # fmt: skip
# Qwen3.5-like (synthetic): the GDN above with the HF config's mamba_ssm_dtype float32, 4 KV heads x 256.
QWEN35_GDN = {**QWEN_NEXT_GDN, "ssm_dtype": "float32"}
# Qwen/Qwen3.5-0.8B-like (vllm-metal#235, #584): GDN 16 x 128 x 128 (conv_dim 6144), fp32 state, 2 KV x 256.
QWEN35_08B_GDN = {"kind": "gdn", "num_key_heads": 16, "num_value_heads": 16, "key_head_dim": 128,
                  "value_head_dim": 128, "conv_kernel": 4, "ssm_dtype": "float32"}  # fmt: skip
GRANITE_LAYERS = "MMMMMAMMMMMMMMMAMMMMMMMMMAMMMMMMMMMAMMMM"  # 4 attention + 36 Mamba2 (granite-4.0-h-tiny)


def granite_tiny(**runtime: Any) -> Scenario:
    return make_scenario(model(GRANITE_LAYERS, gqa(4, 128), GRANITE_TINY_STATE), runtime, "granite-tiny")


def gqa_geo(num_kv_heads: int, head_dim: int, **kw: Any) -> AttentionGeometry:
    return AttentionGeometry(kind="gqa", num_kv_heads=num_kv_heads, head_dim=head_dim, **kw)


def mla_geo(**kw: Any) -> AttentionGeometry:
    # DeepSeek-V3 / GLM latent: kv_lora_rank 512 + qk_rope_head_dim 64 = 576
    # (vLLM 0.33.0 vllm/transformers_utils/model_arch_config_convertor.py, get_head_size)
    return AttentionGeometry(kind="mla", num_kv_heads=1, kv_lora_rank=512, qk_rope_head_dim=64, **kw)


def page(
    geo: AttentionGeometry, kv_cache_dtype: str, block_size: int = 16, kind: str = "full_attention"
) -> int:
    return attention_spec(
        geo, kind=kind, block_size=block_size, kv_cache_dtype=kv_cache_dtype, model_dtype="bfloat16"
    ).page_size_bytes


def fa(num_kv_heads: int, head_size: int = 128, block_size: int = 16, **kw: Any) -> AttentionSpec:
    return AttentionSpec("full_attention", block_size, num_kv_heads, head_size, "bfloat16", **kw)


# --------------------------------------------------------------------------- dtypes (torch_utils.py)

# vLLM 0.33.0 vllm/utils/torch_utils.py, STR_DTYPE_TO_TORCH_DTYPE: every fp8/fp4/int4/packed string
# is uint8, int8 variants are int8, fp8_inc is float8_e4m3fn; explicit float16/bfloat16 are themselves.
EXPECTED_STORAGE = {
    "float16": ("float16", 2), "bfloat16": ("bfloat16", 2),
    "fp8": ("uint8", 1), "fp8_e4m3": ("uint8", 1), "fp8_e5m2": ("uint8", 1),
    "fp8_inc": ("float8_e4m3fn", 1), "fp8_ds_mla": ("uint8", 1), "nvfp4_ds_mla": ("uint8", 1),
    "turboquant_k8v4": ("uint8", 1), "turboquant_4bit_nc": ("uint8", 1),
    "turboquant_k3v4_nc": ("uint8", 1), "turboquant_3bit_nc": ("uint8", 1),
    "octave_k3v4": ("uint8", 1), "octave_k3v3": ("uint8", 1), "octave_k3v3_compact": ("uint8", 1),
    "ultraquant_4bit": ("uint8", 1), "int4_per_token_head": ("uint8", 1),
    "int8_per_token_head": ("int8", 1), "fp8_per_token_head": ("uint8", 1),
    "nvfp4": ("uint8", 1), "nvfp4_4over6": ("uint8", 1),
}  # fmt: skip


def test_expected_storage_table_covers_every_cache_dtype():
    # vLLM 0.33.0: the CacheDType list of vllm/config/cache.py ("auto" is tested separately).
    assert set(EXPECTED_STORAGE) | {"auto"} == set(KV_CACHE_DTYPES)


@pytest.mark.parametrize("kv_cache_dtype", sorted(EXPECTED_STORAGE))
def test_storage_dtype_and_bytes(kv_cache_dtype):
    want_dtype, want_bytes = EXPECTED_STORAGE[kv_cache_dtype]
    # a float16 model, so an explicit "bfloat16" is not the model dtype (bytes are the same)
    assert storage_dtype(kv_cache_dtype, "float16") == want_dtype
    assert kv_cache_dtype_bytes(kv_cache_dtype, "float16") == want_bytes


@pytest.mark.parametrize(
    ("model_dtype", "want"), [("bfloat16", 2), ("float16", 2), ("float32", 4)]
)  # vLLM 0.33.0 kv_cache_dtype_str_to_dtype: "auto" is the model dtype (2 B on a bf16 model)
def test_auto_resolves_to_model_dtype(model_dtype, want):
    assert storage_dtype("auto", model_dtype) == model_dtype
    assert kv_cache_dtype_bytes("auto", model_dtype) == want


def test_invalid_kv_cache_dtype_text():
    # vLLM 0.33.0 vllm/config/cache.py: "Invalid kv_cache_dtype: {cache_dtype!r}. Valid values are: ..."
    with pytest.raises(ValueError, match=r"^Invalid kv_cache_dtype: 'fp9'\. Valid values are: "):
        storage_dtype("fp9", "bfloat16")


# --------------------------------------------------------------------------- attention pages


def test_llama_like_pages():
    # vLLM 0.33.0 AttentionSpec.page_size_bytes, 8 KV heads, D=128, block 16: 16*8*256*2 = 65,536 bf16;
    # fp8 (uint8) 32,768
    assert page(gqa_geo(8, 128), "auto") == 65_536
    assert page(gqa_geo(8, 128), "fp8") == 32_768


def test_per_token_pages_k_and_v_counted():
    # vLLM 0.33.0 AttentionSpec.page_size_bytes counts K and V: 2 KV heads x 256 bf16 -> 2,048 B/token;
    # 4 KV heads -> 4,096 B/token
    assert page(gqa_geo(2, 256), "auto", block_size=1) == 2_048
    assert page(gqa_geo(4, 256), "auto", block_size=1) == 4_096


# vLLM 0.33.0 vllm/model_executor/layers/quantization/turboquant/config.py: key = D if 8-bit else
# ceil(D*kb/8) + 2, value = ceil(D*vb/8) + 4, slot = key + value (rounded up to even)
@pytest.mark.parametrize(
    ("kv_cache_dtype", "head_dim", "slot"),
    [
        ("turboquant_k8v4", 128, 196),  # 128 + 68
        ("turboquant_4bit_nc", 128, 134),  # 66 + 68
        ("turboquant_k3v4_nc", 128, 118),  # 50 + 68
        ("turboquant_3bit_nc", 128, 102),  # 50 + 52
        ("turboquant_k8v4", 256, 388),  # 256 + 132, matches vllm PR #40128's "388"
    ],
)
def test_turboquant_slot(kv_cache_dtype, head_dim, slot):
    assert turboquant_slot_bytes(head_dim, kv_cache_dtype) == slot


# vLLM 0.33.0 backend customize_spec packing (vllm/v1/attention/backends/turboquant_attn.py,
# flashinfer.py, triton_attn.py): slots x bytes per slot and token x block 16
@pytest.mark.parametrize(
    ("kv_cache_dtype", "want"),
    [
        ("turboquant_k8v4", 25_088),  # TurboQuant: 8 heads x 196 x 16
        ("turboquant_4bit_nc", 17_152),  # 8 x 134 x 16
        ("turboquant_k3v4_nc", 15_104),  # 8 x 118 x 16
        ("turboquant_3bit_nc", 13_056),  # 8 x 102 x 16
        ("nvfp4", 18_432),  # FlashInfer: 16 slots x (64 + 8) B x 16
        ("int8_per_token_head", 33_792),  # Triton: 8 x (256 + 2 * 4) B x 16
        ("int4_per_token_head", 17_408),  # Triton: 8 x (128 + 2 * 4) B x 16
    ],
)
def test_packed_attention_pages_8_heads_d128_block16(kv_cache_dtype, want):
    assert page(gqa_geo(8, 128), kv_cache_dtype) == want


# vLLM 0.33.0 vllm/model_executor/layers/attention/mla_attention.py, MLAAttention.get_kv_cache_spec
# (state_content_bytes 656 for fp8_ds_mla, 352 for nvfp4_ds_mla)
@pytest.mark.parametrize(
    ("kv_cache_dtype", "want"),
    [
        ("auto", 73_728),  # 64*576*2
        ("fp8", 36_864),  # 64*576*1
        ("fp8_ds_mla", 41_984),  # 64*656
        ("nvfp4_ds_mla", 22_528),  # 64*352
    ],
)
def test_deepseek_v3_mla_pages_block64(kv_cache_dtype, want):
    assert page(mla_geo(), kv_cache_dtype, block_size=64) == want


def test_dsa_indexer_132_bytes_per_token():
    # vLLM 0.33.0 vllm/model_executor/models/deepseek_v2.py, indexer cache spec:
    # head_size = 128 + 128 // 128 * 4 = 132, uint8 -> 132 B per token
    assert indexer_head_size(128) == 132
    spec = indexer_spec(mla_geo(indexer_head_dim=128), block_size=1)
    assert spec.page_size_bytes == 132
    assert spec.with_block_size(64).page_size_bytes == 8_448  # 64 * 132


def test_mla_ignores_tensor_parallel():
    # vLLM 0.33.0 ModelConfig.get_num_kv_heads returns 1 for MLA
    spec = attention_spec(mla_geo(), kind="full_attention", block_size=64, kv_cache_dtype="auto",
                          model_dtype="bfloat16", tensor_parallel_size=8)  # fmt: skip
    assert spec.page_size_bytes == 73_728


def test_kv_heads_per_rank_floor_at_one():
    # vLLM 0.33.0 ModelConfig.get_num_kv_heads: max(1, total_kv // tp)
    spec = attention_spec(gqa_geo(2, 128), kind="full_attention", block_size=16, kv_cache_dtype="auto",
                          model_dtype="bfloat16", tensor_parallel_size=8)  # fmt: skip
    assert spec.num_kv_heads == 1
    assert spec.page_size_bytes == 16 * 256 * 2


# --------------------------------------------------------------------------- max memory per spec


def test_max_memory_full_attention():
    # vLLM 0.33.0 FullAttentionSpec.max_memory_usage_bytes = cdiv(L, bs) * P: 512 * 65,536 = 33,554,432
    spec = attention_spec(gqa_geo(8, 128), kind="full_attention", block_size=16, kv_cache_dtype="auto",
                          model_dtype="bfloat16")  # fmt: skip
    assert spec.max_memory_usage_bytes(RuntimeSettings(max_model_len=8192)) == 33_554_432


def test_max_memory_sliding_window_513_blocks():
    # vLLM 0.33.0 SlidingWindowSpec.max_memory_usage_bytes, SW 4096, L 8192, F = 2 * 2048:
    # cdiv(min(4095 + 4096, 8192), 16) + 1 = 513
    geo = gqa_geo(8, 128, sliding_window=4096)
    rt = RuntimeSettings(max_model_len=8192, max_num_batched_tokens=2048, max_concurrent_batches=2)
    assert page_blocks(geo, "sliding_window", rt) == 513


def test_max_memory_chunked_local_768_blocks():
    # vLLM 0.33.0 ChunkedLocalAttentionSpec.max_memory_usage_bytes, chunk 8192, F = 4096, L = 131072:
    # cdiv(12288, 16) = 768 (no +1)
    geo = gqa_geo(8, 128, attention_chunk_size=8192)
    rt = RuntimeSettings(max_model_len=131_072, max_num_batched_tokens=4096)
    assert page_blocks(geo, "chunked_local", rt) == 768


def test_max_memory_cross_attention_128_blocks():
    # vLLM 0.33.0 CrossAttentionSpec.max_memory_usage_bytes = cdiv(max_num_encoder_input_tokens, bs) * P,
    # and max_num_encoder_input_tokens = max_num_batched_tokens = 2048 -> 128 blocks
    rt = RuntimeSettings(max_model_len=131_072, max_num_batched_tokens=2048)
    assert page_blocks(gqa_geo(8, 128), "cross_attention", rt) == 128


def page_blocks(geo: AttentionGeometry, kind: str, rt: RuntimeSettings) -> int:
    spec = attention_spec(geo, kind=kind, block_size=16, kv_cache_dtype="auto", model_dtype="bfloat16")
    assert spec.page_size_bytes == 65_536
    total = spec.max_memory_usage_bytes(rt)
    assert total % 65_536 == 0
    return total // 65_536


@pytest.mark.parametrize(
    ("runtime", "pages"),
    [
        # vLLM 0.33.0 MambaSpec.max_memory_usage_bytes: none P * (1 + spec), align P * (2 + spec + ckpt)
        ({}, 1),  # none mode: 1 page per Mamba layer
        ({"mamba_cache_mode": "align"}, 3),  # align, Mamba2 checkpoint = 1: 2 + 0 + 1
        ({"mamba_cache_mode": "align", "num_speculative_tokens": 2}, 5),  # align: 2 + 2 + 1
    ],
)
def test_mamba_pages_per_request(runtime, pages):
    s = granite_tiny(**runtime)
    specs = layer_specs(s, hybrid_alignment(s))
    state = specs["model.layers.0.mixer"]
    assert isinstance(state, MambaSpec)
    assert state.max_memory_usage_bytes(s.runtime) == pages * state.page_size_bytes


# --------------------------------------------------------------------------- Mamba shapes (mamba_utils.py)


def test_granite_tiny_state_shapes():
    # vLLM 0.33.0 vllm/model_executor/layers/mamba/mamba_utils.py,
    # MambaStateShapeCalculator.mamba2_state_shape: [(3,3328) bf16, (48,64,128) bf16] = 806,400 B
    assert state_shapes(StateGeometry(**GRANITE_TINY_STATE)) == ((3, 3328), (48, 64, 128))
    assert state_page_bytes(granite_tiny()) == 806_400


def test_granite_tiny_tp2_extra_group():
    # vLLM 0.33.0 mamba2_state_shape + extra_groups_for_head_shards: TP=2 -> G' = 2, conv_dim/2 = 1792,
    # mamba 403,968 B
    assert state_shapes(StateGeometry(**GRANITE_TINY_STATE), tp=2) == ((3, 1792), (24, 64, 128))
    assert state_page_bytes(granite_tiny(tensor_parallel_size=2)) == 403_968


@pytest.mark.parametrize(("tp", "want"), [(1, 1_097_728), (2, 548_864)])
def test_qwen3_next_gdn_state(tp, want):
    # vLLM 0.33.0 MambaStateShapeCalculator.gated_delta_net_state_shape: Qwen3-Next GDN
    # [(3,8192),(32,128,128)] bf16 = 1,097,728 B at TP1, 548,864 at TP2
    s = make_scenario(model("MMMA", gqa(2, 256), QWEN_NEXT_GDN), {"tensor_parallel_size": tp})
    assert state_page_bytes(s) == want


def test_tp_divisibility_error_text():
    # vLLM 0.33.0 vllm/distributed/utils.py divide(): f"{n} is not divisible by {d}"; conv_dim 8192 at TP 3
    with pytest.raises(ValueError, match=r"^8192 is not divisible by 3$"):
        state_shapes(StateGeometry(**QWEN_NEXT_GDN), tp=3)
    with pytest.raises(ValueError, match=r"^7 is not divisible by 2$"):
        divide(7, 2)


def test_speculative_conv_rows_granite():
    # mamba2_state_shape conv length K - 1 + num_spec = 5 -> 819,712 B; vLLM 0.33.0
    # Platform._align_hybrid_block_size: 16 * cdiv(819,712, 16 * 2048) = 416
    s = granite_tiny(num_speculative_tokens=2)
    assert state_shapes(StateGeometry(**GRANITE_TINY_STATE), num_spec=2)[0] == (5, 3328)
    assert state_page_bytes(s) == 819_712
    assert hybrid_alignment(s).block_size == 416


def test_mamba1_has_no_speculative_rows():
    # vLLM 0.33.0 MambaStateShapeCalculator.mamba1_state_shape: conv = orient(divide(I, tp), K-1), no num_spec
    geo = StateGeometry(kind="mamba1", conv_kernel=4, intermediate_size=8192, d_state=16)
    assert state_shapes(geo, num_spec=3) == ((3, 8192), (8192, 16))


def test_kda_and_short_conv_shapes():
    # vLLM 0.33.0 MambaStateShapeCalculator.kda_state_shape: conv_dim = H*D + 2*H*D = 12288 for
    # 32 heads x 128; ssm (32,128,128)
    kda = StateGeometry(kind="kda", conv_kernel=4, num_heads=32, head_dim=128)
    assert state_shapes(kda) == ((3, 12288), (32, 128, 128))
    # vLLM 0.33.0 MambaStateShapeCalculator.short_conv_state_shape:
    # conv = orient(divide(I, tp), L_cache - 1 + num_spec), no recurrent state
    assert state_shapes(StateGeometry(kind="short_conv", conv_kernel=3, conv_dim=2048), num_spec=1) == (
        (3, 2048),
    )


def test_ssm_dtype_resolution():
    # vLLM 0.33.0 MambaStateDtypeCalculator: ssm auto -> the conv dtype (Qwen3-Next, Granite)
    assert mamba_dtypes("gdn", "bfloat16", "auto", "auto") == ("bfloat16", "bfloat16")
    # vLLM 0.33.0 Qwen3.5 model class: ssm auto -> hf_text_config.mamba_ssm_dtype (scenario ssm_dtype)
    assert mamba_dtypes("gdn", "bfloat16", "auto", "auto", "float32") == ("bfloat16", "float32")
    # an explicit --mamba-ssm-cache-dtype wins over the model default
    assert mamba_dtypes("gdn", "bfloat16", "auto", "bfloat16", "float32") == ("bfloat16", "bfloat16")
    # vLLM 0.33.0 MambaStateDtypeCalculator (KDA): ssm auto -> float32
    assert mamba_dtypes("kda", "bfloat16", "auto", "auto") == ("bfloat16", "float32")
    assert mamba_dtypes("kda", "bfloat16", "auto", "bfloat16") == ("bfloat16", "bfloat16")


def test_kda_float16_rejected_with_vllm_message():
    # vLLM 0.33.0 MambaStateDtypeCalculator (KDA):
    # ValueError("KDA recurrent state supports only auto, float32, and bfloat16; got {x}")
    with pytest.raises(
        ValueError, match=r"^KDA recurrent state supports only auto, float32, and bfloat16; got float16$"
    ):
        mamba_dtypes("kda", "bfloat16", "auto", "float16")


def test_qwen35_state_is_fp32_through_scenario_ssm_dtype():
    # vLLM 0.33.0 MambaSpec.page_size_bytes: (3*8192*2) + (32*128*128*4) = 2,146,304
    s = make_scenario(model("MMMA", gqa(4, 256), QWEN35_GDN))
    assert state_page_bytes(s) == 2_146_304


# --------------------------------------------------------------------------- hybrid alignment (interface.py)


def test_granite_tiny_alignment_400():
    # vLLM 0.33.0 vllm/platforms/interface.py, Platform._align_hybrid_block_size: a1 = 2048,
    # 16 * cdiv(806,400, 32,768) = 400, page 819,200, log "Padding mamba page size by 1.59%"
    a = hybrid_alignment(granite_tiny())
    assert (a.attn_page_bytes_per_token, a.state_page_bytes) == (2_048, 806_400)
    assert (a.block_size, a.page_size_bytes, a.state_page_padded_bytes) == (400, 819_200, 819_200)
    assert f"{a.padding_pct:.2f}" == "1.59"


@pytest.mark.parametrize(
    ("runtime", "block", "pct"),
    [
        # _align_hybrid_block_size, k = max(kernel, block_size): a user --block-size 32 gives
        # 32 * cdiv(806,400, 32 * 2048) = 416
        ({"block_size": 32, "user_specified_block_size": True}, 416, None),
        ({"tensor_parallel_size": 2}, 400, "1.39"),  # 16 * cdiv(403,968, 16 * 1024) = 400
        ({"mamba_ssm_cache_dtype": "float32"}, 784, None),  # 16 * cdiv(1,592,832, 16 * 2048) = 784
        ({"mamba_cache_mode": "align"}, 400, "1.59"),  # Mamba2: no checkpoint alignment, k stays 16
    ],
)
def test_granite_tiny_alignment_variants(runtime, block, pct):
    a = hybrid_alignment(granite_tiny(**runtime))
    assert a.block_size == block
    if pct is not None:
        assert f"{a.padding_pct:.2f}" == pct
    if "mamba_ssm_cache_dtype" in runtime:
        assert a.state_page_bytes == 1_592_832


def test_granite_small_528():
    # _align_hybrid_block_size, Granite-4.0-H-Small: 16 * cdiv(2,147,840, 16 * 4096) = 528 (0.69 %)
    s = make_scenario(model(GRANITE_LAYERS, gqa(8, 128), GRANITE_SMALL_STATE))
    a = hybrid_alignment(s)
    assert (a.attn_page_bytes_per_token, a.state_page_bytes, a.block_size) == (4_096, 2_147_840, 528)
    assert f"{a.padding_pct:.2f}" == "0.69"


@pytest.mark.parametrize(
    ("k", "block", "pct"),
    [(32, 160, "19.40"), (16, 144, "7.46"), (1, 134, "0.00"), (64, 192, None), (128, 256, None)],
)  # _align_hybrid_block_size: k * cdiv(548,864, k * 4,096); min 134.0; k=32 -> 160, 16 -> 144
def test_qwen35_reviewer_inputs(k, block, pct):
    a = align_hybrid_block_size(4_096, 548_864, kernel_block_alignment=k, block_size=min(k, 16))
    assert a.min_block_size == 134.0
    assert a.block_size == block
    assert a.page_size_bytes == block * 4_096
    if pct is not None:
        assert f"{a.padding_pct:.2f}" == pct
    # k = 1 gives exact equality: no padding (mamba_page_size_padded stays None, _align_hybrid_block_size)
    assert (a.state_page_padded_bytes is None) == (block == 134)


def test_qwen35_reviewer_inputs_from_user_block_32():
    # _align_hybrid_block_size: k = max(kernel, block_size), so --block-size 32 gives k = 32
    assert align_hybrid_block_size(4_096, 548_864, kernel_block_alignment=16, block_size=32).block_size == 160


def test_qwen35_reviewer_inputs_as_a_scenario():
    # derived here: the 548,864 B state is Qwen3-Next GDN at TP 2; 4,096 B/token needs 4 local KV
    # heads x 256, i.e. 8 KV heads at TP 2; a first backend whose smallest kernel is 32 -> 160
    s = make_scenario(
        model("MMMA", gqa(8, 256), QWEN_NEXT_GDN), {"tensor_parallel_size": 2, "kernel_block_alignment": 32}
    )
    a = hybrid_alignment(s)
    assert (a.attn_page_bytes_per_token, a.state_page_bytes, a.block_size) == (4_096, 548_864, 160)
    assert a.state_page_padded_bytes == 655_360  # 160 * 4,096


@pytest.mark.parametrize(("k", "block"), [(16, 272), (32, 288)])
def test_two_kv_heads_variant(k, block):
    # _align_hybrid_block_size, k * cdiv(548,864, k * 2,048): min 268; k = 16 -> 272, k = 32 -> 288
    assert (
        align_hybrid_block_size(2_048, 548_864, kernel_block_alignment=k, block_size=16).block_size == block
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen35_e3_528_and_align_576(tp):
    # vLLM 0.33.0 Platform._align_hybrid_block_size: TP1 mamba 2,146,304, a1 4096 -> 528 (0.76 %); align
    # mode with the FlashInfer GDN prefill checkpoint alignment 64 (get_mamba_prefill_checkpoint_alignment):
    # k = lcm(16, 64) -> 576 (9.92 %); TP 2 halves both pages, so the block sizes are the same
    m = model("MMMA", gqa(4, 256), QWEN35_GDN)
    none = hybrid_alignment(make_scenario(m, {"tensor_parallel_size": tp}))
    align = hybrid_alignment(
        make_scenario(
            m, {"tensor_parallel_size": tp, "mamba_cache_mode": "align", "extra_block_alignment": 64}
        )
    )
    assert (none.block_size, align.block_size) == (528, 576)
    if tp == 1:
        assert f"{none.padding_pct:.2f}" == "0.76"
        assert f"{align.padding_pct:.2f}" == "9.92"


def test_qwen35_e3_extra_alignment_ignored_in_none_mode():
    # vLLM 0.33.0 _align_hybrid_block_size: the checkpoint lcm applies only in align mode
    s = make_scenario(model("MMMA", gqa(4, 256), QWEN35_GDN), {"extra_block_alignment": 64})
    assert hybrid_alignment(s).block_size == 528


def test_qwen35_e3_mtp_exact_page_no_padding():
    # _align_hybrid_block_size: MTP 1 -> mamba 2,162,688 = 528 * 4096 exactly, no padding log
    a = hybrid_alignment(make_scenario(model("MMMA", gqa(4, 256), QWEN35_GDN), {"num_speculative_tokens": 1}))
    assert (a.state_page_bytes, a.block_size, a.state_page_padded_bytes) == (2_162_688, 528, None)


def test_e4_mla_floor_1920():
    # vLLM 0.33.0 _align_hybrid_block_size, MLA branch: D=576 bf16 (a1 1152) + KDA-like state
    # (3,12288) bf16 + (32,128,128) fp32 = 2,170,880; MLA floor k = 128 -> 128 * cdiv(2,170,880, 128 * 1152)
    # = 128 * 15 = 1920 (1.89 %)
    kda = {"kind": "kda", "num_heads": 32, "head_dim": 128, "conv_kernel": 4}
    mla = {"kind": "mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    a = hybrid_alignment(make_scenario(model("MMMA", mla, kda)))
    assert (a.attn_page_bytes_per_token, a.state_page_bytes, a.block_size) == (1_152, 2_170_880, 1_920)
    assert f"{a.padding_pct:.2f}" == "1.89"


def test_e5_turboquant_hybrid_without_skip_layers():
    # _align_hybrid_block_size, TurboQuant branch: tq = 4 * 388 = 1552 B/token;
    # 16 * cdiv(2,146,304, 24,832) = 1392 (0.66 %)
    s = make_scenario(model("MMMA", gqa(4, 256), QWEN35_GDN), {"kv_cache_dtype": "turboquant_k8v4"})
    a = hybrid_alignment(s)
    assert (a.attn_page_bytes_per_token, a.block_size) == (1_552, 1_392)
    assert f"{a.padding_pct:.2f}" == "0.66"


def test_qwen36_turboquant_k8v4_2768():
    # packaged scenario's [expect.external]: the TurboQuant run log "Setting attention block size to
    # 2768 tokens", "Padding mamba page size by 0.08%"; slot = 256 + 132 = 388 B per head (TurboQuant config)
    a = hybrid_alignment(load_scenario("qwen3.6-35b-a3b-turboquant-k8v4"))
    assert (a.attn_page_bytes_per_token, a.block_size) == (776, 2_768)
    assert f"{a.padding_pct:.2f}" == "0.08"


def test_qwen35_08b_544_fp32_and_288_bf16():
    # vllm-metal#584, #235: Qwen3.5-0.8B resolves to block 544; attn 2048 B/token, mamba
    # 3*6144*2 + 16*128*128*4 = 1,085,440 -> 16 * cdiv(1,085,440, 16 * 2048) = 544; bf16 state -> 288
    m = model("MMMA" * 6, gqa(2, 256), QWEN35_08B_GDN)
    fp32 = hybrid_alignment(make_scenario(m))
    bf16 = hybrid_alignment(make_scenario(m, {"mamba_ssm_cache_dtype": "bfloat16"}))
    assert (fp32.state_page_bytes, fp32.block_size) == (1_085_440, 544)
    assert bf16.block_size == 288


def test_non_hybrid_has_no_alignment():
    # vLLM 0.33.0 _align_hybrid_block_size runs only if model_config.is_hybrid
    assert hybrid_alignment(make_scenario(model("A" * 4, gqa(8, 128)))) is None


# --------------------------------------------------------------------------- unification (kv_cache_planning)

# vLLM's unify_kv_cache_spec_page_size (vllm/v1/core/kv_cache_utils.py) before vllm#45181 / #45207;
# the error vllm-metal#230 and vllm#38979 report
SCALE_ONLY_TEXT = (
    "The page size of the layer is not divisible by the maximum page size. "
    "Cannot unify by adjusting block_size."
)


def mla_text(layer: str) -> str:
    # vLLM 0.33.0 vllm/v1/core/kv_cache_planning.py, unify_kv_cache_spec_page_size: exact NotImplementedError
    return (
        f"Layer {layer}: page size is not divisible by the maximum page size and cannot be padded. "
        "Padding is only supported for non-MLA attention layers."
    )


ENV_MAMBA = MambaSpec(block_size=16, shapes=((4, 2048), (32, 64, 128)), dtypes=("bfloat16", "float32"))


def test_env_spec_api_pages():
    # vLLM 0.33.0 page_size_bytes: FullAttentionSpec(16, 8, 128, bf16) 65536; MLA(16, 1, 576, bf16) 18432;
    # MambaSpec((4, 2048) bf16 + (32, 64, 128) fp32) = 16,384 + 1,048,576 = 1,064,960
    assert fa(8).page_size_bytes == 65_536
    assert AttentionSpec("mla", 16, 1, 576, "bfloat16").page_size_bytes == 18_432
    assert ENV_MAMBA.page_size_bytes == 1_064_960


def test_pad_to_max_pads_non_mla_attention_to_mamba():
    # vLLM 0.33.0 unify_kv_cache_spec_page_size pads non-MLA attention (vllm#45181): 1,064,960 % 65,536 != 0,
    # so FA keeps block 16 with page_size_padded 1,064,960
    out = unify_page_sizes({"a": fa(8), "m": ENV_MAMBA}, "pad-to-max")
    assert (out["a"].block_size, out["a"].page_size_padded) == (16, 1_064_960)
    assert out["m"] == ENV_MAMBA


@pytest.mark.parametrize("policy", ["pad-to-max", "scale-only", "lcm"])
def test_fa8_plus_fa4_scales_block_to_32(policy):
    # unify_kv_cache_spec_page_size scales a dividing page: the 4-head layer's block_size becomes 32 (65536)
    out = unify_page_sizes({"a": fa(8), "b": fa(4)}, policy)
    assert (out["b"].block_size, out["b"].page_size_bytes, out["b"].page_size_padded) == (32, 65_536, None)
    assert out["a"] == fa(8)


def test_fa3_is_padded_under_pad_to_max():
    # unify_kv_cache_spec_page_size: the 3-head layer is padded to 65536 (24,576 does not divide it)
    out = unify_page_sizes({"a": fa(8), "b": fa(3)}, "pad-to-max")
    assert (out["b"].block_size, out["b"].page_size_padded) == (16, 65_536)


def test_scale_only_raises_old_text():
    # vLLM before vllm#45181 / #45207 raised NotImplementedError with this exact text
    with pytest.raises(NotImplementedError) as exc:
        unify_page_sizes({"a": fa(8), "b": fa(3)}, "scale-only")
    assert str(exc.value) == SCALE_ONLY_TEXT
    with pytest.raises(NotImplementedError) as exc:
        unify_page_sizes({"a": fa(8), "m": ENV_MAMBA}, "scale-only")
    assert str(exc.value) == SCALE_ONLY_TEXT


def test_scale_only_smaller_mamba_trips_assertion():
    # unify.py docstring / vllm PR #45207's report: before the Mamba padding fix a smaller Mamba
    # page that divides the maximum hits the bare `assert new_spec.page_size_bytes == max_page_size`
    small = MambaSpec(block_size=16, shapes=((16_384,),), dtypes=("bfloat16",))  # 32,768 B
    with pytest.raises(AssertionError):
        unify_page_sizes({"a": fa(8), "m": small}, "scale-only")
    # pad-to-max pads it instead (vllm PR #45207)
    assert unify_page_sizes({"a": fa(8), "m": small})["m"].page_size_padded == 65_536


def test_draft_scales_target_block():
    # vLLM 0.33.0 unify_kv_cache_spec_page_size: target attention 32,768 B (block 16) + draft 65,536 B
    # -> target block 32
    out = unify_page_sizes({"target": fa(4), "draft": fa(8)})
    assert out["target"].block_size == 32


def test_mla_target_pads_smaller_swa_draft():
    # vLLM 0.33.0 unify_kv_cache_spec_page_size, pad branch: MLA 1152 B/token at block 64 (73,728) +
    # SWA draft 1024 B/token at 64 (65,536): the SWA page is padded to 73,728 (11.1 % waste)
    mla = AttentionSpec("mla", 64, 1, 576, "bfloat16")
    swa = AttentionSpec("sliding_window", 64, 2, 128, "bfloat16", sliding_window=4096)
    out = unify_page_sizes({"mla": mla, "draft": swa})
    assert (mla.page_size_bytes, swa.page_size_bytes) == (73_728, 65_536)
    draft = out["draft"]  # (73,728 - 65,536) / 73,728 of its page is padding
    assert f"{100 * (1 - draft.real_page_size_bytes / draft.page_size_bytes):.1f}" == "11.1"
    assert (draft.block_size, draft.page_size_padded) == (64, 73_728)


def test_mla_not_dividing_raises_vllm_033_text():
    # unify_kv_cache_spec_page_size: an MLA page that is smaller and does not divide -> NotImplementedError
    mla = AttentionSpec("mla", 64, 1, 576, "bfloat16")  # 73,728
    big = AttentionSpec("full_attention", 64, 8, 128, "bfloat16")  # 262,144, not a multiple of 73,728
    with pytest.raises(NotImplementedError) as exc:
        unify_page_sizes({"model.layers.0.self_attn": big, "model.layers.1.self_attn": mla})
    assert str(exc.value) == mla_text("model.layers.1.self_attn")


def test_lcm_policy_rounds_target_up_for_mla():
    # unify.py / vllm PR #40128 proposal: target = max page rounded up to the lcm of the smaller ones:
    # round_up(262,144, 73,728) = 4 * 73,728 = 294,912 -> MLA scales to block 256, the FA page is padded
    mla = AttentionSpec("mla", 64, 1, 576, "bfloat16")
    big = AttentionSpec("full_attention", 64, 8, 128, "bfloat16")
    out = unify_page_sizes({"fa": big, "mla": mla}, "lcm")
    assert (out["mla"].block_size, out["mla"].page_size_padded) == (256, None)
    assert (out["fa"].block_size, out["fa"].page_size_padded) == (64, 294_912)


def test_granite_with_dense_draft():
    # vLLM 0.33.0 unify_kv_cache_spec_page_size: Granite-Tiny (P = 819,200) + a 3072 B/token draft x 400
    # = 1,228,800: target attention padded at block 400, Mamba padded; a 4096 B/token draft (2P): target
    # block 800
    s = granite_tiny()
    specs = layer_specs(s, hybrid_alignment(s))
    attn, mixer = "model.layers.5.self_attn", "model.layers.0.mixer"
    out = unify_page_sizes({**specs, "draft": AttentionSpec("full_attention", 400, 6, 128, "bfloat16")})
    assert (out[attn].block_size, out[attn].page_size_bytes, out[mixer].page_size_bytes) == (
        400,
        1_228_800,
        1_228_800,
    )
    out = unify_page_sizes({**specs, "draft": AttentionSpec("full_attention", 400, 8, 128, "bfloat16")})
    assert (out[attn].block_size, out[attn].page_size_padded) == (800, None)
    assert out[mixer].page_size_padded == 1_638_400


def test_lcm_policy_turboquant_probe():
    # vllm PR #40128 probe (scenario.py docstring: "the TurboQuant LCM case of vllm#40128"):
    # attention head 194, 1 KV head, bf16, block 1 -> (194+194)*2 = 776 B; Mamba 3,162,112 fp32
    # elements = 12,648,448 B -> target 776 * 16,300 = 12,648,800 B, attention block 16,300, +0.0028 %
    attn = AttentionSpec("full_attention", 1, 1, 194, "bfloat16")
    state = MambaSpec(block_size=1, shapes=((3_162_112,),), dtypes=("float32",))
    assert (attn.page_size_bytes, state.page_size_bytes) == (776, 12_648_448)
    out = unify_page_sizes({"attn": attn, "state": state}, "lcm")
    assert (out["attn"].block_size, out["attn"].page_size_padded) == (16_300, None)
    assert out["state"].page_size_bytes == 12_648_800
    # the state padded over its real bytes: (12,648,800 - 12,648,448) / 12,648,448
    assert f"{100 * (out['state'].page_size_bytes / out['state'].real_page_size_bytes - 1):.4f}" == "0.0028"
    # pad-to-max instead pads the one-token attention page to the whole state page
    padded = unify_page_sizes({"attn": attn, "state": state}, "pad-to-max")
    assert (padded["attn"].block_size, padded["attn"].page_size_padded) == (1, 12_648_448)


def test_lcm_policy_probe_through_spec_level_scenario():
    s = scenario_from_dict(
        {
            "schema": "kv-scenario/1", "name": "tq-lcm-probe",
            "layer_specs": [
                {"kind": "full_attention", "block_size": 1, "num_kv_heads": 1, "head_size": 194},
                {"kind": "mamba", "shapes": [[3_162_112]], "dtypes": ["float32"]},
            ],
            "runtime": {"unify_policy": "lcm"},
        }
    )  # fmt: skip
    p = plan(s)
    assert (p.block_size, p.page_size_bytes) == (16_300, 12_648_800)


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown unify policy"):
        unify_page_sizes({"a": fa(8), "b": fa(4)}, "round-robin")


# The padding percentages above are read from the unified specs (they were literal arithmetic once):
# a unification that gets the page right but not the padding fails them.

THIS = sys.modules[__name__]
_UNIFY = unify_page_sizes


def _scales_instead_of_padding(specs, policy="pad-to-max"):
    """Reaches a padded attention page by growing the block (no padding left to see)."""
    out = _UNIFY(specs, policy)
    return {
        k: dataclasses.replace(v, block_size=v.page_size_padded // v.bytes_per_token, page_size_padded=None)
        if isinstance(v, AttentionSpec) and v.page_size_padded and v.page_size_padded % v.bytes_per_token == 0
        else v
        for k, v in out.items()
    }  # fmt: skip


def _grows_the_state(specs, policy="pad-to-max"):
    """Reaches a padded state page by growing the state tensor (the real state is lost)."""
    out = _UNIFY(specs, policy)
    return {
        k: dataclasses.replace(v, shapes=((v.page_size_bytes,),), dtypes=("uint8",), page_size_padded=None)
        if isinstance(v, MambaSpec) and v.page_size_padded
        else v
        for k, v in out.items()
    }  # fmt: skip


@pytest.mark.parametrize(
    ("test", "wrong", "shown"),
    [
        ("test_mla_target_pads_smaller_swa_draft", _scales_instead_of_padding, "'0.0' == '11.1'"),
        ("test_lcm_policy_turboquant_probe", _grows_the_state, "'0.0000' == '0.0028'"),
    ],
)
def test_padding_assertions_catch_a_wrong_unification(monkeypatch, test, wrong, shown):
    monkeypatch.setattr(THIS, "unify_page_sizes", wrong)
    with pytest.raises(AssertionError, match=re.escape(shown)):
        getattr(THIS, test)()


# --------------------------------------------------------------------------- grouping (kv_cache_planning)


def test_granite_tiny_10_groups_of_4():
    # vLLM 0.33.0 _get_kv_cache_groups_uniform_page_size: 4 attention + 36 Mamba, group_size = 4 ->
    # 1 attention + 9 Mamba groups
    s = granite_tiny()
    groups = get_kv_cache_groups(layer_specs(s, hybrid_alignment(s)))
    assert len(groups) == 10
    assert [len(g.layer_names) for g in groups] == [4] * 10
    assert group_size(groups) == 4
    assert bytes_per_block(groups) == 3_276_800  # _get_kv_cache_bytes_per_block: 4 * 819,200


def test_group_size_rule():
    # vLLM 0.33.0 _get_kv_cache_groups_uniform_page_size: min, but max when max < 1.5 * min
    assert group_size_for([52, 10]) == 10  # Gemma-3-27B-like: 52 SW + 10 full
    assert group_size_for([12, 13]) == 13  # gpt-oss + EAGLE draft: 12 SW + 13 full
    assert group_size_for([4, 36]) == 4  # Granite: 4 attention + 36 Mamba


def test_gemma3_27b_like_52_sw_plus_10_full():
    # _get_kv_cache_groups_uniform_page_size: group_size 10, SW -> 6 groups [9,9,9,9,8,8] (strided),
    # bytes_per_block = 10 * P
    layers = "".join("A" if i % 6 == 5 and i < 60 else "S" for i in range(62))
    s = make_scenario(model(layers, gqa(16, 128, sliding_window=1024)))
    assert Counter(spec.kind for spec in layer_specs(s).values()) == {
        "sliding_window": 52,
        "full_attention": 10,
    }
    groups = get_kv_cache_groups(layer_specs(s))
    sw = [g for g in groups if g.kind == "sliding_window"]
    full = [g for g in groups if g.kind == "full_attention"]
    assert [len(g.layer_names) for g in sw] == [9, 9, 9, 9, 8, 8]
    assert [len(g.layer_names) for g in full] == [10]
    sw_names = [n for n in layer_specs(s) if layer_specs(s)[n].kind == "sliding_window"]
    assert sw[0].layer_names == tuple(sw_names[0::6])  # layers[i::num_groups]
    page_bytes = 16 * 16 * 256 * 2
    assert bytes_per_block(groups) == 10 * page_bytes


def gpt_oss(layers: str, **runtime: Any) -> Scenario:
    # openai/gpt-oss-20b-like: 8 KV heads x 64, P = 32,768 at block 16, sliding window 128
    return make_scenario(model(layers, gqa(8, 64, sliding_window=128)), runtime, "gpt-oss-like")


def test_gpt_oss_two_groups_of_12():
    # _get_kv_cache_groups_uniform_page_size: gpt-oss-20b (12 SW + 12 full): 2 groups x 12;
    # bytes_per_block = 12 * 32,768 = 393,216
    groups = get_kv_cache_groups(layer_specs(gpt_oss("SA" * 12)))
    assert sorted((g.kind, len(g.layer_names)) for g in groups) == [
        ("full_attention", 12),
        ("sliding_window", 12),
    ]
    assert bytes_per_block(groups) == 393_216


def test_gpt_oss_with_eagle_draft_group_size_13():
    # 13 < 1.5 * 12, so group_size = max = 13 (log "Add 1 padding layers")
    groups = get_kv_cache_groups(layer_specs(gpt_oss("SA" * 12 + "A")))
    assert len(groups) == 2
    assert group_size(groups) == 13


def test_gpt_oss_needed_memory():
    # vLLM 0.33.0 max_memory_usage_bytes, L = 131,072, F = 2 x 8192: SW cdiv(127 + 16,384, 16) + 1 = 1033
    # blocks, full 8192; needed = 9225 * bpb = 3.38 GiB
    s = gpt_oss("SA" * 12, max_model_len=131_072, max_num_batched_tokens=8192, max_concurrent_batches=2)
    groups = get_kv_cache_groups(layer_specs(s))
    per_kind = {g.kind: g.blocks_per_request(s.runtime) for g in groups}
    assert per_kind == {"sliding_window": 1033, "full_attention": 8192}
    assert needed_bytes(groups, s.runtime) == 9225 * 393_216
    assert format_gib(needed_bytes(groups, s.runtime)) == "3.38"  # 3,627,417,600 B / 2**30


_LAYER_SPECS = layer_specs


def _windows_as_full(s, choice=None):
    """Every sliding-window layer billed as full attention (vllm-metal#563's wrong formula)."""
    return {
        k: dataclasses.replace(v, kind="full_attention", sliding_window=None)
        if v.kind == "sliding_window"
        else v
        for k, v in _LAYER_SPECS(s, choice).items()
    }


@pytest.mark.parametrize(
    ("test", "name", "wrong", "shown"),
    [
        # the layer count comes from the specs (it was the test's own string once)
        ("test_gemma3_27b_like_52_sw_plus_10_full", "layer_specs", _windows_as_full, "full_attention': 62"),
        # the GiB text comes from the need (it was format_gib of a literal once); decimal GB: 3.63
        ("test_gpt_oss_needed_memory", "format_gib", lambda b: f"{round(b / 1e9, 2)}", "'3.63' == '3.38'"),
    ],
)
def test_grouping_assertions_catch_a_wrong_rule(monkeypatch, test, name, wrong, shown):
    monkeypatch.setattr(THIS, name, wrong)
    with pytest.raises(AssertionError, match=re.escape(shown)):
        getattr(THIS, test)()


def deepseek_v32(**runtime: Any) -> Scenario:
    # deepseek-ai/DeepSeek-V3.2-like: 61 layers; fp8_ds_mla 656 + indexer 132 B per token, block 64
    mla = {"kind": "mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64, "indexer_head_dim": 128}
    rt = {"block_size": 64, "kernel_block_alignment": 64, "kv_cache_dtype": "fp8_ds_mla", **runtime}
    return make_scenario(model("A" * 61, mla), rt, "deepseek-v3.2-like")


def test_deepseek_v32_uniform_type_group():
    # vLLM 0.33.0 UniformTypeKVCacheSpecs.from_specs: one group, bytes_per_block = 61 * (41,984 + 8,448)
    # = 3,076,352
    groups = get_kv_cache_groups(layer_specs(deepseek_v32()))
    assert [g.kind for g in groups] == ["uniform_type"]
    assert len(groups[0].layer_names) == 122
    assert bytes_per_block(groups) == 3_076_352
    assert groups[0].page_size_bytes == 3_076_352  # UniformTypeKVCacheSpecs page = sum of the layers'
    p = plan(deepseek_v32())
    assert (p.attn_bytes_per_token_per_layer, p.indexer_bytes_per_token_per_layer) == (656, 132)


# --------------------------------------------------------------------------- memory (kv_cache_planning)

LLAMA_LIKE = model("A" * 32, gqa(8, 128))  # _get_kv_cache_bytes_per_block: 32 x 65,536 -> 2 MiB


def llama(**runtime: Any) -> Scenario:
    return make_scenario(LLAMA_LIKE, {"max_model_len": 8192, **runtime}, "llama-like")


def test_llama_like_bytes_per_block():
    assert plan(llama()).bytes_per_block == 2 * MiB  # 32 * 65,536 = 2,097,152


def test_not_enough_memory_exact_text():
    # vLLM 0.33.0 _check_enough_kv_cache_memory text: needed 512 * 2 MiB = 1.0 GiB; check = 1 GiB - 2 MiB
    # (the null block) -> "(1.0 GiB" twice; estimate 8176 = 511 blocks * 16
    p = plan(llama(kv_cache_memory_bytes=GiB))
    assert p.admission == (
        "To serve at least one request with the model's max seq len (8192), (1.0 GiB KV cache is "
        "needed, which is larger than the available KV cache memory (1.0 GiB). Based on the "
        "available memory, the estimated maximum model length is 8176. Try increasing "
        "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or decreasing "
        "`max_model_len` when initializing the engine. See "
        "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    )
    assert p.admission.count("(1.0 GiB") == 2
    assert (p.needed_bytes, p.available_bytes, p.max_model_len_estimate) == (GiB, GiB - 2 * MiB, 8176)
    assert p.num_blocks == 512  # available // bpb counts the full memory (get_kv_cache_configs)


def test_ten_gib_5120_blocks():
    # vLLM 0.33.0 get_kv_cache_configs: 10 GiB // 2 MiB = 5120 blocks (5119 usable; BlockPool's null block)
    p = plan(llama(kv_cache_memory_bytes=10 * GiB))
    assert (p.num_blocks, p.admission) == (5120, "ok")


def test_needed_equal_to_check_passes():
    # _check_enough_kv_cache_memory: needed == check passes (strict > test)
    p = plan(llama(kv_cache_memory_bytes=GiB + 2 * MiB))
    assert p.needed_bytes == p.available_bytes == GiB
    assert p.admission == "ok"


NO_MEMORY_TEXT = (
    "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing "
    "the engine (this flag also controls CPU memory reservation on the CPU backend, despite its name). "
    "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)  # vLLM 0.33.0 _check_enough_kv_cache_memory


@pytest.mark.parametrize(
    "runtime",
    [
        {"kv_cache_memory_bytes": 2 * MiB},  # avail <= bytes_per_block -> check <= 0
        {"kv_cache_memory_bytes": MiB},
        {"num_gpu_blocks_override": 1},  # override 1 -> check = 0 (the null block)
    ],
)
def test_no_available_memory_text(runtime):
    p = plan(llama(**runtime))
    assert p.admission == NO_MEMORY_TEXT
    assert p.max_model_len_estimate == 0


def test_override_replaces_available_memory():
    # vLLM 0.33.0 get_kv_cache_configs: avail_w = num_gpu_blocks_override * bpb_w
    p = plan(llama(num_gpu_blocks_override=600))
    assert (p.num_blocks, p.available_bytes, p.admission) == (600, 599 * 2 * MiB, "ok")


def test_granite_tiny_8gib():
    # vLLM 0.33.0 get_max_concurrency_for_kv_cache_config: 8 GiB // 3,276,800 = 2621 blocks;
    # cdiv(32,768, 400) + 9 = 91 per request -> 2621 / 91 = 28.80x
    p = plan(granite_tiny(max_model_len=32_768, kv_cache_memory_bytes=8 * GiB))
    assert (p.bytes_per_block, p.num_blocks, p.blocks_per_request) == (3_276_800, 2621, 91)
    assert f"{p.max_concurrency:.2f}" == "28.80"


def test_granite_tiny_8gib_align_mode():
    # align mode (MambaSpec: 3 pages): 82 + 27 = 109 blocks per request -> 2621 / 109 = 24.05x
    p = plan(granite_tiny(max_model_len=32_768, kv_cache_memory_bytes=8 * GiB, mamba_cache_mode="align"))
    assert p.blocks_per_request == 109
    assert f"{p.max_concurrency:.2f}" == "24.05"


@pytest.mark.parametrize(("mode", "blocks", "gib"), [("none", 328 + 9, "1.03"), ("align", 328 + 27, "1.08")])
def test_granite_tiny_131k_needed(mode, blocks, gib):
    # vLLM 0.33.0 get_kv_cache_configs, L = 131,072: none (328 + 9) * bpb = 1,104,281,600 B (1.03 GiB);
    # align (328 + 27) * bpb = 1.08 GiB; 20 GiB // 3,276,800 = 6553 blocks
    p = plan(granite_tiny(max_model_len=131_072, kv_cache_memory_bytes=20 * GiB, mamba_cache_mode=mode))
    assert p.needed_bytes == blocks * 3_276_800
    assert format_gib(p.needed_bytes) == gib
    assert p.num_blocks == 6553
    if mode == "none":
        assert p.needed_bytes == 1_104_281_600


def test_vllm_golden_estimate_max_model_len():
    # vLLM tests/v1/core/test_kv_cache_utils.py::test_estimate_max_model_len:
    # 32 layers, 32 KV heads, head 128, fp16, block 16, 8 GiB -> 16385 estimates 16384; 16383 -> 16383
    s = make_scenario(model("A" * 32, gqa(32, 128), dtype="float16"), {"max_model_len": 16_385})
    groups = get_kv_cache_groups(layer_specs(s))
    assert estimate_max_model_len(groups, s.runtime, 8 * GiB) == 16_384
    rt = s.with_runtime(max_model_len=16_383).runtime
    assert estimate_max_model_len(groups, rt, 8 * GiB) == 16_383


def test_estimate_zero_when_one_token_does_not_fit():
    # vLLM 0.33.0 estimate_max_model_len (kv_cache_planning.py) returns 0 if L = 1 does not fit
    groups = get_kv_cache_groups(layer_specs(llama()))
    assert estimate_max_model_len(groups, llama().runtime, 2 * MiB - 1) == 0
    assert estimate_max_model_len(groups, llama().runtime, 2 * MiB) == 16


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [(GiB, "1.0"), (GiB - 2 * MiB, "1.0"), (GiB + GiB // 2, "1.5"), (1_104_281_600, "1.03"), (0, "0.0")],
)  # vLLM 0.33.0 vllm/utils/mem_utils.py, format_gib: f"{round(b / 2**30, 2)}" (so 1.0, not 1.00)
def test_format_gib(num_bytes, text):
    assert format_gib(num_bytes) == text


def test_no_groups_plan_the_null_block_only():
    """get_kv_cache_config_from_groups (vLLM 0.23 ... 0.33): no groups, ``num_blocks=1`` ("BlockPool
    always needs a null_block"), whatever the budget; the engine checks nothing. Auto-fit keeps
    the derived length and logs _auto_fit_max_model_len's attention-free text."""
    m = check_memory([], RuntimeSettings(kv_cache_memory_bytes=2**30))
    assert (m.num_blocks, m.bytes_per_block, m.needed_bytes, m.available_bytes, m.admission) == (
        1,
        0,
        0,
        0,
        "ok",
    )
    fit = check_memory([], RuntimeSettings(max_model_len=512, auto_fit_max_model_len=True))
    assert (fit.max_model_len, fit.auto_fit) == (
        512,
        "Auto-fit max_model_len: attention-free model, using derived max_model_len=512",
    )


# --------------------------------------------------------------------------- vllm-metal @ 211a1e4


@pytest.mark.parametrize(
    ("block", "kernel"), [(160, 32), (544, 32), (144, 16), (48, 16), (24, 8), (1808, 16), (32, 32), (8, 8)]
)  # vllm-metal attention/impls/sdpa.py, _pick_kernel_block_size: the largest of (32, 16, 8) dividing
def test_pick_kernel_block_size(block, kernel):
    assert pick_kernel_block_size(block) == kernel


def test_pick_kernel_block_size_error_text():
    # vllm-metal attention/impls/sdpa.py, _pick_kernel_block_size: the ValueError text
    with pytest.raises(ValueError) as exc:
        pick_kernel_block_size(7)
    assert str(exc.value) == (
        "Cache block_size=7 is not divisible by any supported kernel block size (32, 16, 8). "
        "Adjust --block-size (must be a multiple of 8)."
    )


def test_build_block_tables_example():
    # vllm-metal sdpa.py, _build_block_tables([[0,2],[1]], 160) -> kbs 32, padding block 0 expanded too
    assert build_block_tables([[0, 2], [1]], 160) == (
        [[0, 1, 2, 3, 4, 10, 11, 12, 13, 14], [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]],
        32,
    )


def test_build_block_tables_fast_path_and_empty():
    # vllm-metal sdpa.py, _build_block_tables: a kernel-sized block only zero-pads the rows;
    # no rows -> (empty, cache_block_size)
    assert build_block_tables([[3], [1, 2]], 16) == ([[3, 0], [1, 2]], 16)
    assert build_block_tables([], 544) == ([], 544)


def test_metal_one_sequence_bytes_vector():
    # vllm-metal#229, tests/test_v1_worker.py::TestOneSequenceKvBytes::
    # test_block_alignment_rounds_up_token_count:
    # L=4, H=4, D=64, fp16, max_model_len 2048, bs 400 -> 2*4*2400*4*64*2 (2400 = 6 x 400)
    s = make_scenario(model("AAAA", gqa(4, 64), dtype="float16"), {"max_model_len": 2048})
    assert one_sequence_kv_bytes(s, 400) == 2 * 4 * 2400 * 4 * 64 * 2


def test_metal_one_sequence_mla_latent_only():
    # vllm-metal#233, ModelCachePolicy.estimate_one_sequence_kv_bytes: MLA kv_factor = 1 (one latent of
    # kv_lora_rank + rope), not 2x
    mla = {"kind": "mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    s = make_scenario(model("AA", mla), {"max_model_len": 100})
    assert one_sequence_kv_bytes(s, 16) == 2 * 112 * 576 * 2  # 112 = cdiv(100, 16) * 16


def test_metal_gdn_recurrent_state_is_fp32():
    # vllm-metal#243, v1/cache_policy.py linear_cache_bytes_per_slot = (K-1)*conv_dim*dtype + Hv*Dv*Dk*4,
    # even when the model's ssm dtype resolves to bf16: Qwen3.5-0.8B-like 3*6144*2 + 16*128*128*4
    # = 1,085,440
    m = model("MMMA", gqa(2, 256), {**QWEN35_08B_GDN, "ssm_dtype": "auto"})
    s = make_scenario(m, {"max_model_len": 32})
    assert linear_cache_bytes_per_slot(s) == 1_085_440
    # one-sequence estimate: attention + one slot per linear layer; padded pages replace it (#575)
    attn = 1 * 544 * 2 * 2 * 256 * 2
    assert one_sequence_kv_bytes(s, 544) == attn + 3 * 1_085_440
    assert one_sequence_kv_bytes(s, 544, state_page_padded=1_114_112) == attn + 3 * 1_114_112


@pytest.mark.parametrize(
    ("args", "want"),
    [
        # vllm-metal v1/cache_policy.py, turboquant_page_size_bytes: packed K + packed V + 3 fp16 scales
        ((16, 8, 128, "q8_0", "q8_0"), 35_840),  # 16*8*256 + 3*16*8*4*2
        ((16, 8, 128, "q4_0", "q4_0"), 19_456),
        ((1, 1, 128, "q8_0", "q3_0"), 200),  # 128 + 48 + 3*4*2 = 200 B per token per head
        ((1, 1, 128, "q4_0", "q4_0"), 152),  # 64 + 64 + 24 = 152 B (3.37x, vllm-metal#472)
        ((1, 4, 128, "q4_0", "q4_0"), 608),  # tq1 = 4 * 152 B/token (tests/test_turboquant_hybrid_sizing.py)
    ],
)
def test_metal_turboquant_page(args, want):
    assert metal_turboquant_page_size_bytes(*args) == want


def test_metal_turboquant_realign_vector():
    # vllm-metal platform.py, _realign_hybrid_block_size_for_turboquant (vllm-metal#472,
    # tests/test_turboquant_hybrid_sizing.py):
    # tq1 608 B/token, mamba ((3,8192),(32,128,128)) fp16 = 1,097,728 -> 16 * cdiv(1,097,728, 16 * 608)
    # = 1808, padded mamba 1,099,264; user or hash block 64 -> 1856; kernel 1808 -> 16 x 113
    a = align_hybrid_block_size(608, 1_097_728)
    assert (a.block_size, a.state_page_padded_bytes) == (1808, 1_099_264)
    assert align_hybrid_block_size(608, 1_097_728, block_size=64).block_size == 1856
    assert (pick_kernel_block_size(1808), 1808 // pick_kernel_block_size(1808)) == (16, 113)


def test_metal_qwen35_08b_kernel_translation():
    # vllm-metal#235, sdpa.py _pick_kernel_block_size: Qwen3.5-0.8B-like block 544 -> kernel 32, ratio 17
    p = plan(load_scenario("qwen3.5-0.8b"))
    assert (p.block_size, p.kernel_block_size, p.kernel_blocks_per_block) == (544, 32, 17)


# --------------------------------------------------------------------------- packaged [expect] tables

PLAN_FIELDS = set(KVPlan.field_names())


@pytest.mark.parametrize("name", packaged_scenario_names())
def test_packaged_expect_reproduced(name):
    s = load_scenario(name)
    assert s.expect, f"{name} has no [expect] table"
    if "rejects" in s.expect:  # every release refuses it
        with pytest.raises(ValueError) as refused:
            plan(s)
        assert rejection_kind(refused.value) == s.expect["rejects"]
        return
    got = plan(s).to_dict()
    for key, want in s.expect.items():
        assert key in got, f"{name}: [expect] key {key!r} is not a KVPlan field"
        if isinstance(want, float):
            assert got[key] == pytest.approx(want, abs=0.01), key
        else:
            assert got[key] == want, key
    # [expect.external]: independent public observations, where they name a plan field
    for key, want in s.expect_external.items():
        if key in PLAN_FIELDS:
            assert got[key] == pytest.approx(want, abs=0.01), f"external {key}"


# --------------------------------------------------------------------------- regressions


def test_mla_chunked_local_layer_keeps_chunk_size():
    # Found by this suite: attention_spec()'s MLA branch dropped attention_chunk_size, so an MLA model with
    # an 'L' layer crashed plan() with a bare AssertionError (fixed in 6dbd7ca).
    # scenario.py LAYER_CODES: "L" = chunked local attention ([model.attention].attention_chunk_size);
    # vLLM 0.33.0 ChunkedLocalAttentionSpec.max_memory_usage_bytes = cdiv(min(chunk + F, L), bs) * P (no +1)
    mla = {"kind": "mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64, "attention_chunk_size": 8192}
    s = make_scenario(model("AL", mla), {"max_model_len": 131_072, "max_num_batched_tokens": 4096,
                                          "block_size": 64, "kernel_block_alignment": 64})  # fmt: skip
    spec = layer_specs(s)["model.layers.1.self_attn"]
    assert spec.attention_chunk_size == 8192
    assert spec.max_memory_usage_bytes(s.runtime) == math.ceil(12_288 / 64) * 64 * 1152
    assert plan(s).blocks_per_request == 2048 + 192  # full MLA cdiv(131072, 64) + chunked 192


@pytest.mark.parametrize(
    ("release", "extra_block_alignment", "pages"),
    [
        # vLLM 0.33.0 qwen_gdn_linear_attn.py: align mode + FlashInfer GDN prefill (alignment 64)
        # gives the GDN spec one prefill checkpoint block: P * (2 + 0 + 1) per request
        ("0.33", 64, 3),
        ("0.33", 1, 2),  # no FlashInfer GDN prefill: no checkpoint block, P * (2 + 0)
        ("0.32", 64, 2),  # vLLM 0.32's GDN spec has none
    ],
)
def test_qwen_gdn_prefill_checkpoint_block(release, extra_block_alignment, pages):
    from pytest_kvconform.backends.base import ReferenceBackend
    from pytest_kvconform.reference.releases import rule_set

    s = load_scenario("qwen3.5-4b").with_runtime(
        mamba_cache_mode="align", extra_block_alignment=extra_block_alignment
    )
    rules = ReferenceBackend()
    rules.release = rule_set(release)
    (state,) = {x for x in rules.layer_specs(scenario=s).values() if isinstance(x, MambaSpec)}
    assert state.num_prefill_checkpoint_blocks == pages - 2
    assert state.max_memory_usage_bytes(s.runtime) == pages * state.page_size_bytes


# ---------------------------------------------------------------- per-layer geometry (Gemma 4)


@pytest.mark.parametrize(
    ("release", "groups"),
    [
        # primary block everywhere (before sliding_window_own_block): the full page 524,288 scales
        ("0.24", [*[("sliding_window", 64, 1_048_576)] * 5, ("full_attention", 128, 1_048_576)]),
        # the SW layer at the kernel block 16 (262,144 B), scaled to 32 to meet the full 64 x 8,192
        ("0.29", [*[("sliding_window", 32, 524_288)] * 5, ("full_attention", 64, 524_288)]),
        # the SW layer follows the primary block again (16 // 16 ... 64 // 16 * 16 = 64)
        ("0.30", [*[("sliding_window", 64, 1_048_576)] * 5, ("full_attention", 128, 1_048_576)]),
        ("0.33", [*[("sliding_window", 64, 1_048_576)] * 5, ("full_attention", 128, 1_048_576)]),
    ],
)
def test_gemma4_unequal_pages_with_the_sliding_window_block_of_each_release(release, groups):
    """Gemma 4 31B at --block-size 64: S layers 16 x 256 (16,384 B/token), A layers 4 x 512
    (8,192 B/token). Where the SW layer's block comes from (``sliding_window_own_block``,
    ``sliding_window_block_follows_primary``) decides which page is the larger one: worked by hand,
    the smaller page's block scales by max page / page."""
    from pytest_kvconform.reference.releases import rule_set
    from pytest_kvconform.reference.rules import reference_rules

    rules = reference_rules(rule_set(release))
    s = load_scenario("gemma-4-31b-it").with_runtime(block_size=64)
    specs = rules.layer_specs(scenario=s)
    assert {(x.kind, x.num_kv_heads, x.head_size) for x in specs.values()} == {
        ("sliding_window", 16, 256),
        ("full_attention", 4, 512),
    }
    got = rules.kv_cache_groups(specs, scenario=s)
    assert [(g.kind, g.block_size, g.page_size_bytes) for g in got] == groups
