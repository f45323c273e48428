"""The per-scenario comparisons of the conformance suite, as plain functions.

``pytest_kvconform/suites/test_kvconform_rules.py`` runs each of them as a test (one per
scenario); ``kvconform check`` runs them outside pytest (:func:`run_checks`). Each takes
``(backend, reference, scenario)`` and compares through :mod:`pytest_kvconform.conformance`; how
it ends (agreed, departed, declined, ...) is decided by :func:`pytest_kvconform.verdict.decide`,
for both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from . import provenance
from .conformance import (
    assert_same,
    assert_same_layers,
    assert_same_outcome,
    call_rule,
    message_view,
    numbers_apply,
    outcome,
    plan_outcome,
    plan_view,
    served,
)
from .model import KVPlan, MemoryCheck
from .reference.releases import LATEST
from .reference.specs import AttentionSpec, MambaSpec
from .reference.unify import POLICIES
from .rejections import rejection_kind
from .requirements import KnownDeparture, known_departures_for
from .scenario import REJECTS, Scenario, expected_value_matches
from .verdict import Departure, NotApplicable, Result, decide


def distinct(specs: dict[str, Any], kind: type) -> list[Any]:
    return list(dict.fromkeys(s for s in specs.values() if isinstance(s, kind)))


def reference_choice(reference: Any, scenario: Scenario) -> Any:
    """The reference's block choice; a scenario the engine refuses before it chooses one (its
    config, the model's construction: ``refuse_before_sizing``) has none to check against."""
    answer = outcome(reference, "choose_block_size", scenario=scenario)
    if answer[0] != "ok":
        raise NotApplicable(
            f"the engine refuses this scenario before it has a block ({answer[1]}); the plan compares that"
        )
    return answer[1]


def reference_specs(reference: Any, scenario: Scenario) -> dict[str, Any]:
    """The reference's layer specs; a scenario the reference rejects has none to hand on."""
    answer = outcome(reference, "layer_specs", scenario=scenario)
    if answer[0] != "ok":
        raise NotApplicable(
            f"the reference rejects this scenario's layers ({answer[1]}); test_layer_specs checks that"
        )
    return answer[1]  # type: ignore[no-any-return]


def hybrid_alignment(backend: Any, reference: Any, scenario: Scenario) -> None:
    expected = outcome(reference, "align_hybrid_block_size", scenario=scenario)
    if expected == ("ok", None):
        raise NotApplicable("not a hybrid attention + state model")
    got = outcome(backend, "align_hybrid_block_size", scenario=scenario)
    fields = ("block_size", "page_size_bytes", "state_page_padded_bytes", "attn_page_bytes_per_token",
              "state_page_bytes")  # fmt: skip
    assert_same_outcome("hybrid_alignment", backend, scenario, "hybrid_alignment", expected, got,
                        lambda answer: {f: getattr(answer, f, None) for f in fields})  # fmt: skip


def choose_block_size(backend: Any, reference: Any, scenario: Scenario) -> None:
    expected = outcome(reference, "choose_block_size", scenario=scenario)
    got = outcome(backend, "choose_block_size", scenario=scenario)
    assert_same_outcome("block_size", backend, scenario, "block_choice", expected, got)


def state_shapes_and_page(backend: Any, reference: Any, scenario: Scenario) -> None:
    if scenario.model is None or scenario.model.state is None:
        raise NotApplicable("no state layers")
    expected = outcome(reference, "state_shapes", scenario=scenario)
    got = outcome(backend, "state_shapes", scenario=scenario)
    if got[0] == "ok":
        got = ("ok", tuple(map(tuple, got[1])))
    assert_same_outcome("state_page", backend, scenario, "state_shapes", expected, got)
    specs = distinct(reference_specs(reference, scenario), MambaSpec)
    pages = [call_rule(backend, "state_page_bytes", s, scenario=scenario) for s in specs]
    want = [s.page_size_bytes for s in specs]
    assert_same("state_page", backend, scenario, {"state_page_bytes": want}, {"state_page_bytes": pages})


