"""What speculative decoding adds to the KV plan besides the state rows (``mamba.py``).

Mirrors vLLM 0.33.0: ``VllmConfig.num_prefill_lookahead_tokens`` (vllm/config/vllm.py),
``SpeculativeConfig.use_eagle`` / ``use_multi_module_mtp`` (vllm/config/speculative.py) and the
tagging of every ``SlidingWindowSpec`` with ``extra_retained_tokens`` in ``get_kv_cache_configs``
(vllm/v1/core/kv_cache_planning.py; kv_cache_utils.py in 0.32), before grouping.
"""

from __future__ import annotations

import dataclasses

from ..scenario import Scenario
from .releases import LATEST, RuleSet
from .specs import AttentionSpec, KVCacheSpec

#: ``SpeculativeConfig.use_eagle``: drafters that read the target's hidden states.
EAGLE_FAMILY = ("eagle", "eagle3", "mtp")


def speculative_method(scenario: Scenario) -> str | None:
    """The drafter, or None without speculative decoding; ``auto`` resolves to ``mtp`` when the
    model ships MTP modules, else ``ngram``."""
    rt, model = scenario.runtime, scenario.model
    if not rt.num_speculative_tokens:
        return None
    if rt.speculative_method != "auto":
        return rt.speculative_method
    return "mtp" if model is not None and model.num_nextn_predict_layers else "ngram"


def num_prefill_lookahead_tokens(scenario: Scenario) -> int:
    """Prefill tokens past the computed range that the drafter reads: 0 without an EAGLE-family
    drafter, ``num_speculative_tokens`` for a chain of more than one MTP module
    (``min(num_nextn_predict_layers, num_speculative_tokens) > 1``), else 1."""
    method = speculative_method(scenario)
    if method not in EAGLE_FAMILY:
        return 0
    spec_tokens = scenario.runtime.num_speculative_tokens
    modules = (scenario.model.num_nextn_predict_layers if scenario.model is not None else 0) or 1
    if method == "mtp" and min(modules, spec_tokens) > 1:
        return spec_tokens
    return 1


def extra_retained_tokens(scenario: Scenario) -> int:
    """Tokens a sliding-window layer keeps below its window: ``max(0, lookahead - 1)``."""
    return max(0, num_prefill_lookahead_tokens(scenario) - 1)


def with_retained_tokens(
    specs: dict[str, KVCacheSpec], scenario: Scenario, release: RuleSet = LATEST
) -> dict[str, KVCacheSpec]:
    """``specs`` with every sliding-window spec tagged with :func:`extra_retained_tokens` (vLLM 0.28+)."""
    extra = extra_retained_tokens(scenario) if release.has("speculative_retained_tokens") else 0
    if not any(isinstance(s, AttentionSpec) and s.kind == "sliding_window" for s in specs.values()):
        return specs
    tagged: dict[KVCacheSpec, KVCacheSpec] = {}
    out: dict[str, KVCacheSpec] = {}
    for name, spec in specs.items():
        if isinstance(spec, AttentionSpec) and spec.kind == "sliding_window":
            spec = tagged.setdefault(spec, dataclasses.replace(spec, extra_retained_tokens=extra))
        out[name] = spec
    return out
