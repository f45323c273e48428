"""KV cache groups: uniform, uniform-type, and uniform-page-size grouping.

Mirrors ``get_kv_cache_groups`` (v1/core/kv_cache_planning.py in vLLM 0.33.0,
v1/core/kv_cache_utils.py before), ``UniformTypeKVCacheSpecs`` (v1/kv_cache_interface.py),
``_get_kv_cache_groups_uniform_page_size``, ``unify_hybrid_kv_cache_specs`` (the hybrid KV cache
manager disabled) and, from 0.27, the full-allocation fallback
(``_try_get_full_allocation_fallback_groups``, ``_promote_local_kv_cache_specs``), for
layer-outer layouts (the default).

Followed by construction, with no bytes of their own for any spec the reference builds:

* Merging specs that differ yet merge (``KVCacheSpec.merge`` and its overrides in
  v1/kv_cache_interface.py; ``is_kv_cache_spec_uniform``; from 0.27 the greedy bucket merge of
  ``_get_kv_cache_groups_uniform_page_size``). ``FullAttentionSpec.merge`` lets a group's specs
  differ only in ``sliding_window``, ``attention_chunk_size`` and ``non_causal``;
  ``MLAAttentionSpec.merge`` requires its extra fields to be unique; every other class merges
  equal specs only. A full-attention spec with a window or chunk exists only after
  ``unify_hybrid_kv_cache_specs`` (the hybrid KV cache manager disabled, whose promoted specs the
  reference builds without the window, the same bytes) and
  ``non_causal`` only on prefix-LM layers (no modelled field): the reference's specs merge
  exactly when they are equal, which is how it buckets them.
* Rounding each page to its block-stride alignment (``_get_layer_block_stride``,
  ``KVCacheSpec.get_block_stride_alignment``, ``_get_kv_cache_bytes_per_block``; vLLM 0.32+,
  the ``block_stride_alignment`` field from 0.31). Layer-outer, a layer's stride is
  ``round_up(page, alignment)``. Every alignment a modelled spec can carry divides its page:
  FlashMLA-sparse's ``align_blocks_to_rows`` is one token row (``state_content_size_bytes``),
  and ``MultipleOf(n)`` (quantized FlashMLA-sparse off SM100, backends with fixed kernel
  blocks: ``customize_attention_spec`` in v1/worker/utils.py) is the page of ``gcd(n, block)``
  tokens, or the padded page itself. Only ``tokens_per_state != 1`` or DeepSeek-V4.1's packed
  alignment (neither modelled) round up, so :attr:`GroupSpec.bytes_per_block` is the sum of pages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from ..model import KVCacheGroup
from ..scenario import RuntimeSettings
from .releases import RuleSet
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


def _uniform_type(values: Sequence[KVCacheSpec]) -> bool:
    """``UniformTypeKVCacheSpecs.is_uniform_type``: one block size and one base type."""
    return len({s.block_size for s in values}) == 1 and len({_type_key(s) for s in values}) == 1


#: ``_promote_local_kv_cache_specs``: the local kinds promoted, and the ``FullAttentionSpec``
#: kinds whose block size they take (``MLAAttentionSpec`` subclasses ``FullAttentionSpec``).
_LOCAL_KINDS, _FULL_KINDS = ("sliding_window", "chunked_local"), ("full_attention", "mla")


def promote_local_specs(
    specs: dict[str, KVCacheSpec], *, at_full_block: bool = True
) -> dict[str, KVCacheSpec] | None:
    """``_promote_local_kv_cache_specs`` (vLLM 0.27+): with full (or MLA) attention present, every
    sliding-window and chunked-local spec becomes a full-attention spec (all tokens kept,
    ``extra_retained_tokens`` dropped) at the full layers' block size when they share one, else
    its own; a padded page becomes ``max(padded, unpadded page at the new block)``. ``None`` where
    vLLM raises ``ValueError`` (the result is neither uniform nor of uniform type).
    ``at_full_block=False``: ``unify_hybrid_kv_cache_specs`` before 0.27, every spec at its own
    block, its padded page kept."""
    values = tuple(specs.values())
    if len(set(values)) == 1 or _uniform_type(values):
        return dict(specs)
    attn = [s for s in values if isinstance(s, AttentionSpec)]
    full_blocks = {s.block_size for s in attn if s.kind in _FULL_KINDS}
    full_block = next(iter(full_blocks)) if len(full_blocks) == 1 and at_full_block else None
    promoted = dict(specs)
    if full_blocks and any(s.kind in _LOCAL_KINDS for s in attn):
        for name, spec in specs.items():
            if not (isinstance(spec, AttentionSpec) and spec.kind in _LOCAL_KINDS):
                continue
            block = full_block or spec.block_size
            padded = spec.page_size_padded
            if padded is not None:
                padded = max(padded, spec.real_page_size_bytes * block // spec.block_size)
            promoted[name] = dataclasses.replace(
                spec, kind="full_attention", block_size=block, page_size_padded=padded,
                sliding_window=None, attention_chunk_size=None, extra_retained_tokens=0,
            )  # fmt: skip
    values = tuple(promoted.values())
    return promoted if len(set(values)) == 1 or _uniform_type(values) else None


def unify_hybrid_kv_cache_specs(specs: dict[str, KVCacheSpec], release: RuleSet) -> dict[str, KVCacheSpec]:
    """``unify_hybrid_kv_cache_specs`` (``--disable-hybrid-kv-cache-manager``; ``get_kv_cache_groups``
    runs it first): local-attention layers planned as full attention (:func:`promote_local_specs`),
    so that every layer keeps all ``max_model_len`` tokens in one group. Layers that still differ
    in kind (state layers beside attention) are the engine's ``ValueError``. vLLM 0.31+ promotes
    replicated attention layers (``dcp_sharded=False``, no modelled spec) apart from the rest."""
    at_full_block = release.has("hma_disabled_promotes_at_full_block")
    promoted = promote_local_specs(specs, at_full_block=at_full_block)
    if promoted is None:
        raise ValueError(
            "Failed to promote local KV cache specs to one unified type." if at_full_block else
            "Hybrid KV cache manager is disabled but failed to convert the KV cache specs to one "
            "unified type."
        )  # fmt: skip
    return promoted


def full_allocation_fallback(specs: dict[str, KVCacheSpec]) -> list[GroupSpec] | None:
    """``_try_get_full_allocation_fallback_groups`` (vLLM 0.27+), tried when page unification
    raises ``NotImplementedError``: only for MLA with regular sliding-window layers (no chunked-local
    layers; vLLM also excludes sliding-window MLA and hidden-state layers, which the reference has
    not), whose promoted specs (:func:`promote_local_specs`) form one uniform-type group (vLLM
    warns "KV cache page sizes cannot be unified; treating sliding-window layers as full attention
    for cache allocation..."). ``None``: vLLM re-raises the unification error.

    Reached from 0.29 (an MLA page is no longer padded); 0.27, 0.28 pad it for the stride-indexing
    backends the reference models. No real model reaches it that we found: openPangu is MLA or GQA
    throughout (``use_mla``), dots3-note's and DeepSeek-V4's windows are sliding-window MLA, and we
    know of no sliding-window draft for an MLA target; hence no packaged scenario (the worked case
    is tests/data/mla-sliding-fallback.toml, docs/scenario-derivations.md 10b)."""
    kinds = {s.kind for s in specs.values()}
    if "chunked_local" in kinds or not {"mla", "sliding_window"} <= kinds:
        return None
    promoted = promote_local_specs(specs)
    if promoted is None or not _uniform_type(tuple(promoted.values())):  # from_specs: None
        return None
    return [GroupSpec(tuple(promoted), tuple(promoted.values()), uniform_type=True)]


def get_kv_cache_groups(
    specs: dict[str, KVCacheSpec],
    policy: str = "pad-to-max",
    unify: Callable[[dict[str, KVCacheSpec]], dict[str, KVCacheSpec]] | None = None,
    *,
    fallback: bool = True,
) -> list[GroupSpec]:
    """Group layers as vLLM's engine core does before planning the pool; ``unify`` replaces
    :func:`~.unify.unify_page_sizes` under ``policy``. ``fallback``: the release has the
    full-allocation fallback (0.27+, ``full_allocation_fallback``) for pages unification refuses."""
    if not specs:
        return []
    names, values = tuple(specs), tuple(specs.values())
    distinct = tuple(dict.fromkeys(values))
    if len(distinct) == 1:  # is_kv_cache_spec_uniform
        return [GroupSpec(names, values)]
    if _uniform_type(distinct):
        return [GroupSpec(names, values, uniform_type=True)]
    try:
        unified = unify(specs) if unify is not None else unify_page_sizes(specs, policy)
    except NotImplementedError:
        groups = full_allocation_fallback(specs) if fallback else None
        if groups is None:
            raise
        return groups
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
