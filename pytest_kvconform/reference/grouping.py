"""KV cache groups: uniform, uniform-type, and uniform-page-size grouping.

Mirrors ``get_kv_cache_groups`` (v1/core/kv_cache_planning.py in vLLM 0.33.0,
v1/core/kv_cache_utils.py before), ``UniformTypeKVCacheSpecs`` (v1/kv_cache_interface.py)
and ``_get_kv_cache_groups_uniform_page_size``, for layer-outer layouts (the default).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from ..model import KVCacheGroup
from ..scenario import RuntimeSettings
from .specs import AttentionSpec, KVCacheSpec, cdiv
from .unify import unify_page_sizes


@dataclass(frozen=True)
class GroupSpec:
    """A group with the specs of its layers (the reference's ``KVCacheGroupSpec``)."""

    layer_names: tuple[str, ...]
    specs: tuple[KVCacheSpec, ...]
    uniform_type: bool = False

    @property
    def kind(self) -> str:
        return "uniform_type" if self.uniform_type else self.specs[0].kind

    @property
    def block_size(self) -> int:
        return self.specs[0].block_size

    @property
    def page_size_bytes(self) -> int:
        """The merged spec's page; ``UniformTypeKVCacheSpecs`` sums its layers' pages."""
        pages = [s.page_size_bytes for s in self.specs]
        return sum(pages) if self.uniform_type else pages[0]

    @cached_property
    def bytes_per_block(self) -> int:
        """``_get_kv_cache_bytes_per_block`` for one group of a layer-outer layout."""
        return sum(s.page_size_bytes for s in self.specs)

    @cached_property
    def _distinct_specs(self) -> tuple[KVCacheSpec, ...]:
        return tuple(dict.fromkeys(self.specs)) if self.uniform_type else self.specs[:1]

    def blocks_per_request(
        self, rt: RuntimeSettings, pages: Callable[[KVCacheSpec], int] | None = None
    ) -> int:
        """``cdiv(max_memory_usage_bytes, page)``; uniform-type groups take the max over layers
        (``UniformTypeKVCacheSpecs.max_memory_usage_pages``). ``pages`` replaces that count per spec."""
        pages = pages or (lambda s: cdiv(s.max_memory_usage_bytes(rt), s.page_size_bytes))
        return max(pages(s) for s in self._distinct_specs)

    def public(self, rt: RuntimeSettings, pages: Callable[[KVCacheSpec], int] | None = None) -> KVCacheGroup:
        return KVCacheGroup(
            kind=self.kind, block_size=self.block_size, page_size_bytes=self.page_size_bytes,
            layer_names=self.layer_names, bytes_per_block=self.bytes_per_block,
            blocks_per_request=self.blocks_per_request(rt, pages),
        )  # fmt: skip


def _type_key(spec: KVCacheSpec) -> tuple[object, ...]:
    """``uniform_type_base_spec``: MLA counts as full attention; windows and chunks must match."""
    if isinstance(spec, AttentionSpec):
        base = "full_attention" if spec.kind == "mla" else spec.kind
        return (base, spec.sliding_window, spec.attention_chunk_size)
    return ("mamba", spec.num_speculative_blocks, spec.num_prefill_checkpoint_blocks, spec.page_size_bytes)


def group_size_for(bucket_sizes: Sequence[int]) -> int:
    """``min`` of the bucket sizes, or ``max`` when ``max < 1.5 * min`` (fewer padding layers)."""
    lo, hi = min(bucket_sizes), max(bucket_sizes)
    return hi if hi < 1.5 * lo else lo


def get_kv_cache_groups(
    specs: dict[str, KVCacheSpec],
    policy: str = "pad-to-max",
    unify: Callable[[dict[str, KVCacheSpec]], dict[str, KVCacheSpec]] | None = None,
) -> list[GroupSpec]:
    """Group layers as vLLM's engine core does before planning the pool; ``unify`` replaces
    :func:`~.unify.unify_page_sizes` under ``policy``."""
    if not specs:
        return []
    names, values = tuple(specs), tuple(specs.values())
    distinct = tuple(dict.fromkeys(values))
    if len(distinct) == 1:  # is_kv_cache_spec_uniform
        return [GroupSpec(names, values)]
    if len({s.block_size for s in distinct}) == 1 and len({_type_key(s) for s in distinct}) == 1:
        return [GroupSpec(names, values, uniform_type=True)]
    unified = unify(specs) if unify is not None else unify_page_sizes(specs, policy)
    buckets: dict[KVCacheSpec, list[str]] = {}
    for name, spec in unified.items():
        buckets.setdefault(spec, []).append(name)
    size = group_size_for([len(b) for b in buckets.values()])
    groups = []
    for spec, layer_names in buckets.items():
        num_groups = cdiv(len(layer_names), size)
        for i in range(num_groups):
            members = tuple(layer_names[i::num_groups])  # strided split balances PP stages
            groups.append(GroupSpec(members, (spec,) * len(members)))
    return groups


def group_size(groups: Sequence[GroupSpec]) -> int:
    """Layers per group (the largest group), as vLLM's planner bills per block id."""
    return max(len(g.layer_names) for g in groups) if groups else 0
