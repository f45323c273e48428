"""Self-tests of the snapshot regressions (pytest_kvconform/suites/regressions): each wrong formula
fails its regression.

Every ``WrongX`` backend below subclasses the reference and reintroduces one historical bug in the
rule method(s) concerned, and nowhere else: its ``plan()`` is the reference's composition over its
own rules, so the bug reaches the plan the way it does in the backend. Running the regression files with
``--kvconform-backend=wrongbackends:WrongX`` (in-process, ``-k`` limited) must fail exactly the
tests listed for it, golden included.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from pytest_kvconform.regressions import golden_folders

SUITES = Path(__file__).resolve().parents[1] / "pytest_kvconform" / "suites"
REGRESSIONS = SUITES / "regressions"
REPORTED, HISTORY = (
    str(REGRESSIONS / "test_kvconform_reported.py"),
    str(REGRESSIONS / "test_kvconform_history.py"),
)
PACKAGE_SCENARIOS = Path(__file__).resolve().parents[1] / "pytest_kvconform" / "scenarios" / "regressions"

WRONG_BACKENDS = '''
import dataclasses
import math

from pytest_kvconform.backends.base import ReferenceBackend
from pytest_kvconform.reference import metal
from pytest_kvconform.reference.dtypes import DTYPE_SIZE
from pytest_kvconform.reference.hybrid import align_hybrid_block_size
from pytest_kvconform.reference.mamba import state_page_bytes, state_shapes
from pytest_kvconform.reference.specs import AttentionSpec, MambaSpec


class Unaligned229(ReferenceBackend):
    """vllm-metal before #229: one sequence = max_model_len tokens, not cdiv(L, bs) * bs."""
    name = "wrong-229"

    def one_sequence_bytes(self, block_size, state_page_padded, scenario):
        return metal.one_sequence_kv_bytes(scenario, 1, state_page_padded)


class NoAlignment230(ReferenceBackend):
    """vllm-metal before #230: no hybrid block-size alignment (block stays 16, state unpadded)."""
    name = "wrong-230"

    def align_hybrid_block_size(self, scenario):
        return None


class NoKernelTranslation235(ReferenceBackend):
    """vllm-metal before #235: the kernel is dispatched with the vLLM block size."""
    name = "wrong-235"

    def kernel_block_size(self, block_size, scenario=None):
        return block_size

    def build_block_tables(self, rows, block_size, scenario=None):
        width = max(len(r) for r in rows)
        return [list(r) + [0] * (width - len(r)) for r in rows], block_size


class Fp8DsMla576(ReferenceBackend):
    """fp8_ds_mla priced by the dtype formula: (512 + 64) x 1 B = 576 B/token (vllm#46985 family)."""
    name = "wrong-fp8-ds-mla"

    def attention_page_bytes(self, spec, scenario):
        if spec.is_mla and spec.state_content_bytes == 656:
            return spec.block_size * spec.head_size
        return spec.page_size_bytes


class Planner576(ReferenceBackend):
    """vLLM 0.33.0 Platform._align_hybrid_block_size prices fp8_ds_mla MLA at 576 B/token (vllm#55449)."""
    name = "wrong-b2"

    def align_hybrid_block_size(self, scenario):
        a = super().align_hybrid_block_size(scenario)
        if a is None or not scenario.model.use_mla:
            return a
        att, rt = scenario.model.attention, scenario.runtime
        return align_hybrid_block_size(att.kv_lora_rank + att.qk_rope_head_dim, state_page_bytes(scenario),
                                       kernel_block_alignment=rt.kernel_block_alignment,
                                       block_size=rt.block_size, use_mla=True)


class LcmAsPadToMax(ReferenceBackend):
    """Ignores the lcm policy of vllm#40128: always pads to the largest page."""
    name = "wrong-lcm"

    def unify_page_sizes(self, specs, scenario):
        if scenario.runtime.unify_policy == "lcm":
            scenario = scenario.with_runtime(unify_policy="pad-to-max")
        return super().unify_page_sizes(specs, scenario)


def _unpacked(scenario):
    if scenario.runtime.kv_cache_dtype.startswith("turboquant"):
        runtime = dataclasses.replace(scenario.runtime, kv_cache_dtype="auto")
        return dataclasses.replace(scenario, runtime=runtime)
    return scenario


