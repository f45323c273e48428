"""Page-size unification across layers, under three named policies.

* ``pad-to-max``: vLLM 0.33.0 ``unify_kv_cache_spec_page_size`` (v1/core/kv_cache_planning.py):
  pages that divide the largest scale their block size; Mamba and non-MLA attention pages
  that do not are padded to the largest (PRs #45207, #45181); anything else raises.
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


def unify_page_sizes(specs: dict[str, KVCacheSpec], policy: str = "pad-to-max") -> dict[str, KVCacheSpec]:
    """Return specs whose ``page_size_bytes`` are all equal, or raise as the policy's vLLM does."""
    if policy not in POLICIES:
        raise ValueError(f"unknown unify policy {policy!r}; expected one of {', '.join(POLICIES)}")
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
        elif isinstance(spec, MambaSpec) and policy != "scale-only":
            new = dataclasses.replace(spec, page_size_padded=target)
        elif target % page == 0:
            new = spec.with_block_size(spec.block_size * (target // page))
            if policy == "scale-only" and new.page_size_bytes != target:
                raise AssertionError(f"Layer {name}: block scaling cannot change a Mamba page")
        elif policy == "scale-only":
            raise NotImplementedError(SCALE_ONLY_ERROR)
        elif isinstance(spec, AttentionSpec) and not spec.is_mla:
            new = dataclasses.replace(spec, page_size_padded=target)
        else:
            raise NotImplementedError(pad_to_max_error(name))
        assert new.page_size_bytes == target
        out[name] = new
    return out
