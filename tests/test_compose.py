"""``compose_plan`` composes through the rules object: overriding one rule moves the plan.

For each rule method a backend may override, a subclass of the reference changes just that
method's answer; its plan (``ReferenceBackend.plan`` = the composition over its own rules) must
differ from the reference's in the field that rule feeds. Also: the exception contract of a
composed plan (a step the backend declines takes the reference's answer and the trace says so;
anything else is a ``RuleError`` naming the rule).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from pytest_kvconform.backends.base import RULE_FAMILIES, ReferenceBackend
from pytest_kvconform.errors import RuleError
from pytest_kvconform.gaps import OfflineGap
from pytest_kvconform.model import BlockChoice
from pytest_kvconform.reference import plan as reference_plan
from pytest_kvconform.reference.specs import MambaSpec
from pytest_kvconform.regressions import REGRESSION_SCENARIOS
from pytest_kvconform.rejections import Rejected
from pytest_kvconform.requirements import Declines
from pytest_kvconform.scenario import Scenario, load_scenario

GRANITE = "granite-4.0-h-tiny"  # hybrid: block 400, 10 groups of 4 (4 attention, 36 Mamba2 layers)


def backend_overriding(method: str, fn: Callable[..., Any]) -> ReferenceBackend:
    """A backend answering ``method`` with ``fn`` (and no longer declining its family)."""
    family = next(f for f, methods in RULE_FAMILIES.items() if method in methods)
    body = {method: fn, "name": f"override-{method}", "declines": ReferenceBackend.declines.without(family)}
    return type(f"Override_{method}", (ReferenceBackend,), body)()


def _more_conv_rows(self: Any, scenario: Scenario) -> Any:
    (rows, dim), *rest = ReferenceBackend.state_shapes(self, scenario)
    return ((rows + 1, dim), *rest)


def _one_attention_layer_fewer(self: Any, scenario: Scenario) -> Any:
    specs = ReferenceBackend.layer_specs(self, scenario)
    first = next(name for name, spec in specs.items() if not isinstance(spec, MambaSpec))
    return {name: spec for name, spec in specs.items() if name != first}


def _pad_to_max(self: Any, specs: Any, scenario: Scenario) -> Any:
    return ReferenceBackend.unify_page_sizes(self, specs, scenario.with_runtime(unify_policy="pad-to-max"))


def _double_blocks(self: Any, specs: Any, scenario: Scenario) -> Any:
    return [dataclasses.replace(g, blocks_per_request=2 * g.blocks_per_request)
            for g in ReferenceBackend.kv_cache_groups(self, specs, scenario)]  # fmt: skip


#: method -> (scenario, the override, the plan field it must move)
OVERRIDES: dict[str, tuple[str, Callable[..., Any], str]] = {
    "align_hybrid_block_size": (
        GRANITE, lambda self, scenario: ReferenceBackend.align_hybrid_block_size(
            self, scenario.with_runtime(kernel_block_alignment=32)), "block_size",
    ),
    "choose_block_size": (
        GRANITE, lambda self, scenario: BlockChoice(416, scenario.runtime.max_model_len, 416 * 2048),
        "block_size",
    ),
    "state_shapes": (GRANITE, _more_conv_rows, "state_bytes_per_layer"),
    # a platform hook that halves the budget; a worker whose probe reports half of it
    "check_and_update_config": (
        GRANITE, lambda self, scenario: scenario.with_runtime(
            kv_cache_memory_bytes=scenario.runtime.kv_cache_memory_bytes // 2), "num_blocks",
    ),
    "determine_available_memory": (
        GRANITE, lambda self, scenario: scenario.runtime.kv_cache_memory_bytes // 2, "num_blocks"
    ),
    "state_page_bytes": (
        GRANITE, lambda self, spec, scenario: spec.page_size_bytes + 1, "state_bytes_per_layer"
    ),
    # 3 attention + 36 Mamba layers: groups of 3, so 1 + 12 groups instead of 10
    "layer_specs": (GRANITE, _one_attention_layer_fewer, "kv_cache_groups"),
    "attention_page_bytes": (
        GRANITE, lambda self, spec, scenario: 2 * spec.page_size_bytes, "attn_bytes_per_token_per_layer"
    ),
    "max_memory_usage_bytes": (
        GRANITE, lambda self, spec, scenario: 2 * spec.max_memory_usage_bytes(scenario.runtime),
        "needed_bytes",
    ),
    # the probe asks for lcm (12,648,800 B pages); pad-to-max keeps the 12,648,448 B state page
    "unify_page_sizes": (
        str(REGRESSION_SCENARIOS / "turboquant-lcm-probe.toml"), _pad_to_max, "page_size_bytes"
    ),
    "kv_cache_groups": (GRANITE, _double_blocks, "needed_bytes"),
    "check_memory": (
        GRANITE, lambda self, specs, scenario: dataclasses.replace(
            ReferenceBackend.check_memory(self, specs, scenario), num_blocks=1), "num_blocks",
    ),
    "estimate_max_model_len": (
        GRANITE, lambda self, specs, available, scenario: 1, "max_model_len_estimate"
    ),
    "one_sequence_bytes": (
        GRANITE, lambda self, block_size, padded, scenario: 1, "one_sequence_bytes"
    ),
    "kernel_block_size": (GRANITE, lambda self, block_size, scenario=None: 8, "kernel_block_size"),
}  # fmt: skip

#: Rule methods no plan field reads: a dtype table, the block-table layout, the allocation of an
#: already planned pool and where its tensors sit, a vLLM platform's hook checks and the kernel's
#: block alignment (the scenario a backend is served at; they have suites of their own).
NOT_IN_A_PLAN = {"kv_cache_dtype_bytes", "build_block_tables", "allocate_kv_cache", "check_kv_cache_config",
                 "kv_cache_tensors", "kv_cache_views", "kernel_cache_views", "engine", "rerun_hooks",
                 "kernel_block_alignment"}  # fmt: skip


#: rule methods of a plan step whose answer no plan field shows: only a refusal moves the plan
REFUSALS_ONLY = {"kernel_block_sizes"}


def test_every_rule_method_is_covered() -> None:
    methods = {m for family in RULE_FAMILIES.values() for m in family} - {"plan"}
    assert methods == set(OVERRIDES) | NOT_IN_A_PLAN | REFUSALS_ONLY


def test_a_kernel_block_refusal_rejects_the_plan() -> None:
    """A backend whose runner serves no kernel block for the attention group (here: a kernel of
    multiples of 32 under Granite's block 400, 400 = 12.5 x 32) has no plan; its trace records
    the refusal at that step."""

    class Kernel32(ReferenceBackend):
        def kernel_block_sizes(self, groups: Any, scenario: Any) -> list[int]:
            return ReferenceBackend.kernel_block_sizes(
                self, groups, scenario.with_runtime(kernel_block_alignment=32)
            )

    scenario = load_scenario(GRANITE)
    with pytest.raises(ValueError, match="No common block size for 400"):
        Kernel32().plan(scenario)


@pytest.mark.parametrize("method", list(OVERRIDES))
def test_overriding_one_rule_moves_the_plan(method: str) -> None:
    name, fn, field = OVERRIDES[method]
    scenario = load_scenario(name)
    if method == "estimate_max_model_len":  # the estimate is reported when admission fails
        scenario = scenario.with_runtime(kv_cache_memory_bytes=64 << 20)
    expected = reference_plan(scenario).to_dict()
    got = backend_overriding(method, fn).plan(scenario).to_dict()
    assert got[field] != expected[field], f"{method}: plan.{field} did not move ({got[field]})"


def test_an_offline_gap_takes_the_reference_answer_and_is_traced() -> None:
    class Declines(ReferenceBackend):
        name = "declines"

        def kernel_block_size(self, block_size: int, scenario: Any = None) -> int:
            raise OfflineGap("cpu_build", "this host has no paged kernel")

    scenario = load_scenario(GRANITE)
    trace = Declines().trace(scenario)
    assert trace.plan == reference_plan(scenario)
    # the reference declares no platform and no pool: those steps are the reference's too
    assert {s.family for s in trace.by("reference")} == {"platform", "kernel_block", "allocation"}
    [declined] = [s for s in trace.by("reference") if s.family == "kernel_block"]
    assert declined.method == "kernel_block_size"
    assert (
        declined.reason.startswith("cannot run here: ") and "this host has no paged kernel" in declined.reason
    )
    assert {s.method for s in trace.by("inherited")} >= {"layer_specs", "kv_cache_groups", "check_memory"}


def test_a_declined_rule_is_answered_by_the_reference() -> None:
    class NoEstimate(ReferenceBackend):
        name = "no-estimate"
        declines = Declines({"one_sequence": "no such rule on this hardware"})

        def one_sequence_bytes(self, block_size: int, padded: Any, scenario: Any) -> int:
            raise AssertionError("must not be called")

    scenario = load_scenario(GRANITE)
    trace = NoEstimate().trace(scenario)
    assert trace.plan == reference_plan(scenario)
    assert [str(s) for s in trace.by("reference") if s.family == "one_sequence"] == [
        "one_sequence.one_sequence_bytes: reference (does not provide one_sequence: "
        "no such rule on this hardware)"
    ]


def test_a_rejection_is_the_plans_rejection_and_kernel_block_is_zero() -> None:
    class NoKernel(ReferenceBackend):
        name = "no-kernel"

        def kernel_block_size(self, block_size: int, scenario: Any = None) -> int:
            raise Rejected("unsupported_block_size", "no kernel block divides it")

    plan = NoKernel().plan(load_scenario(GRANITE))
    assert (plan.kernel_block_size, plan.kernel_blocks_per_block) == (0, 0)

    class RejectsSpecs(ReferenceBackend):
        name = "rejects"

        def layer_specs(self, scenario: Scenario) -> Any:
            raise NotImplementedError(
                "The page size of the layer is not divisible by the maximum page size. "
                "Cannot unify by adjusting block_size."
            )  # vLLM's unify_kv_cache_spec_page_size

    with pytest.raises(NotImplementedError, match="Cannot unify"):
        RejectsSpecs().plan(load_scenario(GRANITE))


def test_an_error_of_no_rejection_kind_is_a_crash_naming_the_rule() -> None:
    """A ``ValueError`` whose message is no refusal vLLM knows is not a rejection: it used to be
    the plan's answer, so any backend raising any ValueError agreed with a rejecting reference."""

    class NoKernel(ReferenceBackend):
        name = "no-kernel"

        def kernel_block_size(self, block_size: int, scenario: Any = None) -> int:
            raise ValueError("no kernel block divides it")

    with pytest.raises(RuleError, match=r"^\[kernel_block\] backend 'no-kernel'.kernel_block_size raised"):
        NoKernel().plan(load_scenario(GRANITE))


def test_anything_else_is_a_rule_error_naming_the_rule() -> None:
    class Broken(ReferenceBackend):
        name = "broken"

        def state_page_bytes(self, spec: MambaSpec, scenario: Scenario) -> int:
            raise RuntimeError("kernel library failed to load")

    with pytest.raises(RuleError) as info:
        Broken().plan(load_scenario(GRANITE))
    assert str(info.value).startswith(
        "[state_page] backend 'broken'.state_page_bytes raised on scenario 'ibm-granite/granite-4.0-h-tiny'"
    )
    assert str(info.value).endswith("RuntimeError: kernel library failed to load")