def layer_specs(backend: Any, reference: Any, scenario: Scenario) -> None:
    """The backend's own per-layer specs (its ``get_kv_cache_spec``), layer by layer."""
    expected = outcome(reference, "layer_specs", scenario=scenario)
    got = outcome(backend, "layer_specs", scenario=scenario)
    if expected[0] != "ok" or got[0] != "ok":
        assert_same_outcome("layer_specs", backend, scenario, "layer_specs", expected, got)
        return
    assert_same_layers(backend, scenario, expected[1], got[1])


def attention_page_bytes(backend: Any, reference: Any, scenario: Scenario) -> None:
    specs = distinct(reference_specs(reference, scenario), AttentionSpec)
    got = [call_rule(backend, "attention_page_bytes", s, scenario=scenario) for s in specs]
    want = [s.page_size_bytes for s in specs]
    assert_same("attention_page", backend, scenario, {"page_size_bytes": want}, {"page_size_bytes": got})


def max_memory_usage_bytes(backend: Any, reference: Any, scenario: Scenario) -> None:
    specs = list(dict.fromkeys(reference_specs(reference, scenario).values()))
    got = [call_rule(backend, "max_memory_usage_bytes", s, scenario=scenario) for s in specs]
    want = [reference.max_memory_usage_bytes(s, scenario=scenario) for s in specs]
    assert_same("max_memory", backend, scenario, {"max_memory_usage_bytes": want},
                {"max_memory_usage_bytes": got})  # fmt: skip


def _policies(backend: Any) -> tuple[str, ...]:
    fixed = getattr(backend, "unify_policy", None)
    return (fixed,) if fixed else POLICIES


def unify_page_sizes(backend: Any, reference: Any, scenario: Scenario) -> None:
    for policy in _policies(backend):
        s = scenario.with_runtime(unify_policy=policy)
        specs = reference_specs(reference, s)
        expected = outcome(reference, "unify_page_sizes", specs, scenario=s)
        got = outcome(backend, "unify_page_sizes", specs, scenario=s)
        assert_same_outcome(
            "unification",
            backend,
            s,
            policy,
            expected,
            got,
            lambda unified, policy=policy: {
                policy: {k: (v.block_size, v.page_size_bytes) for k, v in unified.items()}
            },
        )


def reference_groups_or_skip(reference: Any, specs: dict[str, Any], scenario: Scenario) -> list[Any]:
    """The reference's groups of ``specs``; not applicable when it rejects them (an older release
    that cannot unify them; ``test_kv_cache_groups`` compares that rejection) or has none."""
    answer = outcome(reference, "kv_cache_groups", specs, scenario=scenario)
    if answer[0] != "ok":
        raise NotApplicable(
            f"the reference rejects this scenario's groups ({answer[1]}); test_kv_cache_groups checks that"
        )
    if not answer[1]:
        raise NotApplicable("no KV cache groups (attention-free): the engine sizes no pool")
    return answer[1]


def kv_cache_groups(backend: Any, reference: Any, scenario: Scenario) -> None:
    specs = reference_specs(reference, scenario)
    answer = outcome(reference, "kv_cache_groups", specs, scenario=scenario)
    if answer[0] != "ok":
        got_answer = outcome(backend, "kv_cache_groups", specs, scenario=scenario)
        assert_same_outcome("grouping", backend, scenario, "groups", answer, got_answer)
        return
    expected = answer[1]
    got = call_rule(backend, "kv_cache_groups", specs, scenario=scenario)
    key = "groups (kind, layers)"
    shape = {key: [(g.kind, len(g.layer_names)) for g in expected]}
    assert_same("grouping", backend, scenario, shape, {key: [(g.kind, len(g.layer_names)) for g in got]})
    assert_same("grouping", backend, scenario, {"groups": expected}, {"groups": got})


#: the pool the tensor placement is compared at: a few blocks, as the allocation family asks
PLACEMENT_BLOCKS = 3


def placement_specs(reference: Any, scenario: Scenario, verb: str) -> tuple[dict[str, Any], list[Any]]:
    """The reference's specs and groups of a scenario whose pool one worker ``places`` or ``views``
    (not applicable with pipeline stages, nor where the reference has no groups)."""
    if scenario.runtime.pipeline_parallel_size > 1:
        raise NotApplicable(f"each pipeline stage's worker {verb} its own layers")
    specs = reference_specs(reference, scenario)
    return specs, reference_groups_or_skip(reference, specs, scenario)


