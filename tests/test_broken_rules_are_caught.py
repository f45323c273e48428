"""Each TP-, speculation-, window-, per-layer-geometry-, skip-layer-, DCP- and dtype-dependent rule, broken in
a backend, fails some packaged scenario's ``[expect]`` (numbers derived by hand in
docs/scenario-derivations.md, not by the reference): the packaged scenarios reach every one of
these rules.

And the checks that used to hide a failure (issue 18) catch a broken backend now: the MLA case
of the allocation suite's one-sequence pool check, and the plan benchmark's error handling.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

SUITES = Path(__file__).resolve().parents[1] / "pytest_kvconform" / "suites"
RULES_SUITE = str(SUITES / "test_kvconform_rules.py")
ALLOCATION_SUITE = str(SUITES / "test_kvconform_allocation.py")
PLAN_BENCH = str(SUITES / "benchmarks" / "test_kvconform_plan_bench.py")

BROKEN = '''
import dataclasses
from unittest import mock

from pytest_kvconform.backends.base import Declines, ReferenceBackend
from pytest_kvconform.gaps import OfflineGap
from pytest_kvconform.rejections import Rejected


class Broken(ReferenceBackend):
    """Plans ``changed(scenario)`` instead of the scenario (the rest of the reference is intact)."""

    def changed(self, scenario):
        raise NotImplementedError

    def plan(self, scenario):
        return super().plan(self.changed(scenario))


class IgnoresTensorParallel(Broken):
    name = "ignores-tp"
    def changed(self, s):
        return s.with_runtime(tensor_parallel_size=1)


class NoExtraGroups(ReferenceBackend):  # Mamba2 groups not replicated for head shards
    name = "no-extra-groups"
    def plan(self, scenario):
        with mock.patch("pytest_kvconform.reference.mamba.extra_groups_for_head_shards", lambda n, tp: 0):
            return super().plan(scenario)


class IgnoresDcp(Broken):
    name = "ignores-dcp"
    def changed(self, s):
        return s.with_runtime(decode_context_parallel_size=1)


class IgnoresSpeculation(Broken):
    name = "ignores-speculation"
    def changed(self, s):
        return s.with_runtime(num_speculative_tokens=0)


class IgnoresDraftLayers(ReferenceBackend):
    """The worker's specs of the target model only: the MTP drafter's layers (model.layers.N and
    beyond, or mtp.layers.*) left out."""
    name = "ignores-draft-layers"
    def layer_specs(self, scenario):
        specs = super().layer_specs(scenario=scenario)
        if scenario.model is None:
            return specs
        n = scenario.model.num_hidden_layers
        return {k: v for k, v in specs.items() if k.startswith("model.") and int(k.split(".")[2]) < n}


class WindowsAsFull(Broken):
    name = "windows-as-full"
    def changed(self, s):
        model = dataclasses.replace(s.model, layers=s.model.layers.replace("S", "A"))
        return dataclasses.replace(s, model=model)


class FullLayersAsSliding(Broken):
    """Full-attention layers given the sliding layers' head size and KV heads (Gemma 4's
    global_head_dim / num_global_key_value_heads ignored)."""
    name = "full-layers-as-sliding"
    def changed(self, s):
        attn = s.model.attention
        if attn is None or not attn.is_heterogeneous:
            return s
        attn = dataclasses.replace(attn, global_head_dim=None, num_global_kv_heads=None)
        return dataclasses.replace(s, model=dataclasses.replace(s.model, attention=attn))


class Fp8AsModelDtype(Broken):
    name = "fp8-as-model-dtype"
    def changed(self, s):
        fp8 = s.runtime.kv_cache_dtype == "fp8"
        return s.with_runtime(kv_cache_dtype="auto") if fp8 else s


class NoHeterogeneousAlignment(ReferenceBackend):
    """Phase 3 of update_block_size_for_backend (_align_heterogeneous_kv_block_size) skipped:
    skip layers at the model dtype, the block left where Phases 1 and 2 put it."""
    name = "no-phase-3"
    def plan(self, scenario):
        def keep(primary, padded, *, kernel_block_alignment, block_size, state_page_padded):
            return block_size, None, state_page_padded
        with mock.patch("pytest_kvconform.reference.hybrid.align_heterogeneous_kv_block_size", keep):
            return super().plan(scenario)


class NoBoundaryLayers(ReferenceBackend):
    """TurboQuant's boundary skip layers of a dense model not added (every layer packed)."""
    name = "no-boundary-layers"
    def plan(self, scenario):
        with mock.patch("pytest_kvconform.reference.hybrid.boundary_skip_layers", lambda s: ()):
            return super().plan(scenario)


