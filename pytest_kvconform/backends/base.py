"""The backend protocol and the reference backend every other backend is checked against.

A backend answers one method per rule family. The :class:`ReferenceBackend` answers them
all from :mod:`pytest_kvconform.reference`; a third-party backend subclasses it and
overrides the rules its hardware computes itself, inheriting the rest. A rule a backend
does not provide is listed in ``not_provided`` with the reason, and its tests skip.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from ..model import HybridAlignment, KVCacheGroup, KVPlan, MemoryCheck
from ..reference import VLLM_TARGET, dtypes, hybrid, memory, metal
from ..reference import plan as reference_plan
from ..reference.grouping import get_kv_cache_groups
from ..reference.layers import layer_specs
from ..reference.mamba import Shapes, state_shapes
from ..reference.specs import AttentionSpec, KVCacheSpec, MambaSpec
from ..reference.unify import unify_page_sizes
from ..scenario import RuntimeSettings, Scenario

#: Rule families, in report order. Each names the backend method(s) that answer it.
RULE_FAMILIES: dict[str, tuple[str, ...]] = {
    "dtype": ("kv_cache_dtype_bytes",),
    "attention_page": ("attention_page_bytes",),
    "state_page": ("state_shapes", "state_page_bytes"),
    "max_memory": ("max_memory_usage_bytes",),
    "hybrid_alignment": ("align_hybrid_block_size",),
    "unification": ("unify_page_sizes",),
    "grouping": ("kv_cache_groups",),
    "memory": ("check_memory", "estimate_max_model_len"),
    "one_sequence": ("one_sequence_bytes",),
    "kernel_block": ("kernel_block_size", "build_block_tables"),
    "plan": ("plan",),
}


class ReferenceBackend:
    """The reference rules as a backend (vLLM 0.33.0 core + vllm-metal's own rules)."""

    name: ClassVar[str] = "reference"
    #: Features beyond sizing arithmetic, for ``requires_capability``: "allocation", "paged_attention".
    capabilities: ClassVar[frozenset[str]] = frozenset()
    #: Rule family -> why this backend does not provide it (its tests skip with the reason).
    not_provided: ClassVar[Mapping[str, str]] = {}
    #: The page-unification policy this backend follows; None: the scenario's ``unify_policy``.
    unify_policy: ClassVar[str | None] = None

    @property
    def version(self) -> str:
        return f"reference rules of vLLM {VLLM_TARGET}"

    def policy_for(self, scenario: Scenario) -> str:
        return self.unify_policy or scenario.runtime.unify_policy

    def unsupported(self, scenario: Scenario) -> str | None:
        """Why this backend cannot model ``scenario`` at all, or None.

        Generated (hypothesis) scenarios a backend rejects here are discarded, not failed;
        packaged scenarios are still run, and their departures belong in ``known_failures``.
        """
        return None

    # -- dtype
    def kv_cache_dtype_bytes(self, kv_cache_dtype: str, model_dtype: str) -> int:
        return dtypes.kv_cache_dtype_bytes(kv_cache_dtype, model_dtype)

    # -- attention_page / state_page / max_memory
    def attention_page_bytes(self, spec: AttentionSpec) -> int:
        return spec.page_size_bytes

    def state_shapes(self, scenario: Scenario) -> Shapes:
        model, rt = scenario.model, scenario.runtime
        assert model is not None and model.state is not None
        return state_shapes(model.state, rt.tensor_parallel_size, rt.num_speculative_tokens)

    def state_page_bytes(self, spec: MambaSpec) -> int:
        return spec.page_size_bytes

    def max_memory_usage_bytes(self, spec: KVCacheSpec, runtime: RuntimeSettings) -> int:
        return spec.max_memory_usage_bytes(runtime)

    # -- hybrid_alignment
    def align_hybrid_block_size(self, scenario: Scenario) -> HybridAlignment | None:
        return hybrid.hybrid_alignment(scenario)

    # -- unification
    def unify_page_sizes(self, specs: dict[str, KVCacheSpec], policy: str) -> dict[str, KVCacheSpec]:
        return unify_page_sizes(specs, policy)

    # -- grouping
    def kv_cache_groups(
        self, specs: dict[str, KVCacheSpec], runtime: RuntimeSettings, policy: str
    ) -> list[KVCacheGroup]:
        return [g.public(runtime) for g in get_kv_cache_groups(specs, policy)]

    # -- memory
    def check_memory(
        self, specs: dict[str, KVCacheSpec], runtime: RuntimeSettings, policy: str
    ) -> MemoryCheck:
        return memory.check_memory(get_kv_cache_groups(specs, policy), runtime)

    def estimate_max_model_len(
        self, specs: dict[str, KVCacheSpec], runtime: RuntimeSettings, available: int, policy: str
    ) -> int:
        return memory.estimate_max_model_len(get_kv_cache_groups(specs, policy), runtime, available)

    # -- one_sequence (vllm-metal)
    def one_sequence_bytes(self, scenario: Scenario) -> int:
        alignment = hybrid.hybrid_alignment(scenario)
        block = alignment.block_size if alignment is not None else scenario.runtime.block_size
        padded = alignment.state_page_padded_bytes if alignment is not None else None
        return metal.one_sequence_kv_bytes(scenario, block, padded)

    # -- kernel_block (vllm-metal)
    def kernel_block_size(self, block_size: int) -> int:
        return metal.pick_kernel_block_size(block_size)

    def build_block_tables(
        self, rows: Sequence[Sequence[int]], block_size: int
    ) -> tuple[list[list[int]], int]:
        return metal.build_block_tables(rows, block_size)

    # -- plan
    def plan(self, scenario: Scenario) -> KVPlan:
        return reference_plan(scenario)

    # -- helpers shared by the suites
    def layer_specs(self, scenario: Scenario) -> dict[str, KVCacheSpec]:
        """The reference's per-layer specs (inputs for the spec-level rules; not a rule)."""
        return layer_specs(scenario, hybrid.hybrid_alignment(scenario))
