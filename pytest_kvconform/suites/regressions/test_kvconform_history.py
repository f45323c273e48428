"""Sizing bugs from the vllm-metal history and other vLLM backends, pinned as regressions.

Each test names its source (``repository#number``) and the wrong formula it guards against; every test
calls the selected backend, and ``test_plan_golden`` compares the backend's full KVPlan with the
reference's JSON golden in ``__snapshots__/test_kvconform_history/`` (same file for every backend;
vLLM 0.27 and 0.28, which lack ``null_block_reserved``, have theirs in
``__snapshots_before_null_block_reserved__/``, older releases in the folders named by the golden
changes they lack: see ``conftest.py``). Numbers that a release changes
are asserted per release, each branch tied to its ``reference.releases.CHANGES`` entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pytest_kvconform.conformance import call_rule, outcome
from pytest_kvconform.reference.specs import AttentionSpec, MambaSpec
from pytest_kvconform.regressions import (
    assert_plan_matches_golden,
    backend_plan,
    one_sequence_bytes,
    regression,
)
from pytest_kvconform.scenario import Scenario

#: regressions compare with numbers derived independently of the reference (the reference's
#: self-check runs them)
pytestmark = pytest.mark.kvconform_independent

#: vLLM 0.33.0 _check_enough_kv_cache_memory (vllm/v1/core/kv_cache_planning.py), with the needed and
#: available GiB (``format_gib``: two decimals by ``round``), max_model_len and the estimate filled in
NOT_ENOUGH_MEMORY = (
    "To serve at least one request with the model's max seq len ({length}), ({needed} GiB KV cache is "
    "needed, which is larger than the available KV cache memory ({available} GiB). Based on the available "
    "memory, the estimated maximum model length is {estimate}. Try increasing `gpu_memory_utilization` "
    "(which also controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing "
    "the engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)


def check_memory(backend: Any, reference: Any, scenario: Scenario) -> Any:
    return call_rule(backend, "check_memory", reference.layer_specs(scenario), scenario=scenario)


def null_block_reserved(reference: Any) -> bool:
    """Whether the judged release has ``null_block_reserved`` (``reference.releases.CHANGES``;
    vLLM 0.29+: ``get_kv_cache_configs`` hands ``available - bytes_per_block`` to the admission
    check and the estimate; 0.27 and 0.28 hand them all of ``available``)."""
    return bool(reference.release.has("null_block_reserved"))


def groups(backend: Any, reference: Any, scenario: Scenario) -> Any:
    return call_rule(backend, "kv_cache_groups", reference.layer_specs(scenario), scenario=scenario)


# ----------------------------------------------------------------------------- vllm-metal#243
GDN_PROBE = regression("gdn-fp32-state-unpadded-probe")


@pytest.mark.kvconform_rule("one_sequence")
def test_metal243_gdn_recurrent_state_is_fp32(kv_backend: Any, kv_reference: Any) -> None:
    """vllm-metal#243 (and #579): the GDN recurrent state is stored (and billed) in fp32.

    Wrong formula: ``linear_cache_bytes_per_slot = (K-1)*conv_dim*2 + Hv*Dv*Dk*dtype_size`` with the
    model's 2-byte dtype, about 2x under for the recurrent part. Unpadded probe: 6 state layers x
    (3 x 4096 x 2 + 16 x 128 x 128 x 4) = 6 x 1,073,152 B plus 2 attention layers x 8384 x 256 B.
    """
    s = GDN_PROBE()
    got = one_sequence_bytes(kv_backend, kv_reference, s)
    assert got == 6 * (3 * 4096 * 2 + 16 * 128 * 128 * 4) + 2 * 8384 * 256  # 10,731,520
    state = next(x for x in kv_reference.layer_specs(s).values() if isinstance(x, MambaSpec))
    assert state.dtypes == ("bfloat16", "float32")
    assert call_rule(kv_backend, "state_page_bytes", state, scenario=s) == 1_073_152


# ----------------------------------------------------------------------------- vllm-metal#233/#529
GLM47 = regression("glm-4.7-flash-bf16")


@pytest.mark.kvconform_rule("attention_page")
def test_metal233_529_mla_is_one_latent(kv_backend: Any, kv_reference: Any) -> None:
    """vllm-metal#233 / #529: an MLA layer stores one latent (kv_lora_rank + rope = 576 values), no V.

    Wrong formula: ``2 * block_size * (kv_lora_rank + rope) * dtype`` (the K+V factor of a
    FullAttentionSpec): 2304 B/token instead of 1152 at bf16, half the engine blocks (500 of 1000).
    """
    s = GLM47()
    spec = next(iter(kv_reference.layer_specs(s).values()))
    assert call_rule(kv_backend, "attention_page_bytes", spec, scenario=s) == 64 * 576 * 2
    one_sequence = one_sequence_bytes(kv_backend, kv_reference, s)
    assert one_sequence == 47 * 131_072 * 576 * 2
    plan = backend_plan(kv_backend, s)
    assert (plan.attn_bytes_per_token_per_layer, plan.bytes_per_block) == (1152, 47 * 64 * 1152)


# ----------------------------------------------------------------------------- vllm-metal#513
LLAMA_NULL = regression("llama-3-8b-null-block")


@pytest.mark.kvconform_rule("memory")
def test_metal513_estimate_reserves_the_null_block(kv_backend: Any, kv_reference: Any) -> None:
    """vllm-metal#513 (vLLM 0.29+ get_kv_cache_configs, vllm#47272 / vllm#48724): block 0 is the
    null block, so the admission check and the estimate it runs see ``available - bytes_per_block``:
    1 GiB at 2 MiB per block fits 511 usable blocks = 8176 tokens.

    Wrong formula: estimate on the whole pool (8192 tokens, which then never gets scheduled).

    vLLM 0.27 and 0.28 (no ``null_block_reserved``) are that formula: the check and the estimate
    see the whole 1 GiB, which is exactly the need (512 blocks x 2 MiB), so 8192 is admitted and
    estimated; the bug vllm-metal#513 patched around on those releases.
    """
    s = LLAMA_NULL()
    got = check_memory(kv_backend, kv_reference, s)
    assert (got.bytes_per_block, got.num_blocks, got.needed_bytes) == (2 << 20, 512, 1 << 30)
    if not null_block_reserved(kv_reference):  # vLLM 0.27, 0.28
        assert (got.available_bytes, got.max_model_len_estimate, got.admission) == (1 << 30, 8192, "ok")
        return
    assert got.available_bytes == (1 << 30) - (2 << 20)
    assert got.max_model_len_estimate == 8176
    # 1 GiB -> "1.0"; 1 GiB - 2 MiB = 0.998 GiB -> "1.0" as well
    text = NOT_ENOUGH_MEMORY.format(length=8192, needed="1.0", available="1.0", estimate=8176)
    assert got.admission == text
    fitted = s.with_runtime(max_model_len=got.max_model_len_estimate)
    assert check_memory(kv_backend, kv_reference, fitted).admission == "ok"  # the fitted length fits


# ----------------------------------------------------------------------------- vllm-metal#527
QWEN25_OVERRIDE = regression("qwen2.5-3b-block-override")


@pytest.mark.kvconform_rule("memory")
def test_metal527_block_override_is_what_the_engine_requests(kv_backend: Any, kv_reference: Any) -> None:
    """vllm-metal#527: with --num-gpu-blocks-override 999999 the engine's KV cache config requests
    999999 blocks, while the pool from memory has 1846 (1,088,815,104 B / 589,824 B); a backend must
    report the override so the over-allocation can be detected and rejected.

    Wrong formula: ``num_blocks = kv_cache_memory_bytes // bytes_per_block`` (override ignored).

    The admission check sees the override's 999,999 blocks less the null block (vLLM 0.29+,
    ``null_block_reserved``), or all 999,999 (0.27, 0.28).
    """
    s = QWEN25_OVERRIDE()
    got = check_memory(kv_backend, kv_reference, s)
    assert got.bytes_per_block == 36 * 16 * 2 * 128 * 2 * 2  # 589,824
    assert got.num_blocks == 999_999
    assert got.num_blocks > s.runtime.kv_cache_memory_bytes // got.bytes_per_block == 1846
    usable = 999_999 - 1 if null_block_reserved(kv_reference) else 999_999
    assert got.available_bytes == usable * 589_824


# ----------------------------------------------------------------------------- vllm-metal#575
QWEN36_MLX = regression("qwen3.6-35b-a3b-mlx-8192")


@pytest.mark.kvconform_rule("one_sequence")
def test_metal575_estimate_counts_padded_state_pages(kv_backend: Any, kv_reference: Any) -> None:
    """vllm-metal#575: the non-paged estimate must add the *padded* Mamba page vLLM bills
    (30 x 2,162,688 B), so it equals vLLM's own need for one request (237,895,680 B).

    Wrong formula: ``+ num_linear * linear_cache_bytes_per_slot`` (30 x 2,146,304 B): the report
    (237,404,160 B) is 491,520 B short and vLLM refuses it. vllm-metal's own check said "0.22 GiB
    ... available 0.22 GiB"; vLLM's sees the report less the null block: 10 attention layers x 1056
    tokens x 2048 B = 21,626,880 B per block, 215,777,280 B ("0.2 GiB") = 9 blocks, 3 for the state
    groups and 6 x 1056 = 6336 tokens.

    vLLM 0.27 and 0.28 (no ``null_block_reserved``) see the whole report: 237,404,160 B ("0.22
    GiB", still 491,520 B short, so refused too) = 10 blocks, 3 for the state groups and
    7 x 1056 = 7392 tokens.
    """
    s = QWEN36_MLX()
    got = one_sequence_bytes(kv_backend, kv_reference, s)
    assert got == 10 * 8448 * 2048 + 30 * 2_162_688  # 237,895,680
    assert got == kv_reference.check_memory(kv_reference.layer_specs(s), scenario=s).needed_bytes
    short = s.with_runtime(kv_cache_memory_bytes=10 * 8448 * 2048 + 30 * 2_146_304)  # the wrong report
    refused = call_rule(kv_backend, "check_memory", kv_reference.layer_specs(short), scenario=short)
    seen, gib, estimate = (
        (215_777_280, "0.2", 6336) if null_block_reserved(kv_reference) else (237_404_160, "0.22", 7392)
    )
    assert (refused.needed_bytes, refused.available_bytes) == (237_895_680, seen)
    assert refused.max_model_len_estimate == estimate
    assert refused.admission == NOT_ENOUGH_MEMORY.format(
        length=8192, needed="0.22", available=gib, estimate=estimate
    )


# ----------------------------------------------------------------------------- vllm-metal#563
GEMMA_STYLE = regression("gemma-style-sliding-full")


@pytest.mark.kvconform_rule("max_memory")
def test_metal563_sliding_layers_are_not_billed_as_full(kv_backend: Any, kv_reference: Any) -> None:
    """vllm-metal#563 (#505): 50 sliding-window layers (window 1024) + 10 full layers. A sliding
    layer needs cdiv(min(1023 + 2048, L), 16) + 1 = 193 blocks, not cdiv(131072, 16) = 8192.

    Wrong formula: every layer billed as full attention (``cdiv(max_model_len, bs) * page``).
    """
    s = GEMMA_STYLE()
    specs = list(dict.fromkeys(kv_reference.layer_specs(s).values()))
    sliding = next(x for x in specs if x.kind == "sliding_window")
    full = next(x for x in specs if x.kind == "full_attention")
    mm = [call_rule(kv_backend, "max_memory_usage_bytes", x, scenario=s)
          for x in (sliding, full)]  # fmt: skip
    assert mm == [193 * 262_144, 8192 * 262_144]
    got = groups(kv_backend, kv_reference, s)
    assert [(g.kind, len(g.layer_names), g.blocks_per_request) for g in got] == [
        *[("sliding_window", 10, 193)] * 5,
        ("full_attention", 10, 8192),
    ]
    plan = backend_plan(kv_backend, s)
    assert (plan.blocks_per_request, plan.admission) == (5 * 193 + 8192, "ok")


# ----------------------------------------------------------------------------- vllm-metal#251/#277
GEMMA4_31B = regression("gemma-4-31b-per-layer-heads")


@pytest.mark.kvconform_rule("grouping")
def test_metal251_277_per_layer_kv_heads(kv_backend: Any, kv_reference: Any) -> None:
    """vllm-metal#251/#277 (and #563's layout): Gemma4-31B's 50 sliding layers have 16 KV heads x
    256 and its 10 full layers 4 x 512: 901,120 B per token over all layers (14,417,920 B per block
    at 16). The full pages (131,072 B) scale to block 32 to match the sliding ones (262,144 B).

    Wrong formula: every layer at ``max(head_dim, global_head_dim) = 512`` with the uniform 16 heads
    (1,966,080 B per token, about 2.18x).
    """
    s = GEMMA4_31B()
    specs = kv_reference.layer_specs(s)
    assert sum(x.bytes_per_token for x in specs.values()) == 901_120
    got = groups(kv_backend, kv_reference, s)
    assert [(g.kind, g.block_size, g.page_size_bytes) for g in got] == [
        *[("sliding_window", 16, 262_144)] * 5,
        ("full_attention", 32, 262_144),
    ]
    plan = backend_plan(kv_backend, s)
    assert (plan.kv_bytes_per_token, plan.bytes_per_block) == (901_120, 10 * 262_144)


# ----------------------------------------------------------------------------- vllm-metal#259/#579
QWEN3_NEXT = regression("qwen3-next-80b-a3b")


@pytest.mark.kvconform_rule("grouping")
def test_metal259_579_state_needs_one_block_per_request(kv_backend: Any, kv_reference: Any) -> None:
    """vllm-metal#259 / #579: in ``none`` mode a state group needs one block per request, whatever
    the length (MambaSpec.block_size = max_model_len).

    Wrong formula: ``blocks = cdiv(max_model_len, mamba_block_size)`` with ``MambaSpec(block_size=1)``
    (#259: one block per token per GDN group, about 1145 tokens max) or the attention block (#579:
    3 blocks for a 1301-token request at block 544).
    """
    s = QWEN3_NEXT()
    state = next(x for x in kv_reference.layer_specs(s).values() if isinstance(x, MambaSpec))
    assert state.block_size == s.runtime.max_model_len
    mm = call_rule(kv_backend, "max_memory_usage_bytes", state, scenario=s)
    assert mm == state.page_size_bytes
    got = groups(kv_backend, kv_reference, s)
    assert [(g.kind, g.blocks_per_request) for g in got] == [*[("mamba", 1)] * 3, ("full_attention", 61)]
    short = s.with_runtime(max_model_len=1301)
    assert [g.blocks_per_request for g in groups(kv_backend, kv_reference, short)] == [1, 1, 1, 3]
    assert backend_plan(kv_backend, s).blocks_per_request == 61 + 3


# ----------------------------------------------------------------------------- vllm-metal#235
@pytest.mark.kvconform_rule("kernel_block")
@pytest.mark.parametrize(("block", "kernel"), [(544, 32), (1808, 16), (144, 16), (2768, 16), (4192, 32)])
def test_metal235_kernel_block_is_translated(kv_backend: Any, block: int, kernel: int) -> None:
    """vllm-metal#235: Qwen3.5 + paged attention failed with "Unable to load function
    paged_attention_..._bs544_...": the kernel exists for blocks 8/16/32 only.

    Wrong formula: dispatch with the vLLM block size (``kernel_block_size(bs) == bs``, no table
    expansion).
    """
    assert call_rule(kv_backend, "kernel_block_size", block) == kernel
    table, got = call_rule(kv_backend, "build_block_tables", [[3], [0, 1]], block)
    ratio = block // kernel
    assert got == kernel
    assert [list(map(int, r)) for r in table] == [
        [*range(3 * ratio, 4 * ratio), *range(ratio)],
        [*range(ratio), *range(ratio, 2 * ratio)],
    ]


@pytest.mark.kvconform_rule("plan")
def test_metal235_plan_reports_the_translation(kv_backend: Any) -> None:
    """vllm-metal#235 on the real Qwen3.5-0.8B (block 544): 17 kernel blocks of 32."""
    plan = backend_plan(kv_backend, regression("qwen3.5-0.8b")())
    assert (plan.block_size, plan.kernel_block_size, plan.kernel_blocks_per_block) == (544, 32, 17)


# ----------------------------------------------------------------------------- vllm-metal#125
QWEN3_FP32 = regression("qwen3-0.6b-fp32")


@pytest.mark.kvconform_rule("dtype")
def test_metal125_fp32_model_is_4_bytes(kv_backend: Any, kv_reference: Any) -> None:
    """vllm-metal#125 (issue #119): the KV cache of a float32 model stores 4-byte elements.

    Wrong formula: ``dtype_size = 2`` hard-coded (fp32 models undercounted 2x).
    """
    assert call_rule(kv_backend, "kv_cache_dtype_bytes", "auto", "float32") == 4
    s = QWEN3_FP32()
    spec = next(iter(kv_reference.layer_specs(s).values()))
    page = call_rule(kv_backend, "attention_page_bytes", spec, scenario=s)
    assert page == 16 * 8 * 128 * 2 * 4
    plan = backend_plan(kv_backend, s)
    assert (plan.attn_bytes_per_token_per_layer, plan.bytes_per_block) == (8192, 28 * 16 * 8192)


# ----------------------------------------------------------------------------- vllm#43626 / #45207
GRANITE_DRAFT = regression("granite-4.0-h-tiny-dense-draft")


@pytest.mark.kvconform_rule("unification")
def test_vllm43626_mamba_page_is_padded_not_scaled(kv_backend: Any, kv_reference: Any) -> None:
    """vllm#43626 (fixed by #45207; also #38979): Granite-4.0-H-Tiny (attention 819,200 B at block
    400, Mamba 806,400 B) plus a dense draft of 1,638,400 B: target attention scales to block 800,
    and the Mamba page is *padded* to 1,638,400 B.

    Wrong formula: scale the MambaSpec's block_size like an attention layer's (its page does not
    depend on block_size, so the post-condition assert fires: a bare AssertionError).

    vLLM 0.23 ... 0.25 (no ``mamba_page_padding``) do not pad a Mamba page: 806,400 B does not
    divide 1,638,400 B (2 x 806,400 + 25,600), so unification raises NotImplementedError.
    """
    s = GRANITE_DRAFT().with_runtime(unify_policy="pad-to-max")
    specs = kv_reference.layer_specs(s)
    if not kv_reference.release.has("mamba_page_padding"):  # vLLM 0.23 ... 0.25
        assert outcome(kv_backend, "unify_page_sizes", specs, scenario=s) == (
            "rejects",
            "pages_not_unifiable",
        )
        return
    out = call_rule(kv_backend, "unify_page_sizes", specs, scenario=s)
    target, state, draft = out["layer_specs.0.0"], out["layer_specs.1.0"], out["layer_specs.2.0"]
    assert (target.block_size, target.page_size_bytes) == (800, 1_638_400)
    assert isinstance(state, MambaSpec)
    assert state.page_size_bytes == 1_638_400
    # padded, not scaled: the 806,400 B state (which does not divide 1,638,400) stays real, +103.17 %
    assert f"{100 * (state.page_size_bytes / state.real_page_size_bytes - 1):.2f}" == "103.17"
    assert isinstance(draft, AttentionSpec) and (draft.block_size, draft.page_size_bytes) == (400, 1_638_400)


# ----------------------------------------------------------------------------- goldens
#: id (source and name) -> scenario loader; ``test_plan_golden[<id>]`` snapshots its KVPlan.
GOLDENS: dict[str, Callable[[], Scenario]] = {
    "vllm-metal-243-gdn-fp32-state": GDN_PROBE,
    "vllm-metal-233-529-glm47-mla": GLM47,
    "vllm-metal-513-llama3-null-block": LLAMA_NULL,
    "vllm-metal-527-qwen25-block-override": QWEN25_OVERRIDE,
    "vllm-metal-575-qwen36-padded-state": QWEN36_MLX,
    "vllm-metal-563-gemma-sliding-full": GEMMA_STYLE,
    "vllm-metal-251-277-gemma4-31b-heads": GEMMA4_31B,
    "vllm-metal-259-579-qwen3-next-state-blocks": QWEN3_NEXT,
    "vllm-metal-259-579-qwen3-next-1301": regression("qwen3-next-80b-a3b", max_model_len=1301),
    "vllm-metal-125-qwen3-fp32": QWEN3_FP32,
    "vllm-43626-granite-dense-draft": GRANITE_DRAFT,
}


@pytest.mark.kvconform_rule("plan")
@pytest.mark.parametrize("name", list(GOLDENS))
def test_plan_golden(kv_backend: Any, kv_reference: Any, golden: Any, name: str) -> None:
    """The backend's full KVPlan equals the reference's golden (same file for every backend)."""
    assert_plan_matches_golden(kv_backend, kv_reference, golden, GOLDENS[name]())