class NoFullAllocationFallback(ReferenceBackend):
    """MLA + sliding-window pages that unification refuses: the full-allocation fallback
    (_try_get_full_allocation_fallback_groups, vLLM 0.27+) left out, so the error propagates."""
    name = "no-full-allocation-fallback"
    def plan(self, scenario):
        with mock.patch("pytest_kvconform.reference.grouping.full_allocation_fallback", lambda specs: None):
            return super().plan(scenario)


class KernelServesAnyBlock(ReferenceBackend):
    """The runner's kernel block check (prepare_kernel_block_sizes) skipped: every block served."""
    name = "kernel-serves-any-block"
    def kernel_block_sizes(self, groups, scenario):
        return [g.block_size for g in groups]


class HybridManagerAlwaysOn(Broken):
    """--disable-hybrid-kv-cache-manager ignored: sliding layers keep their window, state layers plan."""
    name = "hybrid-manager-always-on"
    def changed(self, s):
        return s.with_runtime(disable_hybrid_kv_cache_manager=False)


class IgnoresPipeline(Broken):
    """--pipeline-parallel-size ignored: one worker holds every layer."""
    name = "ignores-pipeline"
    def changed(self, s):
        return s.with_runtime(pipeline_parallel_size=1)


class PipelineBatchesAsOne(ReferenceBackend):
    """A pipeline's default batches in flight taken as one engine's (2 with async scheduling), not
    the V2 model runner's pp + 1 (VllmConfig.max_concurrent_batches)."""
    name = "pipeline-batches-as-one"
    def plan(self, scenario):
        from pytest_kvconform.reference import defaults
        derive = defaults.max_concurrent_batches
        with mock.patch.dict(
            defaults.DERIVATIONS,
            {"max_concurrent_batches": lambda s, r: derive(s.with_runtime(pipeline_parallel_size=1), r)},
        ):
            return super().plan(scenario)


class MambaAllAsAlign(Broken):
    """--mamba-cache-mode all planned as align: the block not aligned to the Mamba chunk, one
    state per request instead of one per block."""
    name = "mamba-all-as-align"
    def changed(self, s):
        return s.with_runtime(mamba_cache_mode="align") if s.runtime.mamba_cache_mode == "all" else s


class MambaAllAfterRemoval(ReferenceBackend):
    """--mamba-cache-mode all still planned by releases that refuse it (0.32+)."""
    name = "mamba-all-after-removal"
    def plan(self, scenario):
        with (
            mock.patch("pytest_kvconform.reference.selection.verify_mamba_cache_mode", lambda s, r: None),
        ):
            return super().plan(scenario)


class NoPoolWithoutGroups(ReferenceBackend):
    """A model no layer of which holds a KV cache gets no plan (the harness's rule before), not
    vLLM's one-block pool (get_kv_cache_config_from_groups: num_blocks=1)."""
    name = "no-pool-without-groups"
    def check_memory(self, specs, scenario):
        if not specs:
            raise ValueError("no KV cache groups: nothing to plan")
        return super().check_memory(specs, scenario=scenario)


class FirstStageOnly(ReferenceBackend):
    """The pool sized by the first pipeline stage's worker, not the smallest over the workers."""
    name = "first-stage-only"
    def plan(self, scenario):
        from pytest_kvconform.reference import parallel
        stages = parallel.pipeline_stages
        with mock.patch("pytest_kvconform.reference.rules.pipeline_stages", lambda n, s: stages(n, s)[:1]):
            return super().plan(scenario)


