"""The reference's answer to every rule family, as one object with one method per rule.

:class:`ReferenceRules` is the method-per-rule face of the reference modules; it is what
:func:`~pytest_kvconform.reference.plan.compose_plan` composes, and what
:class:`~pytest_kvconform.backends.base.ReferenceBackend` (and through it every backend)
inherits. Every rule that builds on another calls it through ``self``: a subclass overriding
one rule (``choose_block_size``, ``state_shapes``, ``unify_page_sizes``,
``max_memory_usage_bytes``, ``kv_cache_groups`` ...) sees its answer reach the specs, the groups,
the memory check and the plan.

Every rule method takes the scenario it answers for as the keyword argument ``scenario``
(``None`` only for the scenario-free tables: dtype bytes, kernel blocks of a block size).
Standard library only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar

from ..model import (
    BlockChoice,
    HybridAlignment,
    KVCacheGroup,
    KVCacheTensorPlacement,
    KVCacheView,
    KVPlan,
    MemoryCheck,
    PoolAllocation,
)
from ..rejections import Rejected
from ..scenario import Scenario
from . import defaults, dtypes, hybrid, memory, metal, selection
from .grouping import GroupSpec, get_kv_cache_groups, unify_hybrid_kv_cache_specs
from .layers import layer_specs
from .mamba import Shapes, state_shapes
from .parallel import pipeline_stages
from .placement import kv_cache_tensor_slots, kv_cache_tensors, kv_cache_views, kv_cache_views_by_backend
from .plan import PlanTrace, compose_plan
from .releases import LATEST, RuleSet
from .specs import AttentionSpec, KVCacheSpec, MambaSpec, cdiv
from .speculative import with_retained_tokens
from .unify import unify_page_sizes

T = TypeVar("T")


def at_length(scenario: Scenario, max_model_len: int) -> Scenario:
    """``scenario`` served at another ``max_model_len`` (the estimate's binary search)."""
    return dataclasses.replace(
        scenario, runtime=dataclasses.replace(scenario.runtime, max_model_len=max_model_len)
    )


class ReferenceRules:
    """vLLM core rules (those of :attr:`release`; 0.33.0 by default) plus vllm-metal's own
    (one-sequence bytes, kernel blocks)."""

    #: The vLLM release whose rules answer (``--kvconform-vllm``); see :mod:`.releases`.
    release: RuleSet = LATEST

    #: The page-unification policy followed; None: the scenario's ``unify_policy``.
    unify_policy: ClassVar[str | None] = None

    #: this very class answers as the reference (not a subclass: see ``provenance.is_oracle``)
    _kvconform_oracle: ClassVar[bool] = True

    def prepare(self, scenario: Scenario) -> None:
        """Set-up that produces no answer (importing a runtime, building an engine), run before
        each watched rule call (:mod:`pytest_kvconform.provenance` watches the call's returns,
        which costs time); errors here must wait for the rule call itself. The reference has none."""

    def policy_for(self, scenario: Scenario) -> str:
        return self.unify_policy or scenario.runtime.unify_policy

    # -- dtype
    def kv_cache_dtype_bytes(
        self, kv_cache_dtype: str, model_dtype: str, scenario: Scenario | None = None
    ) -> int:
        registered = scenario.runtime.registered_kv_cache_dtypes if scenario is not None else ()
        return dtypes.kv_cache_dtype_bytes(kv_cache_dtype, model_dtype, registered, self.release)

    # -- platform: the engine's defaults for what the scenario leaves unset, then the platform's hook
    def engine_defaults(self, scenario: Scenario) -> Scenario:
        """What ``vllm serve`` of :attr:`release` sets for the settings the scenario file leaves
        unset (``mamba_cache_mode`` from the prefix-caching default, ``max_concurrent_batches``
        from the async-scheduling default; :mod:`.defaults`, docs/engine-defaults.md): the
        scenario with those values, ``defaults_applied`` naming each and the vLLM function that
        sets it. A scenario stating every setting is returned as it is."""
        return defaults.engine_defaults(scenario, self.release)[0]

    def with_engine_defaults(self, scenario: Scenario) -> Scenario:
        """``scenario`` as this object's :meth:`engine_defaults` completes it (itself when it
        states every setting): every rule below that reads such a setting answers for it, so a
        rule asked on its own answers as the engine would, as in a plan."""
        if not scenario.runtime.unset:
            return scenario
        return _last(
            self, "defaults", (scenario, self.release), lambda: self.engine_defaults(scenario=scenario)
        )

    def kernel_block_alignment(self, scenario: Scenario) -> int:
        """The kernel block alignment of the attention kernel that serves ``scenario`` (vLLM: the
        smallest of ``AttentionBackend.get_supported_kernel_block_sizes``, which
        ``Platform._align_hybrid_block_size`` aligns to): the scenario's ``kernel_block_alignment``,
        the hardware it was written for. A backend whose attention kernel declares its own
        answers that; the reference then plans the scenario at it. A config the release refuses
        has no backend."""
        selection.refuse_config(scenario, self.release)
        return scenario.runtime.kernel_block_alignment

    # -- platform: the platform's config hook (vLLM core's neutral Platform changes nothing)
    def check_and_update_config(self, scenario: Scenario) -> Scenario:
        """``Platform.check_and_update_config`` (vllm/platforms/interface.py): the scenario as the
        platform leaves the config; the neutral platform leaves it as given (a config the release
        refuses is never built)."""
        selection.refuse_config(scenario, self.release)
        return scenario

    # -- hybrid_alignment: Phase 2 of update_block_size_for_backend
    def align_hybrid_block_size(self, scenario: Scenario) -> HybridAlignment | None:
        scenario = self.with_engine_defaults(scenario)
        return _last(
            self, "align", (scenario, self.release), lambda: hybrid.hybrid_alignment(scenario, self.release)
        )

    # -- block_size: the cache config after update_block_size_for_backend
    def choose_block_size(self, scenario: Scenario) -> BlockChoice:
        scenario = self.with_engine_defaults(scenario)
        alignment = self.align_hybrid_block_size(scenario=scenario)
        return _last(
            self, "choice", (scenario, alignment, self.release),
            lambda: hybrid.block_choice(scenario, alignment, self.release),
        )  # fmt: skip

    def kernel_block_sizes(self, groups: Sequence[KVCacheGroup], scenario: Scenario) -> list[int]:
        """Each group's kernel block, or the engine's refusal of the block
        (:func:`~.selection.kernel_block_sizes`) at :meth:`kernel_block_alignment`. A spec-level
        scenario names no attention backend: its blocks are taken as served."""
        if scenario.is_spec_level:
            return [g.block_size for g in groups]
        return selection.kernel_block_sizes(groups, self.kernel_block_alignment(scenario))

    # -- state_page
    def state_shapes(self, scenario: Scenario) -> Shapes:
        model, rt = scenario.model, scenario.runtime
        if model is None or model.state is None:
            raise ValueError(f"{scenario.name}: no state layers")
        selection.refuse_before_sizing(scenario, self.release)  # no engine, no layer to ask
        return state_shapes(model.state, rt.tensor_parallel_size, rt.num_speculative_tokens, self.release)

    def state_page_bytes(self, spec: MambaSpec, scenario: Scenario) -> int:
        return spec.page_size_bytes

    # -- layer_specs: what the worker's get_kv_cache_spec reports
    def layer_specs(self, scenario: Scenario) -> dict[str, KVCacheSpec]:
        scenario = self.with_engine_defaults(scenario)
        model = scenario.model
        has_state = model is not None and model.state is not None
        return layer_specs(
            scenario, choice=self.choose_block_size(scenario=scenario),
            shapes=self.state_shapes(scenario=scenario) if has_state else None, release=self.release,
        )  # fmt: skip

    # -- attention_page / max_memory
    def attention_page_bytes(self, spec: AttentionSpec, scenario: Scenario) -> int:
        return spec.page_size_bytes

    def max_memory_usage_bytes(self, spec: KVCacheSpec, scenario: Scenario) -> int:
        """``spec.max_memory_usage_bytes``; before ``in_flight_tokens`` (vLLM 0.26) windowed layers
        hold ``max_num_batched_tokens`` new tokens, not ``max_concurrent_batches`` times as many."""
        rt = self.with_engine_defaults(scenario).runtime
        if rt.max_concurrent_batches != 1 and not self.release.has("in_flight_tokens"):
            rt = dataclasses.replace(rt, max_concurrent_batches=1)
        return spec.max_memory_usage_bytes(rt)

    # -- unification
    def unify_page_sizes(self, specs: dict[str, KVCacheSpec], scenario: Scenario) -> dict[str, KVCacheSpec]:
        return unify_page_sizes(specs, self.policy_for(scenario), self.release)

    # -- grouping
    def kv_cache_groups(self, specs: dict[str, KVCacheSpec], scenario: Scenario) -> list[KVCacheGroup]:
        # A plan asks for the groups of the same specs up to three times (groups, memory check,
        # estimate): the last answer is kept while it is for these very objects.
        return list(
            _last(self, "groups", (specs, scenario, self.release), lambda: self._groups(specs, scenario))
        )

    def _group_specs(self, specs: dict[str, KVCacheSpec], scenario: Scenario) -> list[GroupSpec]:
        # get_kv_cache_configs tags sliding-window specs with the speculative retained tokens first
        tagged = with_retained_tokens(specs, scenario, self.release)
        if scenario.runtime.disable_hybrid_kv_cache_manager:  # get_kv_cache_groups does this first
            tagged = unify_hybrid_kv_cache_specs(tagged, self.release)
        return get_kv_cache_groups(
            tagged, unify=lambda s: self.unify_page_sizes(s, scenario=scenario),
            fallback=self.release.has("full_allocation_fallback"),
        )  # fmt: skip

    def _groups(self, specs: dict[str, KVCacheSpec], scenario: Scenario) -> list[KVCacheGroup]:
        def pages(spec: KVCacheSpec) -> int:
            return cdiv(self.max_memory_usage_bytes(spec, scenario=scenario), spec.page_size_bytes)

        return [g.public(scenario.runtime, pages) for g in self._group_specs(specs, scenario)]

    def kv_cache_tensors(
        self, specs: dict[str, KVCacheSpec], num_blocks: int, scenario: Scenario
    ) -> tuple[KVCacheTensorPlacement, ...]:
        """``get_kv_cache_configs``' ``kv_cache_tensors`` for a pool of ``num_blocks`` blocks
        (:mod:`.placement`: from vLLM 0.29, ``kv_cache_tensor_placement``, offsets and strides in
        the engine's layout; before, one tensor per layer slot)."""
        groups = self._group_specs(specs, scenario)
        if not self.release.has("kv_cache_tensor_placement"):
            return kv_cache_tensor_slots(groups, num_blocks)
        return kv_cache_tensors(groups, num_blocks)

    def kv_cache_views(
        self, specs: dict[str, KVCacheSpec], num_blocks: int, scenario: Scenario
    ) -> tuple[KVCacheView, ...]:
        """Each layer's ``[B, H, N, C]`` view of that pool, as the runner's ``allocate_kv_cache``
        makes it in the engine's layout (:func:`.placement.kv_cache_views`; vLLM 0.29+); in 0.23 to
        0.25, as the runner's ``_reshape_kv_cache_tensors`` makes it through each layer's attention
        backend (:func:`.placement.kv_cache_views_by_backend`); 0.26 to 0.28 not modelled."""
        groups = self._group_specs(specs, scenario)
        if self.release.has("kv_cache_tensor_placement"):
            return kv_cache_views(groups, num_blocks)
        if self.release.has("attention_kv_cache_bhnc"):
            raise Rejected(
                "not_modelled", "the KV cache views of vLLM 0.26 to 0.28 (attention_kv_cache_bhnc)"
            )
        return kv_cache_views_by_backend(groups, num_blocks)

    # -- memory
    def determine_available_memory(self, device_free_bytes: int | None = None, *, scenario: Scenario) -> int:
        """``Worker.determine_available_memory`` (vllm/v1/worker/gpu_worker.py): the bytes the
        worker reports for the KV cache, here the scenario's budget: with ``kv_cache_memory_bytes``
        set, vLLM returns it whatever the device has free (``device_free_bytes``). An engine that
        refuses the scenario before sizing has no worker to ask."""
        selection.refuse_before_sizing(scenario, self.release)
        return scenario.runtime.kv_cache_memory_bytes

    def check_memory(self, specs: dict[str, KVCacheSpec], scenario: Scenario) -> MemoryCheck:
        """``get_kv_cache_configs`` up to its admission check, for each worker: the budget
        (``kv_cache_memory_bytes``, or the override's blocks), the null block taken from it where
        the release does (0.29+: ``null_block_reserved``; :func:`.memory.admission_budget`), then
        ``_check_enough_kv_cache_memory`` on those bytes, whose estimate is asked for the very
        same bytes. With pipeline parallelism each stage's worker holds its own layers of every
        group (``_project_kv_cache_groups_to_worker``) and is checked in stage order; the first
        refusal is the engine's, else the stage with the fewest blocks sets everyone's
        ``num_blocks`` (its check is returned)."""
        stages = pipeline_stages(specs, scenario)
        rt = scenario.runtime
        if len(stages) > 1 and rt.auto_fit_max_model_len:
            raise Rejected("not_modelled", "auto-fit of max_model_len over pipeline stages is not modelled")
        checks = []
        for stage in stages:
            need = self._needed_bytes(specs, scenario, stage if len(stages) > 1 else None)

            def estimate(available: int, need: memory.NeededBytes = need) -> int:
                if len(stages) == 1:  # this object's rule, which a backend may override
                    return self.estimate_max_model_len(specs, available, scenario=scenario)
                return memory.estimate_max_model_len(need, rt, available)

            checks.append(memory.check_memory(
                need, rt, estimate,
                reserve_null_block=self.release.has("null_block_reserved"),
                kv_cache_memory_text=self.release.has("auto_fit_kv_cache_memory_text"),
            ))  # fmt: skip
        refused = next((c for c in checks if c.admission != "ok"), None)
        return refused or min(checks, key=lambda c: c.num_blocks)

    def estimate_max_model_len(
        self, specs: dict[str, KVCacheSpec], available: int, scenario: Scenario
    ) -> int:
        """``_estimate_max_model_len_from_groups(vllm_config, groups, available)``: the longest
        length whose need fits ``available``, exactly the bytes given. In every release (0.23 ...
        0.33) vLLM reserves nothing here: :meth:`check_memory` (``get_kv_cache_configs``) hands it
        a budget the null block was already taken from, where the release takes it."""
        return memory.estimate_max_model_len(self._needed_bytes(specs, scenario), scenario.runtime, available)

    def _needed_bytes(
        self, specs: dict[str, KVCacheSpec], scenario: Scenario, stage: frozenset[str] | None = None
    ) -> memory.NeededBytes:
        """``bytes_per_block`` and ``length -> bytes needed`` from this object's own groups, for
        the worker holding the layers of ``stage`` (all of them: None): the largest group's
        pages of those layers; a request needs blocks of every group, held there or not."""
        groups = self.kv_cache_groups(specs, scenario=scenario)
        if not groups:  # attention-free: memory.check_memory plans its one block
            return memory.NeededBytes(0, lambda length: 0)

        def held(g: KVCacheGroup) -> int:
            if stage is None:
                return g.bytes_per_block
            if g.kind == "uniform_type":  # its layers' own pages
                return sum(specs[n].page_size_bytes for n in g.layer_names if n in stage)
            return g.bytes_per_block // len(g.layer_names) * sum(n in stage for n in g.layer_names)

        per_block = max(held(g) for g in groups)

        def needed(length: int) -> int:
            at = groups if length == scenario.runtime.max_model_len else (
                self.kv_cache_groups(specs, scenario=at_length(scenario, length)))  # fmt: skip
            return per_block * sum(g.blocks_per_request for g in at)

        return memory.NeededBytes(per_block, needed)

    # -- one_sequence (vllm-metal)
    def one_sequence_bytes(self, block_size: int, state_page_padded: int | None, scenario: Scenario) -> int:
        return metal.one_sequence_kv_bytes(scenario, block_size, state_page_padded)

    # -- kernel_block (vllm-metal)
    def kernel_block_size(self, block_size: int, scenario: Scenario | None = None) -> int:
        return metal.pick_kernel_block_size(block_size)

    def build_block_tables(
        self, rows: Sequence[Sequence[int]], block_size: int, scenario: Scenario | None = None
    ) -> tuple[list[list[int]], int]:
        return metal.build_block_tables(rows, block_size)

    def kernel_cache_views(
        self, specs: dict[str, KVCacheSpec], num_blocks: int, scenario: Scenario | None = None
    ) -> tuple[KVCacheView, ...]:
        """Each paged layer's caches in a pool of ``num_blocks`` blocks as the Metal kernel reads
        them (:func:`.metal.kernel_cache_views`)."""
        return metal.kernel_cache_views(specs, num_blocks)

    # -- plan: every rule above, composed through this object
    def plan(self, scenario: Scenario) -> KVPlan:
        return compose_plan(self, scenario, reference_rules(self.release))

    def trace(self, scenario: Scenario) -> PlanTrace:
        """The plan of ``scenario`` as a trace of the engine's steps (:mod:`.plan`), each with
        its value, the function it mirrors and who answered."""
        trace = PlanTrace()
        compose_plan(self, scenario, reference_rules(self.release), trace)
        return trace

    # -- allocation: the reference's arithmetic of a pool (a real backend allocates it)
    def allocate_kv_cache(self, plan: KVPlan, num_blocks: int, scenario: Scenario) -> PoolAllocation:
        return PoolAllocation(num_blocks, plan.bytes_per_block, num_blocks * plan.bytes_per_block)

    def check_kv_cache_config(self, allocation: PoolAllocation, num_blocks: int, scenario: Scenario) -> None:
        """Reject an engine KV cache config of more blocks than the pool holds (vllm-metal #527,
        ``ModelCachePolicy.initialize_kv_cache``); fewer blocks are accepted."""
        if num_blocks > allocation.num_blocks:
            raise ValueError(metal.oversized_config_error(num_blocks, allocation.num_blocks))


def _last(rules: ReferenceRules, name: str, key: tuple[object, ...], compute: Callable[[], T]) -> T:
    """The last answer of ``rules`` named ``name`` while asked again with the very same objects
    (``key``, by identity): a plan asks for the block choice and the groups three times each. A
    subclass's override makes new objects, so it never reuses an answer of another input."""
    memo = rules.__dict__.get(f"_last_{name}")
    if (
        memo is not None
        and len(memo[0]) == len(key)
        and all(a is b for a, b in zip(memo[0], key, strict=True))
    ):
        return memo[1]  # type: ignore[no-any-return]
    answer = compute()
    rules.__dict__[f"_last_{name}"] = (key, answer)
    return answer


@functools.cache
def reference_rules(release: RuleSet | None = None) -> ReferenceRules:
    """The reference's rules of ``release`` (default: the newest rule set)."""
    rules = ReferenceRules()
    rules.release = release or LATEST
    return rules


def plan(scenario: Scenario) -> KVPlan:
    """The reference's plan of ``scenario`` (the newest rule set)."""
    return reference_rules().plan(scenario=scenario)