def kv_cache_tensors(backend: Any, reference: Any, scenario: Scenario) -> None:
    """Each ``KVCacheTensor`` of a pool of a few blocks: its layers, where they begin and how far
    apart their blocks and layers are (vLLM 0.29+, ``kv_cache_tensor_placement``; before, one
    tensor per layer slot, shared by the slot's layer of each group)."""
    specs, _ = placement_specs(reference, scenario, "places")
    expected = call_rule(reference, "kv_cache_tensors", specs, PLACEMENT_BLOCKS, scenario=scenario)
    got = call_rule(backend, "kv_cache_tensors", specs, PLACEMENT_BLOCKS, scenario=scenario)
    assert_same(
        "grouping", backend, scenario, {"kv_cache_tensors": list(expected)}, {"kv_cache_tensors": list(got)}
    )


def kv_cache_views(backend: Any, reference: Any, scenario: Scenario) -> None:
    """Each layer's ``[B, H, N, C]`` view of that pool: its dtype, shape, strides and where it
    begins in the backing allocation (vLLM 0.29+, the runner's ``allocate_kv_cache``; before,
    its ``_reshape_kv_cache_tensors``, through each layer's attention backend)."""
    specs, groups = placement_specs(reference, scenario, "views")
    kernel_blocks = outcome(reference, "kernel_block_sizes", groups, scenario=scenario)
    if kernel_blocks[0] != "ok":  # the runner picks them before it allocates
        raise NotApplicable(
            f"the engine refuses this scenario's kernel blocks ({kernel_blocks[1]}); test_plan compares that"
        )
    expected = call_rule(reference, "kv_cache_views", specs, PLACEMENT_BLOCKS, scenario=scenario)
    got = call_rule(backend, "kv_cache_views", specs, PLACEMENT_BLOCKS, scenario=scenario)
    assert_same("grouping", backend, scenario, {"kv_cache_views": {v.layer: v for v in expected}},
                {"kv_cache_views": {v.layer: v for v in got}})  # fmt: skip


def kernel_cache_views(backend: Any, reference: Any, scenario: Scenario) -> None:
    """Each paged layer's caches as vllm-metal's kernel reads them, for the pages vLLM plans (the
    reference's specs, unified: a mixed sliding/full model's groups keep their own blocks, which
    vllm-metal's layout adopts) in a pool of a few blocks: dtype, shape (in kernel blocks) and
    strides (vllm-metal's ``sdpa_forward``)."""
    unified = outcome(reference, "unify_page_sizes", reference_specs(reference, scenario), scenario=scenario)
    if unified[0] != "ok":
        raise NotApplicable(
            f"the reference rejects this scenario's pages ({unified[1]}); test_unify_page_sizes checks that"
        )
    specs = unified[1]
    expected = outcome(reference, "kernel_cache_views", specs, PLACEMENT_BLOCKS, scenario=scenario)
    got = outcome(backend, "kernel_cache_views", specs, PLACEMENT_BLOCKS, scenario=scenario)
    assert_same_outcome("kernel_block", backend, scenario, "kernel_cache_views", expected, got,
                        lambda views: {"kernel_cache_views": {v.layer: v for v in views}})  # fmt: skip


def memory_view(check: MemoryCheck) -> dict[str, Any]:
    """A :class:`MemoryCheck` as compared: vLLM's texts by their kind and numbers (:func:`message_view`)."""
    view = {name: getattr(check, name) for name in MemoryCheck.__dataclass_fields__}
    view["admission"], view["auto_fit"] = message_view(check.admission), message_view(check.auto_fit)
    return view


def check_memory(backend: Any, reference: Any, scenario: Scenario) -> None:
    specs = reference_specs(reference, scenario)
    reference_groups_or_skip(reference, specs, scenario)
    expected = reference.check_memory(specs, scenario=scenario)
    got = call_rule(backend, "check_memory", specs, scenario=scenario)
    assert_same("memory", backend, scenario, memory_view(expected), memory_view(got))