class MlaRopeNotBilled(ReferenceBackend):
    """The one-sequence estimate of an MLA model bills kv_lora_rank values per token, not the
    kv_lora_rank + qk_rope_head_dim of the latent (512 of 576)."""
    name = "mla-rope-not-billed"
    def one_sequence_bytes(self, block_size, state_page_padded, scenario):
        total = super().one_sequence_bytes(block_size, state_page_padded, scenario)
        att = scenario.model.attention if scenario.model is not None else None
        if att is None or att.kind != "mla":
            return total
        return total * att.kv_lora_rank // (att.kv_lora_rank + att.qk_rope_head_dim)


class PlanTypeError(ReferenceBackend):
    """A bug: plan() raises outside the exception contract."""
    name = "plan-type-error"
    def plan(self, scenario):
        raise TypeError("unsupported operand type(s) for *: 'NoneType' and 'int'")


class PlanRaisesValueError(ReferenceBackend):
    """plan() raises a ValueError whose message is no refusal vLLM knows: a crash, not a rejection."""
    name = "plan-value-error"
    def plan(self, scenario):
        raise ValueError("cannot plan this model")


class PlanRejects(ReferenceBackend):
    """plan() refuses the scenario, of a kind (the engine would not start)."""
    name = "plan-rejects"
    def plan(self, scenario):
        raise Rejected("not_enough_memory", "no Mamba2 pool fits on this device")


class PlanOfflineGap(ReferenceBackend):
    name = "plan-offline-gap"
    def plan(self, scenario):
        raise OfflineGap("cpu_build", "no planner for hybrid models on this host")


class PlanNotProvided(ReferenceBackend):
    name = "plan-not-provided"
    declines = Declines({"plan": "this backend only answers the memory rules"})
