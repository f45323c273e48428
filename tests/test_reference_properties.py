"""Hypothesis properties of the reference over generated geometries and runtime settings.

Every example is a TOML-like dict turned into a :class:`Scenario` by ``scenario_from_dict``,
so a shrunk failure prints as a scenario file. The strategies only build scenarios the
reference is meant to plan: TP divides every state dimension, KDA never gets a float16
recurrent state, FlashInfer nvfp4 keeps ``head_dim_v == head_dim``, no ROCm ``octave_*``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pytest_kvconform import strategies
from pytest_kvconform.reference import plan
from pytest_kvconform.reference.grouping import get_kv_cache_groups
from pytest_kvconform.reference.hybrid import hybrid_alignment, skip_layers
from pytest_kvconform.reference.layers import layer_specs
from pytest_kvconform.reference.mamba import verify_mamba2_split
from pytest_kvconform.reference.memory import check_memory, estimate_max_model_len
from pytest_kvconform.reference.releases import RELEASES, rule_set
from pytest_kvconform.reference.selection import select_attention_backends
from pytest_kvconform.reference.specs import AttentionSpec, MambaSpec
from pytest_kvconform.reference.unify import SCALE_ONLY_ERROR, pad_to_max_error, unify_page_sizes
from pytest_kvconform.scenario import (
    KV_CACHE_DTYPES,
    SPEC_DTYPES,
    RuntimeSettings,
    Scenario,
    scenario_from_dict,
)

pytestmark = pytest.mark.filterwarnings("ignore")
PROPERTY_SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

GQA_KV_DTYPES = tuple(
    d for d in KV_CACHE_DTYPES if not d.startswith("octave_") and d not in ("fp8_ds_mla", "nvfp4_ds_mla")
)
MLA_KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla", "nvfp4_ds_mla", "int8_per_token_head",
                 "int4_per_token_head", "fp8_per_token_head")  # fmt: skip
TPS = (1, 2, 4)  # every state dimension below is a multiple of 4


@st.composite
def attention_tables(draw, kind: str, codes: str) -> dict[str, Any]:
    if kind == "gqa":
        table: dict[str, Any] = {
            "kind": "gqa",
            "num_kv_heads": draw(st.sampled_from([1, 2, 4, 8, 16])),
            "head_dim": draw(st.sampled_from([64, 80, 128, 192, 256])),
        }
    else:
        table = {
            "kind": "mla",
            "kv_lora_rank": draw(st.sampled_from([256, 512])),
            "qk_rope_head_dim": draw(st.sampled_from([32, 64])),
        }
        if draw(st.integers(0, 3)) == 0:
            table["indexer_head_dim"] = 128
    if "S" in codes:
        table["sliding_window"] = draw(st.integers(1, 8192))
    if "L" in codes:
        table["attention_chunk_size"] = draw(st.sampled_from([1024, 2048, 8192]))
    return table


@st.composite
def state_tables(draw, kind: str) -> dict[str, Any]:
    four = st.integers(1, 32).map(lambda x: 4 * x)
    table: dict[str, Any] = {"kind": kind, "conv_kernel": draw(st.integers(2, 4))}
    if kind == "mamba1":
        table |= {
            "intermediate_size": draw(four.map(lambda x: 64 * x)),
            "d_state": draw(st.sampled_from([16, 64])),
        }
    elif kind == "mamba2":
        table |= {
            "intermediate_size": draw(four.map(lambda x: 64 * x)),
            "n_groups": draw(st.sampled_from([1, 2, 4, 8])),
            "n_heads": draw(four),
            "head_dim": draw(st.sampled_from([32, 64])),
            "d_state": draw(st.sampled_from([64, 128])),
        }
    elif kind == "gdn":
        table |= {
            "num_key_heads": draw(st.integers(1, 16)),
            "num_value_heads": draw(four),
            "key_head_dim": draw(st.sampled_from([64, 128])),
            "value_head_dim": draw(st.sampled_from([64, 128])),
        }
    elif kind == "kda":
        table |= {"num_heads": draw(four), "head_dim": draw(st.sampled_from([64, 128]))}
    else:
        table |= {"conv_dim": draw(four.map(lambda x: 64 * x))}
    table["ssm_dtype"] = draw(
        st.sampled_from(["auto", "float32"] if kind == "kda" else ["auto", "float32", "bfloat16"])
    )
    return table


@st.composite
def runtime_tables(draw, *, state_kind: str | None, gqa: bool, nvfp4_ok: bool) -> dict[str, Any]:
    kba = draw(st.sampled_from([1, 8, 16, 32, 64]))
    kv_dtypes = GQA_KV_DTYPES if gqa else MLA_KV_DTYPES
    kv = draw(st.sampled_from([d for d in kv_dtypes if nvfp4_ok or not d.startswith("nvfp4")]))
    rt: dict[str, Any] = {
        "max_model_len": draw(st.integers(1, 262_144)),
        "tensor_parallel_size": draw(st.sampled_from(TPS)),
        "block_size": kba * draw(st.integers(1, 4)),
        "kernel_block_alignment": kba,
        "extra_block_alignment": draw(st.sampled_from([1, 1, 64])),
        "kv_cache_dtype": kv,
        "mamba_cache_mode": draw(st.sampled_from(["none", "align"])),
        "num_speculative_tokens": draw(st.integers(0, 3)),
        "kv_cache_memory_bytes": draw(st.integers(1, 64 << 30)),
        "max_num_batched_tokens": draw(st.integers(1, 16_384)),
        "max_concurrent_batches": draw(st.integers(1, 3)),
        "unify_policy": draw(st.sampled_from(["pad-to-max", "scale-only", "lcm"])),
    }
    if draw(st.booleans()):
        rt["num_gpu_blocks_override"] = draw(st.integers(1, 100_000))
    if state_kind is not None:
        rt["mamba_cache_dtype"] = draw(st.sampled_from(["auto", "float16", "bfloat16", "float32"]))
        ssm = (
            ["auto", "float32", "bfloat16"]
            if state_kind == "kda"
            else ["auto", "float16", "bfloat16", "float32"]
        )
        rt["mamba_ssm_cache_dtype"] = draw(st.sampled_from(ssm))
    return rt


@st.composite
def model_scenario_dicts(draw, hybrid: bool = False) -> dict[str, Any]:
    """Model-level scenarios; ``hybrid=True`` forces at least one attention and one state layer."""
    attn_kind = draw(st.sampled_from(["gqa", "mla"]))
    state_kinds = ["mamba1", "mamba2", "gdn", "kda", "short_conv"]
    state_kind = draw(st.sampled_from(state_kinds if hybrid else [None, *state_kinds]))
    n = draw(st.integers(2 if hybrid else 1, 40))
    pure_state = state_kind is not None and not hybrid and draw(st.integers(0, 5)) == 0
    if pure_state:  # a pure Mamba/GDN stack: no [model.attention] at all
        layers = list(draw(st.text(alphabet="MMM-", min_size=n, max_size=n)))
        if "M" not in layers:
            layers[draw(st.integers(0, n - 1))] = "M"
    else:
        alphabet = "AAASXL-" + ("MMMMP" if state_kind else "")
        layers = list(draw(st.text(alphabet=alphabet, min_size=n, max_size=n)))
        if not any(c in "ASLXP" for c in layers):
            layers[draw(st.integers(0, n - 1))] = "A"
        if hybrid and not any(c in "MP" for c in layers):
            i = draw(st.integers(0, n - 1))
            layers[i] = "M" if any(c in "ASLXP" for c in layers[:i] + layers[i + 1 :]) else "P"
    codes = "".join(layers)
    has_state = any(c in "MP" for c in codes)
    model: dict[str, Any] = {
        "architecture": "Generated",
        "dtype": draw(st.sampled_from(["bfloat16", "float16", "float32"])),
        "num_hidden_layers": n,
        "layers": codes,
    }
    nvfp4_ok = False
    if not pure_state:
        attention = draw(attention_tables(attn_kind, codes))
        if attn_kind == "gqa" and draw(st.integers(0, 4)) == 0:
            attention["head_dim_v"] = draw(st.sampled_from([64, 128]))
        model["attention"] = attention
        nvfp4_ok = (
            attn_kind == "gqa" and attention.get("head_dim_v", attention["head_dim"]) == attention["head_dim"]
        )
    if has_state:
        model["state"] = draw(state_tables(state_kind))
    runtime = draw(runtime_tables(state_kind=state_kind if has_state else None, gqa=attn_kind == "gqa",
                                  nvfp4_ok=nvfp4_ok))  # fmt: skip
    return {"schema": "kv-scenario/1", "name": "generated-model", "model": model, "runtime": runtime}


@st.composite
def layer_spec_tables(draw) -> dict[str, Any]:
    kinds = ["full_attention", "sliding_window", "chunked_local", "cross_attention", "mla", "mamba"]
    kind = draw(st.sampled_from(kinds))
    table: dict[str, Any] = {"kind": kind, "count": draw(st.integers(1, 6)),
                             "block_size": draw(st.sampled_from([1, 16, 32, 64, 128, 400]))}  # fmt: skip
    if kind == "mamba":
        shapes = draw(st.lists(st.lists(st.integers(1, 256), min_size=1, max_size=3), min_size=1, max_size=2))
        table |= {"shapes": shapes, "dtypes": [draw(st.sampled_from(sorted(SPEC_DTYPES))) for _ in shapes]}
        if draw(st.booleans()):
            table["num_speculative_blocks"] = draw(st.integers(0, 2))
        return table
    table |= {
        "num_kv_heads": 1 if kind == "mla" else draw(st.integers(1, 8)),
        "head_size": draw(st.sampled_from([64, 128, 194, 256, 576])),
        "dtype": draw(st.sampled_from(sorted(SPEC_DTYPES))),
    }
    if draw(st.integers(0, 4)) == 0:
        table["state_content_bytes"] = draw(st.integers(1, 1024))
    if kind == "sliding_window":
        table["sliding_window"] = draw(st.integers(1, 8192))
    if kind == "chunked_local":
        table["attention_chunk_size"] = draw(st.sampled_from([1024, 8192]))
    return table


@st.composite
def spec_scenario_dicts(draw) -> dict[str, Any]:
    specs = draw(st.lists(layer_spec_tables(), min_size=1, max_size=4))
    runtime = {
        "max_model_len": draw(st.integers(1, 131_072)),
        "kv_cache_memory_bytes": draw(st.integers(1, 64 << 30)),
        "max_num_batched_tokens": draw(st.integers(1, 8192)),
        "mamba_cache_mode": draw(st.sampled_from(["none", "align"])),
        "unify_policy": draw(st.sampled_from(["pad-to-max", "scale-only", "lcm"])),
    }
    return {"schema": "kv-scenario/1", "name": "generated-specs", "layer_specs": specs, "runtime": runtime}


scenario_dicts = st.one_of(model_scenario_dicts(), spec_scenario_dicts())


def load(d: dict[str, Any]) -> Scenario:
    """The generated scenario; one the engine refuses while building the model (a Mamba2 layer
    whose heads or groups the TP size does not split, a TurboQuant layer with a sliding window, a
    float32 model, ...) is no example of the sizing rules."""
    s = scenario_from_dict(d, "<hypothesis>")
    try:
        verify_mamba2_split(s)
        select_attention_backends(s)
    except (ValueError, AssertionError):
        assume(False)
    return s


def specs_of(s: Scenario) -> dict:
    return layer_specs(s, hybrid_alignment(s))


def groups_or_reject(s: Scenario):
    """The groups plan() uses; a documented unification refusal is rejected as an example."""
    try:
        return get_kv_cache_groups(specs_of(s), s.runtime.unify_policy)
    except NotImplementedError:
        assume(False)
    except AssertionError:  # scale-only cannot grow a smaller Mamba page (vllm PR #45207)
        assume(s.runtime.unify_policy != "scale-only")
        # vLLM's own refusal too: unify scales a sliding-window page padded to Phase 3's shared
        # page (skip_page_size_padded) past that padding (AttentionSpec.page_size_bytes asserts)
        assume(not _phase3_padded_windows(specs_of(s)))
        raise


def _phase3_padded_windows(specs: dict) -> bool:
    """Sliding-window pages padded to Phase 3's shared page (``skip_page_size_padded``)."""
    return any(getattr(x, "page_size_padded", None) and x.kind == "sliding_window" for x in specs.values())