def available_memory(backend: Any, reference: Any, scenario: Scenario) -> None:
    """The engine's budget is the budget: under ``--kv-cache-memory-bytes`` the worker's
    ``determine_available_memory`` returns that figure (vLLM core's ``Worker`` does,
    vllm/v1/worker/gpu_worker.py) while its device has twice as much free."""
    budget = scenario.runtime.kv_cache_memory_bytes
    if not budget:
        raise NotApplicable("no kv_cache_memory_bytes: the engine has no budget to keep")
    if outcome(reference, "layer_specs", scenario=scenario) == ("ok", {}):
        raise NotApplicable(
            "no layer holds a KV cache: the engine probes no memory (EngineCore._initialize_kv_caches)"
        )
    free = 2 * budget
    key = f"available bytes (device {free:,} B free)"
    expected = outcome(reference, "determine_available_memory", free, scenario=scenario)
    if expected[0] != "ok":
        raise NotApplicable(f"the engine refuses this scenario's config ({expected[1]}): no worker to "
                            "probe; test_plan compares the refusal")  # fmt: skip
    got = outcome(backend, "determine_available_memory", free, scenario=scenario)
    assert_same_outcome("memory", backend, scenario, key, expected, got, lambda answer: {key: answer})


#: fractions of the needed bytes the max_model_len estimate is compared at
FRACTIONS = (0.001, 0.5, 1.0)


def estimate_max_model_len(backend: Any, reference: Any, scenario: Scenario, fraction: float) -> None:
    specs = reference_specs(reference, scenario)
    reference_groups_or_skip(reference, specs, scenario)
    available = int(reference.check_memory(specs, scenario=scenario).needed_bytes * fraction)
    key = f"estimate_max_model_len({available} B)"
    expected = reference.estimate_max_model_len(specs, available, scenario=scenario)
    got = call_rule(backend, "estimate_max_model_len", specs, available, scenario=scenario)
    assert_same("memory", backend, scenario, {key: expected}, {key: got})


def one_sequence_bytes(backend: Any, reference: Any, scenario: Scenario) -> None:
    if scenario.is_spec_level:
        raise NotApplicable("the one-sequence estimate needs a model-level scenario")
    choice = reference_choice(reference, scenario)
    inputs = (choice.block_size, choice.state_page_padded)
    expected = reference.one_sequence_bytes(*inputs, scenario=scenario)
    got = call_rule(backend, "one_sequence_bytes", *inputs, scenario=scenario)
    assert_same("one_sequence", backend, scenario, {"one_sequence_bytes": expected},
                {"one_sequence_bytes": got})  # fmt: skip


def kernel_block_size(backend: Any, reference: Any, block_size: int) -> None:
    key = f"kernel_block_size({block_size})"
    expected = outcome(reference, "kernel_block_size", block_size)
    got = outcome(backend, "kernel_block_size", block_size)
    assert_same_outcome("kernel_block", backend, None, key, expected, got)


def plan(backend: Any, reference: Any, scenario: Scenario) -> None:
    """The backend's own composition: each step answered by its own rule, or the reference's
    where it declines (every step's answer is recorded with who gave it)."""
    expected = outcome(reference, "plan", scenario=scenario)
    got = plan_outcome(backend, scenario, reference)
    assert_same_outcome("plan", backend, scenario, "plan", expected, got, plan_view)


