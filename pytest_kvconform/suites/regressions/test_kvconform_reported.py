"""Reported scenarios as snapshot regressions: bugs reported against vLLM backends, pinned.

Each regression is a scenario (``pytest_kvconform/scenarios/regressions/*.toml`` or a packaged
one), a golden of the reference's full ``KVPlan`` for it (``__snapshots__/``, JSON) and tests on
the rule methods involved. Every test calls the *selected backend* (``--kvconform-backend``), so
one golden serves every backend; the goldens are written from the reference with
``pytest pytest_kvconform/suites/regressions --snapshot-update`` (default backend) and a plain run fails on a
changed or unused golden. A golden is the plan under the judged release's rules: vLLM 0.27 and 0.28
(no ``null_block_reserved``) read theirs from ``__snapshots_before_null_block_reserved__/``, written
with ``--kvconform-vllm=0.28 --snapshot-update`` (``conftest.py``); numbers that a release changes
are asserted per release, each branch tied to its ``reference.releases.CHANGES`` entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pytest_kvconform.conformance import Declined, call_rule, outcome
from pytest_kvconform.reference.hybrid import align_hybrid_block_size
from pytest_kvconform.reference.layers import layer_specs
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


def unify(backend: Any, scenario: Scenario, specs: dict[str, Any], policy: str) -> tuple[str, Any]:
    """``unify_page_sizes`` on the backend under ``policy``: ``("ok", specs)`` or ``("rejects",
    kind)``; a backend with one fixed policy (``unify_policy``) declines the others."""
    fixed = getattr(backend, "unify_policy", None)
    if fixed and fixed != policy:
        raise Declined(
            f"[unification] backend {backend.name!r} always unifies with {fixed!r}, not {policy!r}"
        )
    return outcome(backend, "unify_page_sizes", specs, scenario=scenario.with_runtime(unify_policy=policy))


def unified(backend: Any, scenario: Scenario, specs: dict[str, Any], policy: str) -> Any:
    """:func:`unify`'s specs, where an answer is expected."""
    answer = unify(backend, scenario, specs, policy)
    assert answer[0] == "ok", f"unify_page_sizes({policy}) rejects: {answer[1]}"
    return answer[1]