# --------------------------------------------------------------------------- the strategy itself


@PROPERTY_SETTINGS
@given(scenario_dicts)
def test_generated_dicts_are_valid_scenarios(d):
    s = load(d)
    assert s.is_spec_level == ("layer_specs" in d)
    assert specs_of(s)  # every generated scenario has at least one cache layer


# --------------------------------------------------------------------------- unification


@PROPERTY_SETTINGS
@given(scenario_dicts)
def test_unified_pages_are_equal_and_padded_covers_real(d):
    s = load(d)
    try:
        specs = specs_of(s)
    except AssertionError:  # vLLM's SlidingWindowSpec asserts too: Phase 3 prices 2 * head_size per
        # head, so a window layer with a larger head_size_v overflows the shared page
        assume(not (s.model is not None and "S" in s.model.layers and skip_layers(s)))
        raise
    for spec in specs.values():
        assert spec.page_size_bytes >= spec.real_page_size_bytes
    for policy in ("pad-to-max", "lcm", "scale-only"):
        try:
            out = unify_page_sizes(specs, policy)
        except NotImplementedError as exc:
            msg = str(exc)
            if policy == "scale-only":
                assert msg == SCALE_ONLY_ERROR
            else:
                # only an MLA layer may refuse padding (vLLM 0.33 unify_kv_cache_spec_page_size)
                name = next(n for n in specs if msg == pad_to_max_error(n))
                assert specs[name].kind == "mla"
            continue
        except AssertionError:
            if _phase3_padded_windows(specs):
                # vLLM's refusal too (groups_or_reject): block scaling outgrows the padded window
                # page; scale-only (vLLM 0.23) never meets one: Phase 3 came in 0.25
                continue
            assert policy == "scale-only"
            assert any(isinstance(s, MambaSpec) for s in specs.values())
            continue
        assert list(out) == list(specs)
        pages = {s.page_size_bytes for s in out.values()}
        assert len(pages) == 1
        (target,) = pages
        assert target >= max(s.page_size_bytes for s in specs.values())
        if policy == "pad-to-max":
            assert target == max(s.page_size_bytes for s in specs.values())
        for name, spec in out.items():
            assert spec.page_size_bytes >= spec.real_page_size_bytes
            old = specs[name]
            if isinstance(spec, AttentionSpec) and spec.is_mla:
                assert spec.page_size_padded == old.page_size_padded  # MLA is never padded
            if policy == "scale-only":
                assert spec.page_size_padded == old.page_size_padded  # scale-only never pads
            if spec.block_size != old.block_size:  # scaling keeps the bytes per token
                assert spec.block_size % old.block_size == 0