def expectations(backend: Any, reference: Any, scenario: Scenario) -> None:
    """The scenario file's own ``[expect]`` table (numbers its author derived) and the plan fields
    of its ``[expect.external]`` (public observations) against the backend's plan.

    Judged by an older release, a field of ``[expect.before.<change>]`` replaces its ``[expect]``
    value for every change of ``reference.releases.CHANGES`` the reference's release lacks
    (:meth:`~pytest_kvconform.scenario.Scenario.expect_for`); a table of ``rejects`` states that
    the plan is rejected, of that kind (``rejections.KINDS``). The numbers hold for the scenario's
    ``kernel_block_alignment``: a backend whose kernel declares another is not held to them.
    vLLM's texts (``admission``, ``auto_fit_message``) are compared by kind and numbers."""
    external = {k: v for k, v in scenario.expect_external.items() if k in KVPlan.field_names()}
    if not scenario.expect and not external:
        raise NotApplicable("no [expect] table")
    numbers_apply(backend, scenario, reference)
    expect = scenario.expect_for(getattr(reference, "release", LATEST))
    if REJECTS in expect:
        table, want = expect[REJECTS]
        answer = outcome(backend, "plan", scenario=scenario)
        have = answer[1] if answer[0] == "rejects" else "a plan"
        if have != want:
            message = (
                f"{scenario.source}: backend {backend.name!r}: {table}.{REJECTS}: expected {want!r}, "
                f"got {have!r}"
            )
            if answer[0] == "rejects":  # another refusal: the plan departs as a refused plan does
                want, have = f"rejects: {want}", f"rejects: {have}"
                raise Departure(message, "plan", "plan", want, have, pytrace=False)
            raise Departure(message, "plan", f"{table}.{REJECTS}", want, have, pytrace=False)
        return
    answer = call_rule(backend, "plan", scenario=scenario)
    got = {**{k: getattr(answer, k) for k in KVPlan.field_names()}, **answer.to_dict()}
    stated = [(table, k, v) for k, (table, v) in expect.items()]
    stated += [("expect.external", k, v) for k, v in external.items()]

    def view(key: str, value: Any) -> Any:
        return message_view(value) if key in ("admission", "auto_fit_message") else value

    shown = {k: view(k, v) for k, v in got.items()}
    wrong = [
        (f"{table}.{k}", v, shown[k])
        for table, k, v in stated
        if not expected_value_matches(view(k, v), shown[k])
    ]
    if wrong:
        message = f"{scenario.source}: backend {backend.name!r}: " + "; ".join(
            f"{field}: expected {want!r}, got {have!r}" for field, want, have in wrong
        )
        raise Departure(message, "plan", *wrong[0], pytrace=False)


# ----------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Check:
    """One per-scenario comparison: its rule family, the suite test that runs it (one per
    scenario, and per parameter when ``params``) and the function that compares. ``served``:
    the function gets the scenario as the backend serves it (:func:`~.conformance.served`), not
    as the file states it; ``independent``: it compares with numbers the reference did not give
    (the reference's self-check runs only those)."""

    rule: str
    test: str
    run: Callable[..., None]
    params: tuple[Any, ...] = ()
    served: bool = True
    independent: bool = False

    def __call__(self, backend: Any, reference: Any, scenario: Scenario, *params: Any) -> None:
        self.run(backend, reference, served(backend, scenario) if self.served else scenario, *params)


#: The per-scenario comparisons, in derivation order: ``pytest_kvconform/suites/
#: test_kvconform_rules.py`` makes one test of each, ``kvconform check`` runs each per scenario.
CHECKS: tuple[Check, ...] = (
    Check("hybrid_alignment", "test_hybrid_alignment", hybrid_alignment),
    Check("block_size", "test_choose_block_size", choose_block_size),
    Check("state_page", "test_state_shapes_and_page", state_shapes_and_page),
    Check("layer_specs", "test_layer_specs", layer_specs),
    Check("attention_page", "test_attention_page_bytes", attention_page_bytes),
    Check("max_memory", "test_max_memory_usage_bytes", max_memory_usage_bytes),
    Check("unification", "test_unify_page_sizes", unify_page_sizes),
    Check("grouping", "test_kv_cache_groups", kv_cache_groups),
    Check("grouping", "test_kv_cache_tensors", kv_cache_tensors),
    Check("grouping", "test_kv_cache_views", kv_cache_views),
    Check("kernel_block", "test_kernel_cache_views", kernel_cache_views),
    Check("memory", "test_available_memory", available_memory),
    Check("memory", "test_check_memory", check_memory),
    Check("memory", "test_estimate_max_model_len", estimate_max_model_len, FRACTIONS),
    Check("one_sequence", "test_one_sequence_bytes", one_sequence_bytes),
    Check("plan", "test_plan", plan),
    Check("plan", "test_expectations", expectations, served=False, independent=True),
)


def suite_test(check: Check) -> Callable[..., None]:
    """The suite's test of ``check``: marked with its rule, over ``kv_scenario`` (and its params)."""
    if check.params:

        @pytest.mark.parametrize("param", check.params)
        def test(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario, param: Any) -> None:
            check(kv_backend, kv_reference, kv_scenario, param)

    else:

        def test(kv_backend: Any, kv_reference: Any, kv_scenario: Scenario) -> None:  # type: ignore[misc]
            check(kv_backend, kv_reference, kv_scenario)

    test.__name__ = test.__qualname__ = check.test
    test.__doc__ = check.run.__doc__
    if check.independent:
        test = pytest.mark.kvconform_independent(test)
    return pytest.mark.kvconform_rule(check.rule)(test)  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- outside pytest