class TurboQuantUnpacked472(ReferenceBackend):
    """vllm-metal before #472: hybrid + TurboQuant sized with the unpacked (auto) attention page."""
    name = "wrong-472"

    def align_hybrid_block_size(self, scenario):
        return super().align_hybrid_block_size(_unpacked(scenario))

    def layer_specs(self, scenario):
        return super().layer_specs(_unpacked(scenario))


class GdnStateAtModelDtype243(ReferenceBackend):
    """vllm-metal before #243: GDN recurrent state billed at the model dtype, not fp32."""
    name = "wrong-243"

    def state_page_bytes(self, spec, scenario):
        return sum(math.prod(s) * DTYPE_SIZE[spec.dtypes[0]] for s in spec.shapes)

    def one_sequence_bytes(self, block_size, state_page_padded, scenario):
        total = super().one_sequence_bytes(block_size, state_page_padded, scenario)
        model = scenario.model
        if model.num_state_layers and state_page_padded is None:
            recurrent = sum(math.prod(s) for s in state_shapes(model.state)[1:])
            total -= model.num_state_layers * recurrent * (4 - DTYPE_SIZE[model.dtype])
        return total


class Mla2x233(ReferenceBackend):
    """vllm-metal before #233/#529: MLA billed with the K+V factor (2x the latent)."""
    name = "wrong-233"

    def attention_page_bytes(self, spec, scenario):
        return 2 * spec.page_size_bytes if spec.is_mla and spec.cache_role == "kv" else spec.page_size_bytes

    def one_sequence_bytes(self, block_size, state_page_padded, scenario):
        factor = 2 if scenario.model.use_mla else 1
        return factor * super().one_sequence_bytes(block_size, state_page_padded, scenario)


class NullBlock513(ReferenceBackend):
    """vllm-metal before #513: the estimate uses the whole pool (null block not reserved)."""
    name = "wrong-513"

    def check_memory(self, specs, scenario):
        m = super().check_memory(specs, scenario)
        estimate = self.estimate_max_model_len(specs, m.available_bytes + m.bytes_per_block, scenario)
        admission = m.admission
        if admission.startswith("To serve"):
            admission = admission.replace(
                f"is {m.max_model_len_estimate}.", f"is {estimate}.")
        return dataclasses.replace(m, max_model_len_estimate=estimate, admission=admission)


class IgnoresOverride527(ReferenceBackend):
    """vllm-metal before #527: num_blocks from memory; --num-gpu-blocks-override not seen."""
    name = "wrong-527"

    def check_memory(self, specs, scenario):
        return super().check_memory(specs, scenario.with_runtime(num_gpu_blocks_override=None))


class RawStateInEstimate575(ReferenceBackend):
    """vllm-metal before #575: the non-paged estimate adds the raw GDN slot, not the padded page."""
    name = "wrong-575"

    def one_sequence_bytes(self, block_size, state_page_padded, scenario):
        return metal.one_sequence_kv_bytes(scenario, block_size, None)


def _as_full(spec):
    if isinstance(spec, AttentionSpec) and spec.kind == "sliding_window":
        return dataclasses.replace(spec, kind="full_attention", sliding_window=None)
    return spec


class SlidingAsFull563(ReferenceBackend):
    """vllm-metal before #563: sliding-window layers billed as full attention."""
    name = "wrong-563"

    def layer_specs(self, scenario):
        return {k: _as_full(v) for k, v in super().layer_specs(scenario).items()}

    def max_memory_usage_bytes(self, spec, scenario):
        return super().max_memory_usage_bytes(_as_full(spec), scenario)

    def kv_cache_groups(self, specs, scenario):
        return super().kv_cache_groups({k: _as_full(v) for k, v in specs.items()}, scenario)


def _uniform_max(specs):
    attn = [s for s in specs.values() if isinstance(s, AttentionSpec)]
    if not attn:
        return specs
    heads, head = max(s.num_kv_heads for s in attn), max(s.head_size for s in attn)
    return {k: dataclasses.replace(s, num_kv_heads=heads, head_size=head)
            if isinstance(s, AttentionSpec) else s for k, s in specs.items()}