# --------------------------------------------------------------------------- hybrid alignment


@PROPERTY_SETTINGS
@given(st.one_of(model_scenario_dicts(hybrid=True), model_scenario_dicts()))
def test_aligned_attention_page_covers_state_minimally(d):
    s = load(d)
    a = hybrid_alignment(s)
    assert (a is not None) == s.model.is_hybrid
    if a is None:
        return
    rt = s.runtime
    # vLLM 0.33.0 Platform._align_hybrid_block_size: k = max(kernel, block_size), >= 128 for MLA, lcm'd
    # with the checkpoint alignment in align mode; the strategy keeps block_size a multiple of the kernel
    # alignment (Phase 1's result)
    unit = max(rt.kernel_block_alignment, rt.block_size, 128 if s.model.use_mla else 1)
    unit = math.lcm(unit, rt.extra_block_alignment if rt.mamba_cache_mode == "align" else 1)
    assert a.page_size_bytes == a.block_size * a.attn_page_bytes_per_token
    assert a.block_size >= rt.block_size
    assert a.block_size % unit == 0
    assert a.page_size_bytes >= a.state_page_bytes
    assert (a.block_size - unit) * a.attn_page_bytes_per_token < a.state_page_bytes
    assert (a.state_page_padded_bytes is None) == (a.page_size_bytes == a.state_page_bytes)
    # the specs carry it: every KV attention layer takes the block, every state layer the page
    for spec in specs_of(s).values():
        if isinstance(spec, MambaSpec):
            assert spec.page_size_bytes == a.page_size_bytes
            assert spec.real_page_size_bytes == a.state_page_bytes
        elif spec.cache_role == "kv":
            assert spec.block_size == a.block_size
            assert spec.page_size_bytes == a.page_size_bytes


