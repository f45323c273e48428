"""Page-size unification across layers, under three named policies.

* ``pad-to-max``: vLLM's own ``unify_kv_cache_spec_page_size`` (v1/core/kv_cache_planning.py in
  0.33.0, v1/core/kv_cache_utils.py before), as of the release: pages that divide the largest
  scale their block size; Mamba (0.26+, ``mamba_page_padding``) and non-MLA attention pages that
  do not are padded to the largest (PRs #45207, #45181); anything else raises. In 0.24 ... 0.28
  (``attention_page_padding``, before ``pad_non_mla_attention``) every attention page, MLA
  included, is padded (backends that index KV by block stride); 0.23 is ``scale-only``.
* ``scale-only``: older vLLM (v1/core/kv_cache_utils.py before #45181/#45207): only block
  scaling; a page that does not divide the largest raises, and a smaller Mamba page (which
  block scaling cannot grow) trips the bare assertion of PR #45207's report.
* ``lcm``: the proposal of vllm#40128 (closed unmerged): the target is the largest page
  rounded up to the LCM of the smaller ones, so every attention layer scales its block
  size exactly and only Mamba pages are padded.
"""

from __future__ import annotations

import dataclasses
import math

from .releases import LATEST, RuleSet
from .specs import AttentionSpec, KVCacheSpec, MambaSpec, round_up

POLICIES = ("pad-to-max", "scale-only", "lcm")

SCALE_ONLY_ERROR = (
    "The page size of the layer is not divisible by the maximum page size. "
    "Cannot unify by adjusting block_size."
)


def pad_to_max_error(layer_name: str) -> str:
    return (
        f"Layer {layer_name}: page size is not divisible by the maximum page size and cannot be "
        "padded. Padding is only supported for non-MLA attention layers."
    )


def stride_padding_error(layer_name: str) -> str:
    """The text of vLLM 0.24 ... 0.28 (``attention_page_padding``, before ``pad_non_mla_attention``)."""
    return (
        f"Layer {layer_name}: page size is not divisible by the maximum page size and cannot be "
        "padded. Padding is only supported for attention layers whose backend indexes KV pages by "
        "the block stride (indexes_kv_by_block_stride is True)."
    )


def unify_page_sizes(
    specs: dict[str, KVCacheSpec], policy: str = "pad-to-max", release: RuleSet = LATEST
) -> dict[str, KVCacheSpec]:
    """Return specs whose ``page_size_bytes`` are all equal, or raise as the policy's vLLM does;
    ``pad-to-max`` is that of ``release`` (``scale-only`` and ``lcm`` name fixed rules)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown unify policy {policy!r}; expected one of {', '.join(POLICIES)}")
    if policy == "pad-to-max" and not release.has("attention_page_padding"):
        policy = "scale-only"  # vLLM 0.23
    pad_mamba = policy == "lcm" or (policy == "pad-to-max" and release.has("mamba_page_padding"))
    pad_mla = policy == "pad-to-max" and not release.has("pad_non_mla_attention")
    pages = {s.page_size_bytes for s in specs.values()}
    if len(pages) <= 1:
        return dict(specs)
    target = max(pages)
    if policy == "lcm":
        target = round_up(target, math.lcm(*(p for p in pages if p != target)))
    out: dict[str, KVCacheSpec] = {}
    for name, spec in specs.items():
        page = spec.page_size_bytes
        if page == target:
            new = spec
        elif isinstance(spec, MambaSpec) and pad_mamba:
            new = dataclasses.replace(spec, page_size_padded=target)
        elif target % page == 0:
            new = spec.with_block_size(spec.block_size * (target // page))
            if new.page_size_bytes != target:  # a Mamba page that block scaling cannot grow
                raise AssertionError(f"Layer {name}: block scaling cannot change a Mamba page")
        elif policy == "scale-only":
            raise NotImplementedError(SCALE_ONLY_ERROR)
        elif isinstance(spec, AttentionSpec) and (pad_mla or not spec.is_mla):
            new = dataclasses.replace(spec, page_size_padded=target)
        elif pad_mla:
            raise NotImplementedError(stride_padding_error(name))
        else:
            raise NotImplementedError(pad_to_max_error(name))
        assert new.page_size_bytes == target
        out[name] = new
    return out