class UniformMaxHead251(ReferenceBackend):
    """vllm-metal #251: every layer at max(head_dim, global_head_dim) with uniform KV heads."""
    name = "wrong-251"

    def kv_cache_groups(self, specs, scenario):
        return super().kv_cache_groups(_uniform_max(specs), scenario)


class MambaBlockPerToken259(ReferenceBackend):
    """vllm-metal #259: MambaSpec(block_size=1): one state block per token per group."""
    name = "wrong-259"

    def max_memory_usage_bytes(self, spec, scenario):
        if isinstance(spec, MambaSpec):
            return scenario.runtime.max_model_len * spec.page_size_bytes
        return super().max_memory_usage_bytes(spec, scenario)


class Dtype2Bytes125(ReferenceBackend):
    """vllm-metal before #125: KV dtype size hard-coded as 2 (float16)."""
    name = "wrong-125"

    def kv_cache_dtype_bytes(self, kv_cache_dtype, model_dtype, scenario=None):
        return 2 if kv_cache_dtype == "auto" else super().kv_cache_dtype_bytes(kv_cache_dtype, model_dtype)

    def attention_page_bytes(self, spec, scenario):
        if spec.dtype == "float32" and spec.state_content_bytes is None:
            return spec.page_size_bytes // 2
        return spec.page_size_bytes


class ScaleMamba43626(ReferenceBackend):
    """vLLM before #45207 (vllm#43626): scale a MambaSpec's block size like an attention layer's."""
    name = "wrong-43626"

    def unify_page_sizes(self, specs, scenario):
        return super().unify_page_sizes(specs, scenario.with_runtime(unify_policy="scale-only"))


class OldAdmissionText(ReferenceBackend):
    """The admission message of older vLLM logs: no "(which also controls CPU memory on the CPU
    backend)" and no docs link; the numbers are right."""
    name = "wrong-admission-text"

    def check_memory(self, specs, scenario):
        m = super().check_memory(specs, scenario)
        text = m.admission.replace(" (which also controls CPU memory on the CPU backend)", "")
        return dataclasses.replace(m, admission=text.split(" See https://")[0])


class PackedWidthForFp8Mla(ReferenceBackend):
    """The hybrid alignment prices plain fp8 MLA with fp8_ds_mla's packed 656 B/token (the fix of
    vllm#55449 applied to every fp8 MLA format); fp8_ds_mla itself is right."""
    name = "wrong-fp8-mla-width"

    def align_hybrid_block_size(self, scenario):
        if scenario.model is not None and scenario.model.use_mla and scenario.runtime.kv_cache_dtype == "fp8":
            scenario = scenario.with_runtime(kv_cache_dtype="fp8_ds_mla")
        return super().align_hybrid_block_size(scenario)


class PaddingBilledAsState(ReferenceBackend):
    """Unification that grows a padded state page's tensors to the page instead of padding it: the
    page bytes are right, the real (unpadded) state is lost."""
    name = "wrong-padding-as-state"

    def unify_page_sizes(self, specs, scenario):
        out = super().unify_page_sizes(specs, scenario)
        return {k: dataclasses.replace(v, shapes=((v.page_size_bytes,),), dtypes=("uint8",),
                                       page_size_padded=None)
                if isinstance(v, MambaSpec) and v.page_size_padded else v for k, v in out.items()}