# --------------------------------------------------------------------------- the pool
# The budget, the null block and the need are derived here from vLLM's code, not taken from
# reference/memory.py (whose check_memory these properties test).


def null_block_reserved(release: str) -> bool:
    """vllm#47272 / vllm#48724, first in vLLM 0.29: block 0 is the null block (BlockPool), so the
    admission check and the estimate see ``available - bytes_per_block``; before, all of it."""
    major, minor = map(int, release.split("."))
    return (major, minor) >= (0, 29)


def pool_budget(groups, rt: RuntimeSettings) -> tuple[int, int]:
    """(bytes one block id costs, the pool's budget). vLLM 0.33.0 _get_kv_cache_bytes_per_block
    (layer-outer layout): a group's block holds one page per layer, the largest group sets it;
    get_kv_cache_configs: the budget is kv_cache_memory_bytes, or num_gpu_blocks_override blocks."""
    bpb = max(sum(spec.page_size_bytes for spec in g.specs) for g in groups)
    override = rt.num_gpu_blocks_override
    return bpb, override * bpb if override is not None else rt.kv_cache_memory_bytes


def admission_bytes(groups, rt: RuntimeSettings, null_block: bool = True) -> int:
    """What _check_enough_kv_cache_memory compares the need with."""
    bpb, budget = pool_budget(groups, rt)
    return budget - bpb if null_block else budget