'''


@pytest.mark.parametrize(
    ("backend", "caught"),
    [
        (
            "IgnoresTensorParallel",
            {"qwen2.5-3b-instruct-tp4", "granite-4.0-h-tiny-tp4", "granite-4.0-h-small-tp8"},
        ),
        ("NoExtraGroups", {"granite-4.0-h-tiny-tp4", "granite-4.0-h-small-tp8"}),
        ("IgnoresDcp", {"deepseek-v3-dcp8", "deepseek-v3-fp8-dcp8-pp4"}),
        ("IgnoresSpeculation", {"qwen3.5-35b-a3b-mtp1", "qwen3-next-80b-a3b-mtp2-tp4"}),
        ("IgnoresDraftLayers", {"deepseek-v3-mtp1", "qwen3.5-35b-a3b-mtp1", "qwen3-next-80b-a3b-mtp2-tp4"}),
        ("WindowsAsFull", {"gemma-3-27b-it", "gpt-oss-20b"}),
        ("FullLayersAsSliding", {"gemma-4-31b-it"}),
        ("Fp8AsModelDtype", {"deepseek-v3-fp8"}),
        ("NoHeterogeneousAlignment", {"llama-3.1-8b-instruct-turboquant-k8v4"}),
        ("NoBoundaryLayers", {"llama-3.1-8b-instruct-turboquant-k8v4"}),
        ("KernelServesAnyBlock", {"llama-3.1-8b-instruct-fp8-block-8"}),
        ("HybridManagerAlwaysOn", {"gemma-4-31b-it-hma-disabled", "granite-4.0-h-tiny-hma-disabled"}),
        ("IgnoresPipeline", {"deepseek-v3-fp8-pp4", "qwen3-next-80b-a3b-pp2", "deepseek-v3-fp8-dcp8-pp4"}),
        ("FirstStageOnly", {"deepseek-v3-fp8-pp4", "deepseek-v3-fp8-dcp8-pp4"}),  # stage 0: 15 layers, 2: 16
        ("NoPoolWithoutGroups", {"all-minilm-l6-v2"}),
        ("PipelineBatchesAsOne", {"mistral-7b-v0.1-pp2"}),
        ("MambaAllAsAlign@0.31", {"granite-4.0-h-tiny-mamba-all"}),  # 0.23 ... 0.31 plan "all"
        ("MambaAllAfterRemoval@0.32", {"granite-4.0-h-tiny-mamba-all"}),  # 0.32+ refuse it
    ],
)
def test_a_broken_rule_fails_a_packaged_expectation(
    pytester: pytest.Pytester, backend: str, caught: set
) -> None:
    """``backend`` is a class of BROKEN, judged by the installed vLLM's rules or, after ``@``, a release's."""
    backend, _, release = backend.partition("@")
    pytester.makepyfile(broken=BROKEN)
    pytester.syspathinsert()
    result = pytester.runpytest(
        RULES_SUITE,
        f"--kvconform-backend=broken:{backend}",
        *([f"--kvconform-vllm={release}"] if release else []),
        "-k",
        "test_expectations",
        "-p",
        "no:cacheprovider",
    )
    failed = {
        line.split("[", 1)[1].split("]", 1)[0]
        for line in result.stdout.lines
        if line.startswith("FAILED") and "test_expectations[" in line
    }
    assert caught <= failed, result.stdout.str()[-2000:]


def _outcomes(result: pytest.RunResult, test: str) -> dict[str, str]:
    """``{parametrize id: PASSED/FAILED/SKIPPED/...}`` of ``test`` in a ``-rA`` run."""
    out = {}
    for line in result.stdout.lines:
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL") and f"{test}[" in rest:
            out[rest.split("[", 1)[1].split("]", 1)[0]] = word
    return out


def test_an_mla_pool_that_cannot_hold_max_model_len_fails(pytester: pytest.Pytester) -> None:
    """The MLA case of ``test_one_sequence_pool_holds_max_model_len`` used to return early and be
    counted passed: an MLA estimate 64/576 short (GLM-4.7-Flash: 47 layers, L 131,072, block 64)
    now fails it, while the GQA scenario next to it, which the backend hands to the reference's
    code, is inherited (skipped with that verdict), not passed."""
    pytest.importorskip("mlx.core")
    pytester.makepyfile(broken=BROKEN)
    pytester.syspathinsert()
    report = pytester.path / "report.json"
    result = pytester.runpytest(
        ALLOCATION_SUITE, "--kvconform-backend=broken:MlaRopeNotBilled", "-rA", "-p", "no:cacheprovider",
        "-k", "pool_holds_max_model_len and (glm-4.7-flash-bf16 or qwen2.5-3b-instruct-tp4)",
        f"--kvconform-report={report}",
    )  # fmt: skip
    verdicts = {
        r["scenario"]: (r["verdict"], r["outcome"]) for r in json.loads(report.read_text())["results"]
        if "test_one_sequence_pool_holds_max_model_len[" in r["test"]
    }  # fmt: skip
    assert verdicts == {
        "glm-4.7-flash-bf16": ("departed", "failed"), "qwen2.5-3b-instruct-tp4": ("inherited", "skipped"),
    }, result.stdout.str()  # fmt: skip
    result.assert_outcomes(failed=1, skipped=1)
    result.stdout.fnmatch_lines([
        "*B buy * blocks of 64 tokens: * < 131072 tokens*",
        "SKIPPED [[]1[]] *: inherited: the reference's code answered: one_sequence.one_sequence_bytes*",
    ])  # fmt: skip


@pytest.mark.parametrize("name", ["glm-4.7-flash-bf16", "qwen3.5-4b"])  # MLA latents; GQA K and V
def test_pool_tokens_are_really_read_back(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The read-back itself: a pool of 16 blocks of 64 for 1000 tokens reads back through the
    block table; a slot mapping that ignores the block table (token i to slot i) does not, nor
    one that drops the last token (the attention check alone cannot see one token of 262,144)."""
    mx = pytest.importorskip("mlx.core")
    from pytest_kvconform.scenario import load_scenario
    from pytest_kvconform.suites.test_kvconform_allocation import _write_and_read_back

    s = load_scenario(name).with_runtime(max_model_len=1000)
    assert s.model is not None and s.model.attention is not None
    _write_and_read_back(s, 16, 64)
    # the module the check imports from (pytester runs may have replaced the package's attribute)
    metal_runtime = importlib.import_module("pytest_kvconform.metal_runtime")
    write = metal_runtime.reshape_and_cache

    def ignores_the_table(key, value, key_cache, value_cache, slots):
        return write(key, value, key_cache, value_cache, mx.arange(slots.shape[0]))

    def drops_the_last_token(key, value, key_cache, value_cache, slots):
        return write(key, value, key_cache, value_cache, mx.concatenate([slots[:-1], mx.array([-1])]))

    for broken in (ignores_the_table, drops_the_last_token):
        monkeypatch.setattr(metal_runtime, "reshape_and_cache", broken)
        with pytest.raises(AssertionError, match="K of 1000 tokens does not read back"):
            _write_and_read_back(s, 16, 64)


@pytest.mark.parametrize(
    ("backend", "outcome", "shown"),
    [
        ("PlanTypeError", "FAILED", "*TypeError: unsupported operand type*"),
        ("PlanRaisesValueError", "FAILED", "*ValueError: cannot plan this model*"),
        ("PlanRejects", "SKIPPED", "*rejects granite-4.0-h-tiny (not_enough_memory): nothing to time*"),
        (
            "PlanOfflineGap",
            "SKIPPED",
            "*cannot plan granite-4.0-h-tiny here: cpu_build: no planner for hybrid*",
        ),
        ("PlanNotProvided", "SKIPPED", "*does not provide plan: this backend only answers*"),
    ],
)
def test_the_plan_benchmark_skips_only_declared_failures(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, backend: str, outcome: str, shown: str
) -> None:
    """The plan benchmark used to turn any exception of ``plan()`` into a skip: it skips only a
    declared decline, an offline gap, or a refusal of a known kind (nothing to time)."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # pytest-benchmark reads it (-n 2 runs)
    pytester.makepyfile(broken=BROKEN)
    pytester.syspathinsert()
    result = pytester.runpytest(
        PLAN_BENCH, f"--kvconform-backend=broken:{backend}", "--benchmark-only", "-rA",
        "-p", "no:cacheprovider",
        "-k", "granite-4.0-h-tiny and not tp4 and not hma-disabled and not mamba-all",
    )  # fmt: skip
    ran = {k: v for k, v in result.parseoutcomes().items() if k in ("passed", "failed", "skipped", "errors")}
    assert ran == {outcome.lower(): 1}, result.stdout.str()
    result.stdout.fnmatch_lines([shown])


def test_a_broken_full_allocation_fallback_fails_its_expectation(pytester: pytest.Pytester) -> None:
    """No real model reaches the MLA + sliding-window fallback (reference/grouping.py), so its
    hand-derived [expect] (docs/scenario-derivations.md, 10b) is a spec-level test scenario,
    tests/data/mla-sliding-fallback.toml: the reference meets it, the broken backend fails it."""
    scenario = Path(__file__).parent / "data" / "mla-sliding-fallback.toml"
    pytester.makepyfile(broken=BROKEN)
    pytester.syspathinsert()
    outcomes = {}
    for backend in ("reference", "broken:NoFullAllocationFallback"):
        result = pytester.runpytest(
            RULES_SUITE, f"--kvconform-backend={backend}", f"--kvconform-scenarios={scenario}", "-rA",
            "-k", "test_expectations and mla-sliding-fallback", "-p", "no:cacheprovider",
        )  # fmt: skip
        outcomes[backend] = _outcomes(result, "test_expectations")
    assert outcomes == {
        "reference": {"mla-sliding-fallback": "PASSED"},
        "broken:NoFullAllocationFallback": {"mla-sliding-fallback": "FAILED"},
    }
