"""The reference's answer to every rule family, as one object with one method per rule.

:class:`ReferenceRules` is the method-per-rule face of the reference modules; it is what
:func:`~pytest_kvconform.reference.plan.compose_plan` composes, and what
:class:`~pytest_kvconform.backends.base.ReferenceBackend` (and through it every backend)
inherits. Standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from ..model import HybridAlignment, KVCacheGroup, MemoryCheck
from ..scenario import RuntimeSettings, Scenario
from . import dtypes, hybrid, memory, metal
from .grouping import get_kv_cache_groups
from .layers import layer_specs
from .mamba import Shapes, state_shapes
from .specs import AttentionSpec, KVCacheSpec, MambaSpec
from .unify import unify_page_sizes


class ReferenceRules:
    """vLLM 0.33.0 core rules plus vllm-metal's own (one-sequence bytes, kernel blocks)."""

    #: The page-unification policy followed; None: the scenario's ``unify_policy``.
    unify_policy: ClassVar[str | None] = None

    def policy_for(self, scenario: Scenario) -> str:
        return self.unify_policy or scenario.runtime.unify_policy

    # -- dtype
    def kv_cache_dtype_bytes(self, kv_cache_dtype: str, model_dtype: str) -> int:
        return dtypes.kv_cache_dtype_bytes(kv_cache_dtype, model_dtype)

    # -- attention_page / state_page / max_memory
    def attention_page_bytes(self, spec: AttentionSpec) -> int:
        return spec.page_size_bytes

    def state_shapes(self, scenario: Scenario) -> Shapes:
        model, rt = scenario.model, scenario.runtime
        if model is None or model.state is None:
            raise ValueError(f"{scenario.name}: no state layers")
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
        block, padded = hybrid.block_and_padding(scenario, hybrid.hybrid_alignment(scenario))
        return metal.one_sequence_kv_bytes(scenario, block, padded)

    # -- kernel_block (vllm-metal)
    def kernel_block_size(self, block_size: int) -> int:
        return metal.pick_kernel_block_size(block_size)

    def build_block_tables(
        self, rows: Sequence[Sequence[int]], block_size: int
    ) -> tuple[list[list[int]], int]:
        return metal.build_block_tables(rows, block_size)

    # -- the per-layer specs the other rules take as input (not a rule of its own)
    def layer_specs(self, scenario: Scenario) -> dict[str, KVCacheSpec]:
        return layer_specs(scenario, self.align_hybrid_block_size(scenario))