def assert_blocks_fit_the_budget(groups, rt: RuntimeSettings, mem, null_block: bool = True) -> None:
    bpb, budget = pool_budget(groups, rt)
    assert mem.bytes_per_block == bpb
    assert mem.available_bytes == admission_bytes(groups, rt, null_block)
    if mem.available_bytes <= 0:  # get_kv_cache_configs raises "No available memory": no pool at all
        assert mem.num_blocks == 0 and mem.admission.startswith("No available memory for the cache blocks")
        return
    assert mem.num_blocks == budget // bpb  # get_kv_cache_configs: the null block is one of them
    if rt.num_gpu_blocks_override is not None:
        assert mem.num_blocks == rt.num_gpu_blocks_override


def assert_estimate_is_the_longest_length_that_fits(groups, rt: RuntimeSettings, mem) -> None:
    est, check = mem.max_model_len_estimate, admission_bytes(groups, rt)
    bpb, _ = pool_budget(groups, rt)

    def needed(length: int) -> int:
        """_max_memory_usage_bytes_from_groups: bytes per block id x the blocks of every group."""
        at = dataclasses.replace(rt, max_model_len=length)
        return bpb * sum(g.blocks_per_request(at) for g in groups)

    assert mem.needed_bytes == needed(rt.max_model_len)
    assert 0 <= est <= rt.max_model_len
    if est > 0:
        assert needed(est) <= check
    else:
        assert check <= 0 or needed(1) > check
    if est < rt.max_model_len:
        assert needed(est + 1) > check
    assert (mem.admission == "ok") == (check > 0 and needed(rt.max_model_len) <= check)
    if mem.admission == "ok":
        assert est == rt.max_model_len