# ----------------------------------------------------------------------------- 1. Granite bs400
GRANITE_BS400 = regression("granite-4.0-h-tiny-mlx-bs400")
#: 40 layers x 2400 tokens (cdiv(2048, 400) * 400) x 2048 B per token and layer (4 KV heads x 128 x 2 x 2 B)
GRANITE_ALIGNED = 196_608_000
#: the pre-#229 estimate: 40 layers x 2048 tokens x 2048 B
GRANITE_UNALIGNED = 167_772_160
#: vLLM 0.33.0 _check_enough_kv_cache_memory (vllm/v1/core/kv_cache_planning.py): the text after the numbers
ADMISSION_TAIL = (
    "Try increasing `gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or "
    "decreasing `max_model_len` when initializing the engine. See "
    "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)


@pytest.mark.kvconform_rule("one_sequence")
def test_metal229_granite_bs400_one_sequence_is_block_aligned(kv_backend: Any, kv_reference: Any) -> None:
    """vllm-metal#229: the MLX-path estimate must cover cdiv(L, bs) * bs tokens.

    Wrong formula: ``layers * max_model_len * bytes_per_token`` (2048 tokens, 167,772,160 B,
    "0.16 GiB"), while the scheduler reserves 2400 tokens (196,608,000 B, "0.18 GiB") at block 400.
    """
    s = GRANITE_BS400()
    got = one_sequence_bytes(kv_backend, kv_reference, s)
    assert got == GRANITE_ALIGNED
    plan = backend_plan(kv_backend, s)
    assert (plan.one_sequence_tokens, plan.one_sequence_bytes, plan.needed_bytes) == (2400, got, got)


@pytest.mark.kvconform_rule("memory")
def test_metal229_granite_bs400_old_estimate_fails_admission(kv_backend: Any, kv_reference: Any) -> None:
    """vllm-metal#229: reporting the unaligned estimate made start-up fail with vLLM's message.

    At the time (vLLM 0.27 and 0.28: no ``null_block_reserved``) the check saw the whole report:
    "(0.18 GiB KV cache is needed, ... available KV cache memory (0.16 GiB)" (167,772,160 B =
    0.15625 GiB, rounded half to even), where 5 whole blocks of 400 fit (estimate 2000). vLLM 0.29+
    also deducts the null block (one block of 40 layers x 400 tokens x 2048 B = 32,768,000 B):
    135,004,160 B, "0.13 GiB", where 4 whole blocks of 400 fit (estimate 1600).
    """
    s = GRANITE_BS400().with_runtime(kv_cache_memory_bytes=GRANITE_UNALIGNED)
    specs = kv_reference.layer_specs(s)
    got = call_rule(kv_backend, "check_memory", specs, scenario=s)
    assert (got.bytes_per_block, got.needed_bytes) == (32_768_000, GRANITE_ALIGNED)
    seen, gib, estimate = (
        (135_004_160, "0.13", 1600)  # 167,772,160 - 32,768,000
        if kv_reference.release.has("null_block_reserved")
        else (167_772_160, "0.16", 2000)
    )
    assert got.available_bytes == seen
    assert got.max_model_len_estimate == estimate
    assert got.admission == (
        "To serve at least one request with the model's max seq len (2048), (0.18 GiB KV cache is "
        f"needed, which is larger than the available KV cache memory ({gib} GiB). Based on the available "
        f"memory, the estimated maximum model length is {estimate}. {ADMISSION_TAIL}"
    )


@pytest.mark.kvconform_rule("memory")
@pytest.mark.parametrize("how", ["kv_cache_memory_bytes", "num_gpu_blocks_override"])
def test_metal229_granite_bs400_exact_report_fails_by_the_null_block(
    kv_backend: Any, kv_reference: Any, how: str
) -> None:
    """vLLM 0.33 notes section 17 x vllm-metal#229: even the fixed, exact one-sequence report
    fails, because the check sees ``available - bytes_per_block`` (the null block): one block short.

    vLLM 0.27 and 0.28 (no ``null_block_reserved``) see all 6 blocks (196,608,000 B, exactly the
    need): admitted, estimate 2048 (the request then waits for a 6th usable block: vllm-metal#513).
    """
    change = {"kv_cache_memory_bytes": GRANITE_ALIGNED} if how == "kv_cache_memory_bytes" else {
        "num_gpu_blocks_override": 6, "kv_cache_memory_bytes": 1 << 40}  # fmt: skip
    s = GRANITE_BS400().with_runtime(**change)
    specs = kv_reference.layer_specs(s)
    got = call_rule(kv_backend, "check_memory", specs, scenario=s)
    if not kv_reference.release.has("null_block_reserved"):  # vLLM 0.27, 0.28: all 6 blocks
        whole = (6, GRANITE_ALIGNED, GRANITE_ALIGNED)
        assert (got.num_blocks, got.needed_bytes, got.available_bytes) == whole
        assert (got.max_model_len_estimate, got.admission) == (2048, "ok")
        return
    assert (got.num_blocks, got.needed_bytes, got.available_bytes) == (6, GRANITE_ALIGNED, 163_840_000)
    assert got.max_model_len_estimate == 2000
    assert got.admission == (
        "To serve at least one request with the model's max seq len (2048), (0.18 GiB KV cache is "
        "needed, which is larger than the available KV cache memory (0.15 GiB). Based on the available "
        f"memory, the estimated maximum model length is 2000. {ADMISSION_TAIL}"
    )


@pytest.mark.kvconform_rule("one_sequence")
def test_metal229_granite_default_block_16_never_shows_it(kv_backend: Any, kv_reference: Any) -> None:
    """vllm-metal#229: at the default block 16, 2048 tokens are already block-aligned, so the
    aligned and the unaligned estimates agree with vLLM's need (the bug needs a large block)."""
    s = GRANITE_BS400().with_runtime(block_size=16, user_specified_block_size=False)
    got = one_sequence_bytes(kv_backend, kv_reference, s)
    plan = backend_plan(kv_backend, s)
    assert got == plan.needed_bytes == GRANITE_UNALIGNED
    assert plan.one_sequence_tokens == 2048


# ----------------------------------------------------------------------------- 2. Qwen3.5 bs160
QWEN35_BS160 = regression("qwen3.5-bs160-reviewer")
QWEN35_08B = regression("qwen3.5-0.8b")
QWEN35_08B_BF16 = regression("qwen3.5-0.8b", mamba_ssm_cache_dtype="bfloat16")


@pytest.mark.kvconform_rule("hybrid_alignment")
@pytest.mark.parametrize(("alignment", "block", "padding"), [(32, 160, "19.40"), (16, 144, "7.46")])
def test_metal230_qwen35_reviewer_block(kv_backend: Any, alignment: int, block: int, padding: str) -> None:
    """vllm-metal#230: Mamba page 548,864 B, attention 4,096 B/token -> block 160 at alignment 32
    (vllm-metal before #262; minimum 134, Mamba padded by 19.40 %), 144 at alignment 16.

    Wrong formula: no hybrid alignment at all (block 16, unpadded state).
    """
    s = QWEN35_BS160().with_runtime(kernel_block_alignment=alignment)
    got = call_rule(kv_backend, "align_hybrid_block_size", scenario=s)
    assert (got.state_page_bytes, got.attn_page_bytes_per_token) == (548_864, 4096)
    assert (got.block_size, got.page_size_bytes) == (block, block * 4096)
    assert got.state_page_padded_bytes == block * 4096
    assert got.min_block_size == 134.0
    assert f"{got.padding_pct:.2f}" == padding


@pytest.mark.kvconform_rule("unification")
def test_metal230_qwen35_unaligned_pages_cannot_unify_by_scaling(kv_backend: Any) -> None:
    """vllm-metal#230: without the alignment, block 16 gives a 65,536 B attention page that does
    not divide the 548,864 B state page; block scaling (vLLM then) raised this exact error."""
    s = QWEN35_BS160()
    specs = layer_specs(s, None)
    assert unify(kv_backend, s, specs, "scale-only") == ("rejects", "pages_not_unifiable")


@pytest.mark.kvconform_rule("kernel_block")
def test_metal235_block_160_runs_as_5_kernel_blocks_of_32(kv_backend: Any) -> None:
    """vllm-metal#235: the Metal kernel has block sizes {8, 16, 32} only; 160 is not one of them,
    so the logical block must be translated: 5 kernel blocks of 32, block table expanded.

    Wrong formula: dispatch the kernel with the vLLM block size (``kernel_block_size(160) == 160``).
    """
    kernels = [call_rule(kv_backend, "kernel_block_size", b) for b in (8, 16, 32, 160)]
    assert kernels == [8, 16, 32, 32]  # the kernel's own sizes as they are; 160 as the largest dividing it
    table, kernel = call_rule(kv_backend, "build_block_tables", [[0, 2], [1]], 160)
    assert kernel == 32
    assert [list(map(int, r)) for r in table] == [
        [0, 1, 2, 3, 4, 10, 11, 12, 13, 14],
        [5, 6, 7, 8, 9, 0, 1, 2, 3, 4],  # the zero padding block is expanded too
    ]
    plan = backend_plan(kv_backend, QWEN35_BS160())
    assert (plan.block_size, plan.kernel_block_size, plan.kernel_blocks_per_block) == (160, 32, 5)


@pytest.mark.kvconform_rule("plan")
@pytest.mark.parametrize(
    ("loader", "block", "kernel"),
    [(QWEN35_08B, 544, (32, 17)), (QWEN35_08B_BF16, 288, (32, 9))],
    ids=["fp32-state", "bf16-state"],
)
def test_metal235_qwen35_08b_today(kv_backend: Any, loader: Any, block: int, kernel: tuple[int, int]) -> None:
    """vllm-metal#230/#235 on the real Qwen3.5-0.8B under today's rules: block 544 with the fp32
    recurrent state (vllm-metal forces it, #579), 288 with bf16; translated to 17 (or 9) x 32."""
    plan = backend_plan(kv_backend, loader())
    assert plan.block_size == block
    assert (plan.kernel_block_size, plan.kernel_blocks_per_block) == kernel


# ----------------------------------------------------------------------------- 3. GLM fp8_ds_mla
GLM5 = regression("glm-5-fp8-ds-mla")
MLA_MAMBA = regression("glm-mla-mamba-fp8-ds-mla-probe")


@pytest.mark.kvconform_rule("attention_page")
def test_glm5_fp8_ds_mla_pages(kv_backend: Any, kv_reference: Any) -> None:
    """GLM-5 with fp8_ds_mla: 656 B per token per layer (512 fp8 + 16 B scales + 64 x 2 B rope),
    never 576 (dtype formula), 1152 (bf16) or doubled (K+V factor); plus the DSA indexer's
    128 + 4 = 132 B/token; 78 layers x 64 tokens x 788 B = 3,933,696 B per block."""
    s = GLM5()
    specs = list(dict.fromkeys(kv_reference.layer_specs(s).values()))
    kv = [x for x in specs if isinstance(x, AttentionSpec) and x.cache_role == "kv"]
    indexer = [x for x in specs if isinstance(x, AttentionSpec) and x.cache_role == "indexer"]
    assert len(kv) == len(indexer) == 1
    page = call_rule(kv_backend, "attention_page_bytes", kv[0], scenario=s)
    assert page == 64 * 656
    assert page not in (64 * 576, 64 * 1152, 2 * 64 * 656)
    assert call_rule(kv_backend, "attention_page_bytes", indexer[0], scenario=s) == 64 * 132
    plan = backend_plan(kv_backend, s)
    assert (plan.attn_bytes_per_token_per_layer, plan.indexer_bytes_per_token_per_layer) == (656, 132)
    assert plan.bytes_per_block == 78 * 64 * (656 + 132)  # 3,933,696


@pytest.mark.kvconform_rule("hybrid_alignment")
def test_vllm_b2_mla_hybrid_block_uses_the_packed_page(kv_backend: Any, kv_reference: Any) -> None:
    """A known vLLM bug in Platform._align_hybrid_block_size (vllm/platforms/interface.py,
    0.32/0.33): the hybrid planner prices fp8_ds_mla MLA at 576 B/token. For an MLA + Mamba
    hybrid (state 806,400 B, MLA floor 128) that picks block 1408 (page 811,008 B); the
    656 B/token the layer really stores needs block 1280 (page 839,680 B).

    Wrong formula: ``attn_page_bytes_per_token = kv_lora_rank + qk_rope_head_dim`` (576).

    Derived: 128 * cdiv(806,400, 128 * 656) = 128 * 10 = 1280 (page 1280 x 656 = 839,680 B); the
    planner's 576 B/token is what plain fp8 MLA costs ((512 + 64) x 1 B), for which
    128 * cdiv(806,400, 128 * 576) = 128 * 11 = 1408 (page 1408 x 576 = 811,008 B) is right.

    vLLM 0.23 ... 0.26 (no ``mla_hybrid_block_floor``) align to k = 16: 16 * cdiv(806,400, 16 * 656)
    = 16 * 77 = 1232 (page 808,192 B); at 576 B/token 16 * cdiv(806,400, 9,216) = 16 * 88 = 1408.
    """
    s = MLA_MAMBA()
    got = call_rule(kv_backend, "align_hybrid_block_size", scenario=s)
    block, page = (1280, 839_680) if kv_reference.release.has("mla_hybrid_block_floor") else (1232, 808_192)
    assert (got.attn_page_bytes_per_token, got.block_size) == (656, block)
    assert got.state_page_padded_bytes == page
    fp8 = call_rule(kv_backend, "align_hybrid_block_size", scenario=s.with_runtime(kv_cache_dtype="fp8"))
    assert (fp8.attn_page_bytes_per_token, fp8.block_size, fp8.page_size_bytes) == (576, 1408, 811_008)


@pytest.mark.kvconform_rule("unification")
def test_vllm_b2_planner_block_makes_unify_repad_mamba(kv_backend: Any, kv_reference: Any) -> None:
    """The same vLLM bug: at the planner's block 1408 the real MLA page is 1408 x 656 = 923,648 B,
    above the Mamba page padded to 811,008 B, so unify quietly re-pads Mamba to 923,648 B (14.54 %
    over the 806,400 B state instead of 4.13 % at block 1280).

    vLLM 0.23 ... 0.25 (no ``mamba_page_padding``) do not re-pad: 811,008 B does not divide
    923,648 B, so unification raises NotImplementedError."""
    s = MLA_MAMBA()
    planner = align_hybrid_block_size(576, 806_400, use_mla=True)
    specs = layer_specs(s, planner, release=kv_reference.release)
    assert {x.page_size_bytes for x in specs.values()} == {923_648, 811_008}
    if not kv_reference.release.has("mamba_page_padding"):  # vLLM 0.23 ... 0.25
        answer = outcome(kv_backend, "unify_page_sizes", specs, scenario=s)
        assert answer == ("rejects", "pages_not_unifiable")
        return
    out = unified(kv_backend, s, specs, "pad-to-max")
    mla = [x for x in out.values() if isinstance(x, AttentionSpec)]
    state = [x for x in out.values() if isinstance(x, MambaSpec)]
    assert {(x.block_size, x.page_size_bytes) for x in mla} == {(1408, 923_648)}
    assert {x.page_size_bytes for x in state} == {923_648}
    # the padding over the 806,400 B state: (923,648 - 806,400) / 806,400 = 14.54 %
    assert {f"{100 * (x.page_size_bytes / x.real_page_size_bytes - 1):.2f}" for x in state} == {"14.54"}


# ----------------------------------------------------------------------------- 4. TurboQuant LCM
TQ_LCM = regression("turboquant-lcm-probe")


@pytest.mark.kvconform_rule("unification")
@pytest.mark.parametrize("policy", ["lcm", "pad-to-max", "scale-only"])
def test_vllm40128_turboquant_lcm_policies(kv_backend: Any, kv_reference: Any, policy: str) -> None:
    """vllm#39931 / vllm#40128: a 776 B one-token attention page (head 194, 1 KV head, bf16) vs a
    12,648,448 B Mamba state (3,162,112 fp32 elements).

    * lcm (#40128, closed unmerged): target 776 x 16,300 = 12,648,800 B, attention block 16,300,
      Mamba padded by 0.0028 %;
    * pad-to-max (vLLM 0.33): the attention page is padded to the whole state page at block 1;
    * scale-only (vLLM before #45181): NotImplementedError with vLLM's exact text. vLLM 0.23's own
      unification (no ``attention_page_padding``) is scale-only: pad-to-max there raises the same.
    """
    specs = kv_reference.layer_specs(TQ_LCM())
    attn, state = "layer_specs.0.0", "layer_specs.1.0"
    assert (specs[attn].page_size_bytes, specs[state].page_size_bytes) == (776, 12_648_448)
    if policy == "scale-only" or (
        policy == "pad-to-max" and not kv_reference.release.has("attention_page_padding")
    ):
        assert unify(kv_backend, TQ_LCM(), specs, policy) == ("rejects", "pages_not_unifiable")
    elif policy == "lcm":
        out = unified(kv_backend, TQ_LCM(), specs, policy)
        assert (out[attn].block_size, out[attn].page_size_bytes) == (16_300, 12_648_800)
        assert out[state].page_size_bytes == 12_648_800
    else:
        out = unified(kv_backend, TQ_LCM(), specs, policy)
        assert (out[attn].block_size, out[attn].page_size_bytes) == (1, 12_648_448)
        assert out[state].page_size_bytes == 12_648_448


@pytest.mark.kvconform_rule("plan")
def test_vllm40128_turboquant_lcm_plan(kv_backend: Any) -> None:
    """vllm#40128 under the lcm policy: block 16,300, page 12,648,800 B, state padding 0.0028 %."""
    plan = backend_plan(kv_backend, TQ_LCM())
    assert (plan.unify_policy, plan.block_size, plan.page_size_bytes) == ("lcm", 16_300, 12_648_800)
    assert plan.state_padding_pct == 0.0028


@pytest.mark.kvconform_rule("plan")
def test_vllm39931_qwen36_turboquant_k8v4_real_run(kv_backend: Any) -> None:
    """vllm#39931: Qwen3.6-35B-A3B with turboquant_k8v4 (388 B per head, 776 B/token) logs
    "Setting attention block size to 2768 tokens" and "Padding mamba page size by 0.08%"."""
    plan = backend_plan(kv_backend, regression("qwen3.6-35b-a3b-turboquant-k8v4")())
    assert (plan.attn_bytes_per_token_per_layer, plan.block_size) == (776, 2768)
    assert (plan.state_bytes_per_layer, plan.page_size_bytes) == (2_146_304, 2_147_968)
    assert f"{plan.state_padding_pct:.2f}" == "0.08"


KIMI_B2 = regression("kimi-linear-mla-kda-fp8-ds-mla-probe")


@pytest.mark.kvconform_rule("hybrid_alignment")
def test_vllm_b2_kimi_linear_block_uses_the_packed_page(kv_backend: Any, kv_reference: Any) -> None:
    """The same vLLM bug on a real MLA + state architecture (KimiLinear: MLA + KDA), so the
    vllm backend runs vLLM's own ``_align_hybrid_block_size`` on it.

    Wrong formula: pricing fp8_ds_mla at 576 B/token (no ``state_content_bytes``) gives block
    128 * cdiv(2,170,880, 128 * 576) = 3840 and a state page padded to 2,211,840 B, below the real
    3840 * 656 B attention page. Right: 656 B/token -> 128 * cdiv(2,170,880, 83,968) = 3328 tokens,
    page 2,183,168 B. The KDA state is notes e4's: (3, 12288) bf16 + (32, 128, 128) fp32.

    vLLM 0.23 ... 0.26 (no ``mla_hybrid_block_floor``): 16 * cdiv(2,170,880, 16 * 656) = 16 * 207 =
    3312 tokens, page 2,172,672 B.
    """
    s = KIMI_B2()
    got = call_rule(kv_backend, "align_hybrid_block_size", scenario=s)
    assert (got.attn_page_bytes_per_token, got.state_page_bytes) == (656, 2_170_880)
    floor = kv_reference.release.has("mla_hybrid_block_floor")
    assert (got.block_size, got.state_page_padded_bytes) == (
        (3328, 2_183_168) if floor else (3312, 2_172_672)
    )


# ----------------------------------------------------------------------------- goldens
#: id (source and name) -> scenario loader; ``test_plan_golden[<id>]`` snapshots its KVPlan.
GOLDENS: dict[str, Callable[[], Scenario]] = {
    "vllm-metal-229-granite-bs400": GRANITE_BS400,
    "vllm-metal-229-granite-bs16": regression(
        "granite-4.0-h-tiny-mlx-bs400", block_size=16, user_specified_block_size=False
    ),
    "vllm-metal-230-qwen35-bs160": QWEN35_BS160,
    "vllm-metal-235-qwen35-08b-fp32-state": QWEN35_08B,
    "vllm-metal-235-qwen35-08b-bf16-state": QWEN35_08B_BF16,
    "glm5-fp8-ds-mla": GLM5,
    "vllm-b2-mla-mamba-fp8-ds-mla": MLA_MAMBA,
    "vllm-b2-kimi-linear-mla-kda-fp8-ds-mla": KIMI_B2,
    "vllm-40128-turboquant-lcm": TQ_LCM,
    "vllm-40128-turboquant-pad-to-max": regression("turboquant-lcm-probe", unify_policy="pad-to-max"),
    "vllm-39931-qwen36-turboquant-k8v4": regression("qwen3.6-35b-a3b-turboquant-k8v4"),
}


@pytest.mark.kvconform_rule("plan")
@pytest.mark.parametrize("name", list(GOLDENS))
def test_plan_golden(kv_backend: Any, kv_reference: Any, golden: Any, name: str) -> None:
    """The backend's full KVPlan equals the reference's golden (same file for every backend)."""
    assert_plan_matches_golden(kv_backend, kv_reference, golden, GOLDENS[name]())