def scenario_id(scenario: Scenario) -> str:
    """The scenario's test id: its file's stem, ``<model directory>-config`` for one read from a
    model's config.json, else its name."""
    source = Path(scenario.source)
    if source.suffix == ".toml":
        return source.stem
    return f"{source.parent.name}-config" if source.name == "config.json" else scenario.name


@dataclass(frozen=True)
class Comparison:
    """One check of one scenario as pytest names it (``test_plan[granite-4.0-h-tiny]``, so
    known-departure globs apply), ready to run."""

    rule: str
    test: str
    run: Callable[[Any, Any, Scenario], None]


def scenario_checks(reference: Any, scenario: Scenario) -> list[Comparison]:
    """Every check of :data:`CHECKS` on ``scenario``, in derivation order, plus the kernel block
    at the reference's block of this scenario (the suite checks a fixed list of blocks)."""
    sid = scenario_id(scenario)
    out: list[Comparison] = []
    for check in CHECKS:
        if check.test == "test_plan":
            block = reference_block(reference, scenario)
            if block is not None:
                out.append(Comparison("kernel_block", f"test_kernel_block_size[{block}]",
                                      lambda b, r, s, n=block: kernel_block_size(b, r, n)))  # fmt: skip
        if check.params:
            out += [Comparison(check.rule, f"{check.test}[{sid}-{p}]",
                               lambda b, r, s, c=check, p=p: c(b, r, s, p))
                    for p in check.params]  # fmt: skip
        else:
            out.append(Comparison(check.rule, f"{check.test}[{sid}]", check))
    return out


def reference_block(reference: Any, scenario: Scenario) -> int | None:
    """The reference's block of ``scenario``, or None when the reference rejects the scenario
    (the plan check then compares the rejections)."""
    answer = provenance.ask(reference, "plan", scenario=scenario)
    if answer.error is not None and rejection_kind(answer.error) is None:
        raise answer.error
    return None if answer.error is not None else answer.value.block_size


def record(test: str, rule: str, scenario: str, result: Result, ledger: provenance.Ledger) -> dict[str, Any]:
    """One result of the report (``results``), as the suites and ``kvconform check`` write it."""
    return {"test": test, "rule": rule, "scenario": scenario, "verdict": result.verdict.value,
            "outcome": result.outcome, "message": result.strict_failure or result.message,
            "difference": dict(result.difference) if result.difference else None,
            "answers": ledger.counts(), "declined": ledger.declined_steps(),
            "generated": ledger.generated() if ledger.compared or ledger.declined or ledger.known_departures
            else None}  # fmt: skip


def run_check(
    check: Comparison,
    backend: Any,
    reference: Any,
    scenario: Scenario,
    known: Sequence[KnownDeparture] = (),
    strict: bool = False,
) -> dict[str, Any]:
    """Run one check and decide its verdict as the suites do (:func:`~.verdict.decide`); its
    record (:func:`record`). ``known``: known departures from outside the backend
    (``--kvconform-xfails``)."""
    entries = known_departures_for([*getattr(backend, "known_departures", ()), *known], check.rule,
                                   check.test, scenario)  # fmt: skip
    with provenance.ledger() as ledger:
        error: BaseException | None = None
        try:
            check.run(backend, reference, scenario)
        except (Exception, pytest.skip.Exception, pytest.fail.Exception) as exc:
            error = exc
    result = decide(
        rule=check.rule, error=error, answers=ledger.answers, backend=backend, known=entries, strict=strict,
    )  # fmt: skip
    return record(check.test, check.rule, scenario_id(scenario), result, ledger)


def run_checks(
    backend: Any,
    reference: Any,
    scenarios: Iterable[Scenario],
    known: Sequence[KnownDeparture] = (),
    strict: bool = False,
) -> list[dict[str, Any]]:
    """Every per-scenario check of every scenario, as records (:func:`run_check`); for the
    reference itself only the checks against independent numbers (its self-check)."""
    self_check = provenance.is_oracle(backend)
    independent = {c.test for c in CHECKS if c.independent}
    return [
        run_check(check, backend, reference, scenario, known, strict)
        for scenario in scenarios
        for check in scenario_checks(reference, scenario)
        if not self_check or check.test.partition("[")[0] in independent
    ]