@PROPERTY_SETTINGS
@given(scenario_dicts, st.sampled_from(RELEASES))
def test_num_blocks_fit_the_budget(d, release):
    s = load(d)
    groups = groups_or_reject(s)
    reserved = rule_set(release).has("null_block_reserved")
    assert reserved == null_block_reserved(release)
    mem = check_memory(groups, s.runtime, reserve_null_block=reserved)
    assert_blocks_fit_the_budget(groups, s.runtime, mem, null_block=null_block_reserved(release))


@PROPERTY_SETTINGS
@given(scenario_dicts)
def test_estimate_is_the_longest_length_that_fits(d):
    s = load(d)
    groups = groups_or_reject(s)
    assert_estimate_is_the_longest_length_that_fits(groups, s.runtime, check_memory(groups, s.runtime))


def llama_1gib(**runtime: Any) -> tuple[list, RuntimeSettings]:
    """32 layers x 8 KV heads x 128, bf16, L 8192, 1 GiB: 2 MiB per block id, 512 blocks, the need
    is exactly 1 GiB, so the null block decides admission (estimate 8176 = 511 blocks x 16)."""
    s = scenario_from_dict({
        "schema": "kv-scenario/1", "name": "llama-like",
        "model": {"architecture": "LlamaForCausalLM", "dtype": "bfloat16", "num_hidden_layers": 32,
                  "layers": "A" * 32, "attention": {"kind": "gqa", "num_kv_heads": 8, "head_dim": 128}},
        "runtime": {"max_model_len": 8192, "kv_cache_memory_bytes": 1 << 30, **runtime},
    }, "<llama-like>")  # fmt: skip
    return groups_or_reject(s), s.runtime


def test_the_pool_properties_hold_on_the_worked_example():
    groups, rt = llama_1gib()
    mem = check_memory(groups, rt)
    assert (mem.bytes_per_block, mem.num_blocks, mem.max_model_len_estimate) == (2 << 20, 512, 8176)
    assert_blocks_fit_the_budget(groups, rt, mem)
    assert_estimate_is_the_longest_length_that_fits(groups, rt, mem)


@pytest.mark.parametrize(
    ("runtime", "wrong"),
    [
        # the pool seen whole: no null block (vLLM before 0.29), 2 MiB too much to admit
        ({}, lambda groups, rt: check_memory(groups, rt, reserve_null_block=False)),
        # --num-gpu-blocks-override 100 ignored (vllm-metal#527): 512 blocks from memory
        ({"num_gpu_blocks_override": 100},
         lambda groups, rt: check_memory(groups, dataclasses.replace(rt, num_gpu_blocks_override=None))),
    ],
    ids=["no-null-block", "override-ignored"],
)  # fmt: skip
def test_the_budget_property_catches_a_wrong_budget(runtime, wrong):
    groups, rt = llama_1gib(**runtime)
    with pytest.raises(AssertionError):
        assert_blocks_fit_the_budget(groups, rt, wrong(groups, rt))