'''
#: WrongX -> (-k expression, tests that must fail: node names, relative to the regression files).
CASES: dict[str, tuple[str, set[str]]] = {
    "Unaligned229": (
        "metal229 or 229-granite",
        {
            "test_kvconform_reported.py::test_metal229_granite_bs400_one_sequence_is_block_aligned",
            "test_kvconform_reported.py::test_plan_golden[vllm-metal-229-granite-bs400]",
        },
    ),
    "NoAlignment230": (
        "metal230 or 230-qwen35",
        {
            "test_kvconform_reported.py::test_metal230_qwen35_reviewer_block[32-160-19.40]",
            "test_kvconform_reported.py::test_metal230_qwen35_reviewer_block[16-144-7.46]",
            "test_kvconform_reported.py::test_plan_golden[vllm-metal-230-qwen35-bs160]",
        },
    ),
    "NoKernelTranslation235": (
        "metal235 or 235-qwen35 or 230-qwen35",
        {
            "test_kvconform_reported.py::test_metal235_block_160_runs_as_5_kernel_blocks_of_32",
            "test_kvconform_reported.py::test_metal235_qwen35_08b_today[fp32-state]",
            "test_kvconform_reported.py::test_metal235_qwen35_08b_today[bf16-state]",
            "test_kvconform_reported.py::test_plan_golden[vllm-metal-230-qwen35-bs160]",
            "test_kvconform_reported.py::test_plan_golden[vllm-metal-235-qwen35-08b-fp32-state]",
            "test_kvconform_reported.py::test_plan_golden[vllm-metal-235-qwen35-08b-bf16-state]",
            *(
                f"test_kvconform_history.py::test_metal235_kernel_block_is_translated[{b}-{k}]"
                for b, k in [(544, 32), (1808, 16), (144, 16), (2768, 16), (4192, 32)]
            ),
            "test_kvconform_history.py::test_metal235_plan_reports_the_translation",
        },
    ),
    "Fp8DsMla576": (
        "glm5",
        {
            "test_kvconform_reported.py::test_glm5_fp8_ds_mla_pages",
            "test_kvconform_reported.py::test_plan_golden[glm5-fp8-ds-mla]",
        },
    ),
    "Planner576": (
        "vllm_b2 or vllm-b2",
        {
            "test_kvconform_reported.py::test_vllm_b2_mla_hybrid_block_uses_the_packed_page",
            "test_kvconform_reported.py::test_plan_golden[vllm-b2-mla-mamba-fp8-ds-mla]",
            "test_kvconform_reported.py::test_vllm_b2_kimi_linear_block_uses_the_packed_page",
            "test_kvconform_reported.py::test_plan_golden[vllm-b2-kimi-linear-mla-kda-fp8-ds-mla]",
        },
    ),
    "LcmAsPadToMax": (
        "40128",
        {
            "test_kvconform_reported.py::test_vllm40128_turboquant_lcm_policies[lcm]",
            "test_kvconform_reported.py::test_vllm40128_turboquant_lcm_plan",
            "test_kvconform_reported.py::test_plan_golden[vllm-40128-turboquant-lcm]",
        },
    ),
    "TurboQuantUnpacked472": (
        "39931",
        {
            "test_kvconform_reported.py::test_vllm39931_qwen36_turboquant_k8v4_real_run",
            "test_kvconform_reported.py::test_plan_golden[vllm-39931-qwen36-turboquant-k8v4]",
        },
    ),
    "GdnStateAtModelDtype243": (
        "243",
        {
            "test_kvconform_history.py::test_metal243_gdn_recurrent_state_is_fp32",
            "test_kvconform_history.py::test_plan_golden[vllm-metal-243-gdn-fp32-state]",
        },
    ),
    "Mla2x233": (
        "233",
        {
            "test_kvconform_history.py::test_metal233_529_mla_is_one_latent",
            "test_kvconform_history.py::test_plan_golden[vllm-metal-233-529-glm47-mla]",
        },
    ),
    "NullBlock513": (
        "513",
        {
            "test_kvconform_history.py::test_metal513_estimate_reserves_the_null_block",
            "test_kvconform_history.py::test_plan_golden[vllm-metal-513-llama3-null-block]",
        },
    ),
    "IgnoresOverride527": (
        "527",
        {
            "test_kvconform_history.py::test_metal527_block_override_is_what_the_engine_requests",
            "test_kvconform_history.py::test_plan_golden[vllm-metal-527-qwen25-block-override]",
        },
    ),
    "RawStateInEstimate575": (
        "575",
        {
            "test_kvconform_history.py::test_metal575_estimate_counts_padded_state_pages",
            "test_kvconform_history.py::test_plan_golden[vllm-metal-575-qwen36-padded-state]",
        },
    ),
    "SlidingAsFull563": (
        "563",
        {
            "test_kvconform_history.py::test_metal563_sliding_layers_are_not_billed_as_full",
            "test_kvconform_history.py::test_plan_golden[vllm-metal-563-gemma-sliding-full]",
        },
    ),
    "UniformMaxHead251": (
        "251",
        {
            "test_kvconform_history.py::test_metal251_277_per_layer_kv_heads",
            "test_kvconform_history.py::test_plan_golden[vllm-metal-251-277-gemma4-31b-heads]",
        },
    ),
    "MambaBlockPerToken259": (
        "259",
        {
            "test_kvconform_history.py::test_metal259_579_state_needs_one_block_per_request",
            "test_kvconform_history.py::test_plan_golden[vllm-metal-259-579-qwen3-next-state-blocks]",
            "test_kvconform_history.py::test_plan_golden[vllm-metal-259-579-qwen3-next-1301]",
        },
    ),
    "Dtype2Bytes125": (
        "125",
        {
            "test_kvconform_history.py::test_metal125_fp32_model_is_4_bytes",
            "test_kvconform_history.py::test_plan_golden[vllm-metal-125-qwen3-fp32]",
        },
    ),
    "ScaleMamba43626": (
        "43626",
        {
            "test_kvconform_history.py::test_vllm43626_mamba_page_is_padded_not_scaled",
            "test_kvconform_history.py::test_plan_golden[vllm-43626-granite-dense-draft]",
        },
    ),
}


#: Assertions that replaced literal arithmetic (issue 18): WrongX -> (-k expression, {test: text its
#: failure must show}), so each new assertion is shown failing by itself on a wrong backend.
PINPOINTED: dict[str, tuple[str, dict[str, str]]] = {
    "Unaligned229": (
        "metal229_granite_bs400_one_sequence",
        {
            "test_kvconform_reported.py::test_metal229_granite_bs400_one_sequence_is_block_aligned": (
                "assert 167772160 == 196608000"
            ),
        },
    ),
    "OldAdmissionText": (
        "old_estimate_fails or metal513 or metal575",
        {
            "test_kvconform_reported.py::test_metal229_granite_bs400_old_estimate_fails_admission": (
                "assert got.admission == "
            ),
            "test_kvconform_history.py::test_metal513_estimate_reserves_the_null_block": (
                "assert got.admission == text"
            ),
            "test_kvconform_history.py::test_metal575_estimate_counts_padded_state_pages": (
                "assert refused.admission == "
            ),
        },
    ),
    "NullBlock513": (
        "metal575",
        {
            "test_kvconform_history.py::test_metal575_estimate_counts_padded_state_pages": (
                "assert 7392 == 6336"
            ),
        },
    ),
    "NoKernelTranslation235": (
        "block_160_runs",
        {
            "test_kvconform_reported.py::test_metal235_block_160_runs_as_5_kernel_blocks_of_32": (
                "assert [8, 16, 32, 160] == [8, 16, 32, 32]"
            ),
        },
    ),
    "PackedWidthForFp8Mla": (
        "vllm_b2_mla_hybrid",
        {
            "test_kvconform_reported.py::test_vllm_b2_mla_hybrid_block_uses_the_packed_page": (
                "assert (656, 1280, 839680) == (576, 1408, 811008)"
            ),
        },
    ),
    "PaddingBilledAsState": (
        "unify_repad_mamba or 43626_mamba",
        {
            "test_kvconform_reported.py::test_vllm_b2_planner_block_makes_unify_repad_mamba": (
                "assert {'0.00'} == {'14.54'}"
            ),
            "test_kvconform_history.py::test_vllm43626_mamba_page_is_padded_not_scaled": (
                "assert '0.00' == '103.17'"
            ),
        },
    ),
}


@pytest.fixture
def wrong(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(wrongbackends=WRONG_BACKENDS)
    pytester.syspathinsert()
    return pytester


def _failed(rec: pytest.HookRecorder) -> set[str]:
    _, _, failed = rec.listoutcomes()
    return {r.nodeid.rsplit("/", 1)[-1] for r in failed}


@pytest.mark.parametrize("backend", list(CASES))
def test_wrong_formula_fails_its_regression(wrong: pytest.Pytester, backend: str) -> None:
    expr, must_fail = CASES[backend]
    rec = wrong.inline_run(REPORTED, HISTORY, f"--kvconform-backend=wrongbackends:{backend}", "-k", expr,
                           "-p", "no:cacheprovider", "-q")  # fmt: skip
    failed = _failed(rec)
    assert must_fail <= failed, f"{backend}: did not fail {sorted(must_fail - failed)}"
    assert failed == must_fail, f"{backend}: also failed {sorted(failed - must_fail)}"


@pytest.mark.parametrize("backend", list(PINPOINTED))
def test_each_fixed_assertion_fails_on_a_wrong_formula(wrong: pytest.Pytester, backend: str) -> None:
    """Every assertion that replaced a literal (``assert 4 * 128 == 512`` style) reads the backend's
    answer: a backend wrong in that one respect fails the test at that very assertion."""
    expr, must_fail = PINPOINTED[backend]
    rec = wrong.inline_run(REPORTED, HISTORY, f"--kvconform-backend=wrongbackends:{backend}", "-k", expr,
                           "-p", "no:cacheprovider", "-q")  # fmt: skip
    failures = {
        r.nodeid.rsplit("/", 1)[-1]: r.longreprtext
        for r in rec.getreports("pytest_runtest_logreport")
        if r.failed and r.when == "call"
    }
    for test, shown in must_fail.items():
        assert test in failures, f"{backend}: {test} did not fail (failed: {sorted(failures)})"
        assert shown in failures[test], f"{backend}: {test} failed elsewhere:\n{failures[test][-2000:]}"


@pytest.mark.parametrize("release", ["0.27", "0.33"])
@pytest.mark.parametrize("folder", ["__snapshots__", "__snapshots_before_null_block_reserved__"])
def test_goldens_fail_on_an_unused_snapshot(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, folder: str, release: str
) -> None:
    """syrupy's default: a golden no test uses makes the run exit 1 (no --snapshot-warn-unused), in
    the folder of the judged release's goldens and in the other one (every run uses both)."""
    # Under xdist the inner run would inherit the worker id, and syrupy skips the unused check there.
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    # a module name of its own: the outer session has already imported suites' test_history
    shutil.copy(REGRESSIONS / "test_kvconform_history.py", pytester.path / "test_history_copy.py")
    shutil.copy(REGRESSIONS / "conftest.py", pytester.path / "conftest.py")  # the golden fixture
    for each in golden_folders():  # every release's folder: each run uses them all
        copy = pytester.path / each / "test_history_copy"
        shutil.copytree(REGRESSIONS / each / "test_kvconform_history", copy)
    stale = pytester.path / folder / "test_history_copy" / "test_plan_golden[vllm-metal-0-removed].json"
    stale.write_text("{}\n")
    result = pytester.runpytest("-k", "golden", "-p", "no:cacheprovider", f"--kvconform-vllm={release}")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*1 snapshot unused*"])
    result.assert_outcomes(passed=11)


def test_regression_scenarios_pass_the_conformance_suite(pytester: pytest.Pytester) -> None:
    """The regression scenarios are valid for the rules suite (as packaged scenarios must be):
    every differential test runs on them (a backend that inherits every rule: nothing departs,
    crashes or is declined) and the reference's self-check of their expectations agrees."""
    stems = sorted(p.stem for p in PACKAGE_SCENARIOS.glob("*.toml"))
    rules = str(SUITES / "test_kvconform_rules.py")
    pytester.makepyfile(inheritsall="from pytest_kvconform.backends.base import ReferenceBackend\n"
                        "class InheritsAll(ReferenceBackend):\n    name = 'inherits-all'\n")  # fmt: skip
    pytester.syspathinsert()
    args = (
        rules,
        f"--kvconform-scenarios={PACKAGE_SCENARIOS}",
        "-k",
        " or ".join(stems),
        "-p",
        "no:cacheprovider",
    )
    result = pytester.runpytest(*args, "--kvconform-backend=inheritsall:InheritsAll", "-rs")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    inherited = sum(int(n) for n in re.findall(r"SKIPPED \[(\d+)\] .*: inherited: ", result.stdout.str()))
    assert inherited >= 8 * len(stems)
    assert not re.search(r"SKIPPED \[\d+\] .*: declined: ", result.stdout.str())
    self_check = pytester.runpytest(*args)
    assert self_check.ret == pytest.ExitCode.OK and self_check.parseoutcomes()["passed"] >= len(stems)