def test_the_budget_property_catches_a_wrong_available_kv_bytes(monkeypatch):
    """The budget used to come from ``available_kv_bytes``, which ``check_memory`` itself calls: a
    wrong one (the override ignored) passed. Derived independently, it is caught."""
    from pytest_kvconform.reference import memory

    groups, rt = llama_1gib(num_gpu_blocks_override=100)
    monkeypatch.setattr(memory, "available_kv_bytes", lambda groups, rt: rt.kv_cache_memory_bytes)
    with pytest.raises(AssertionError):
        assert_blocks_fit_the_budget(groups, rt, memory.check_memory(groups, rt))


@pytest.mark.parametrize(
    "wrong",
    [
        # the estimate over the whole pool (vllm-metal#513): 8192, which does not fit 1 GiB - 2 MiB
        lambda groups, rt: check_memory(
            groups, rt, lambda available: estimate_max_model_len(groups, rt, available + (2 << 20))
        ),
        # the null block left out of the check: admission and estimate read the wrong bytes
        lambda groups, rt: check_memory(groups, rt, reserve_null_block=False),
    ],
    ids=["estimate-over-the-whole-pool", "no-null-block"],
)
def test_the_estimate_property_catches_a_wrong_estimate(wrong):
    groups, rt = llama_1gib()
    with pytest.raises(AssertionError):
        assert_estimate_is_the_longest_length_that_fits(groups, rt, wrong(groups, rt))


@PROPERTY_SETTINGS
@given(scenario_dicts)
def test_plan_is_deterministic(d):
    s1, s2 = load(d), load(copy.deepcopy(d))
    try:
        p1 = plan(s1)
    except (NotImplementedError, AssertionError) as exc:
        assume(not isinstance(exc, NotImplementedError))
        assume(s1.runtime.unify_policy != "scale-only")
        # vLLM's own refusal, as in groups_or_reject: a Phase 3 padded window page scaled past it
        assume(not _phase3_padded_windows(specs_of(s1)))
        raise
    assert plan(s1) == p1
    assert plan(s2) == p1
    assert p1.to_dict() == plan(s2).to_dict()
    assert p1.num_blocks * p1.bytes_per_block <= (
        s1.runtime.num_gpu_blocks_override * p1.bytes_per_block
        if s1.runtime.num_gpu_blocks_override is not None
        else s1.runtime.kv_cache_memory_bytes
    )


def _full_layers_differ(attention: dict[str, Any]) -> bool:
    """The full layers' head size or KV heads differ from the sliding layers' (Gemma 4)."""
    return any(
        key in attention and attention[key] != attention[base]
        for key, base in (("global_head_dim", "head_dim"), ("num_global_kv_heads", "num_kv_heads"))
    )


def _packs_boundary(rt: dict[str, Any]) -> bool:
    """vLLM keeps a dense model's boundary layers native for these dtypes (EngineArgs)."""
    return rt["kv_cache_dtype"].startswith("turboquant_") or rt["kv_cache_dtype"] == "ultraquant_4bit"


#: Each rule :func:`strategies.exercised_rules` reports, as the raw scenario tables spell it (written
#: here from the rule's meaning, not from exercised_rules).
SPELLED = {
    "tensor parallel (TP > 1)": lambda m, rt: rt["tensor_parallel_size"] > 1,
    "replicated KV heads (KV heads < TP)": lambda m, rt: (
        m["attention"]["kind"] == "gqa" and m["attention"]["num_kv_heads"] < rt["tensor_parallel_size"]
    ),
    "Mamba2 extra groups (n_groups % TP != 0)": lambda m, rt: (
        m.get("state", {}).get("kind") == "mamba2"
        and m["state"]["n_groups"] % rt["tensor_parallel_size"] != 0
    ),
    "speculative tokens": lambda m, rt: rt["num_speculative_tokens"] > 0,
    "MTP drafter": lambda m, rt: (
        rt["num_speculative_tokens"] > 0 and m.get("num_nextn_predict_layers", 0) > 0
    ),
    "sliding window": lambda m, rt: "S" in m["layers"] and m["attention"].get("sliding_window", 0) > 0,
    "decode context parallel": lambda m, rt: rt.get("decode_context_parallel_size", 1) > 1,
    "--block-size given": lambda m, rt: "block_size" in rt,
    "hybrid state pages": lambda m, rt: "state" in m and "M" in m["layers"] and "A" in m["layers"],
    "MLA": lambda m, rt: m["attention"]["kind"] == "mla",
    "quantized KV cache": lambda m, rt: rt["kv_cache_dtype"] != "auto",
    "per-layer attention geometry": lambda m, rt: "A" in m["layers"] and _full_layers_differ(m["attention"]),
    "auto-fit max_model_len (-1)": lambda m, rt: rt["max_model_len"] == -1 and m["max_position_embeddings"],
    # method auto (the strategy's) with MTP modules in the checkpoint: the drafter's own layers
    "MTP draft layers (model-level)": lambda m, rt: (
        rt["num_speculative_tokens"] > 0
        and rt.get("speculative_method", "auto") in ("auto", "mtp")
        and m.get("num_nextn_predict_layers", 0) > 0
    ),
    "heterogeneous KV dtypes (skip layers)": lambda m, rt: (
        m["attention"]["kind"] == "gqa"
        and rt["kv_cache_dtype"] != "auto"
        # stated, or TurboQuant's (UltraQuant's) boundary layers of a dense model
        and (bool(rt.get("kv_cache_dtype_skip_layers")) or (_packs_boundary(rt) and "M" not in m["layers"]))
    ),
    "pipeline stages (PP > 1)": lambda m, rt: rt.get("pipeline_parallel_size", 1) > 1,
    "hybrid KV cache manager disabled": lambda m, rt: rt.get("disable_hybrid_kv_cache_manager", False),
    # spec-level (``m`` is the [[layer_specs]] list): MLA layers and regular sliding-window layers
    "MLA next to sliding-window layers (spec-level)": lambda m, rt: (
        {"mla", "sliding_window"} <= {e["kind"] for e in m}
    ),
}


def reached(rule: str, exercised=strategies.exercised_rules) -> dict[str, Any]:
    """An example of the strategy that ``exercised`` says reaches ``rule``; ``find`` fails if none
    of 2000 does. The example must really spell the rule (:data:`SPELLED`) and load."""
    from hypothesis import find

    def reaches(data: dict[str, Any]) -> bool:
        return rule in exercised(scenario_from_dict(data, "<hypothesis>"))

    spec_level = rule in strategies.SPEC_LEVEL_RULES
    strategy = strategies.mla_sliding_spec_dicts() if spec_level else strategies.scenario_dicts()
    found = find(strategy, reaches, settings=settings(max_examples=2000, database=None))
    tables = found["layer_specs"] if spec_level else found["model"]
    assert SPELLED[rule](tables, found["runtime"]), f"{rule}: not in {found}"
    return found


def test_every_exercisable_rule_is_spelled():
    assert set(SPELLED) == set(strategies.EXERCISABLE_RULES)


@pytest.mark.parametrize("rule", strategies.EXERCISABLE_RULES)
def test_the_strategies_reach_every_tp_speculation_window_and_block_rule(rule: str) -> None:
    """Generated scenarios reach each rule family the packaged suite counts (the summary's
    "generated inputs compared, per rule they reach")."""
    reached(rule)


@pytest.mark.parametrize("rule", strategies.EXERCISABLE_RULES)
def test_reaching_a_rule_is_checked_on_the_example(rule: str) -> None:
    """A wrong ``exercised_rules`` (it reports exactly the rules a scenario does not reach): the
    example ``find`` returns does not spell the rule, and the check says so."""

    def inverted(scenario: Scenario) -> tuple[str, ...]:
        real = strategies.exercised_rules(scenario)
        return tuple(r for r in strategies.EXERCISABLE_RULES if r not in real)

    with pytest.raises(AssertionError, match=f"^{re.escape(rule)}: not in"):
        reached(rule, exercised=inverted)
