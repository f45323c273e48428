"""What speculative decoding adds to the KV plan besides the state rows (``mamba.py``).

Mirrors vLLM 0.33.0: ``VllmConfig.num_prefill_lookahead_tokens`` (vllm/config/vllm.py),
``SpeculativeConfig.use_eagle`` / ``use_multi_module_mtp`` (vllm/config/speculative.py) and the
tagging of every ``SlidingWindowSpec`` with ``extra_retained_tokens`` in ``get_kv_cache_configs``
(vllm/v1/core/kv_cache_planning.py; kv_cache_utils.py in 0.32), before grouping.

And the MTP drafter's own attention layers (:func:`num_draft_layers`), which the worker reports
with the target's (``GPUModelRunner.get_kv_cache_spec`` reads every attention layer of the
config's forward context, the drafter's included): the same in vLLM 0.23 ... 0.33.
"""

from __future__ import annotations

import dataclasses

from ..rejections import Rejected
from ..scenario import Scenario
from .releases import LATEST, RuleSet
from .specs import AttentionSpec, KVCacheSpec

#: ``SpeculativeConfig.use_eagle``: drafters that read the target's hidden states.
EAGLE_FAMILY = ("eagle", "eagle3", "mtp")
#: Drafters that are a second checkpoint with a config of their own (``SpeculativeConfig.model``):
#: their layers' geometry is not the target's, so a model-level scenario cannot state it.
OWN_CHECKPOINT_METHODS = ("eagle", "eagle3", "draft_model")


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


def num_draft_layers(scenario: Scenario) -> int:
    """Attention layers the drafter adds to the worker's KV cache specs in a model-level scenario.

    ``mtp``: the model's ``num_nextn_predict_layers`` MTP modules, every one of them whatever
    ``num_speculative_tokens`` (step ``i`` runs module ``i % n``). ``SpeculativeConfig.hf_config_override``
    (vllm/config/speculative.py) gives the draft config ``n_predict = num_nextn_predict_layers``
    (``mtp_num_hidden_layers`` for Qwen3.5); the MTP model builds that many decoder layers after
    the target's (``DeepSeekMultiTokenPredictor``: ``model.layers.{num_hidden_layers + k}``,
    vllm/model_executor/models/deepseek_mtp.py; ``Qwen3NextMultiTokenPredictor`` and
    ``Qwen3_5MultiTokenPredictor``, ``layer_type="full_attention"``, qwen3_next_mtp.py and
    qwen3_5_mtp.py); ``SpecDecodeBaseProposer.load_model`` (vllm/v1/spec_decode/llm_base_proposer.py)
    builds it in the target's worker, so ``GPUModelRunner.get_kv_cache_spec`` reports its layers
    after the target's. vLLM 0.23, 0.32 and 0.33 build them alike. ``mtp`` on a model without MTP
    modules, ``ngram`` and no speculation: none.

    Raises ``ValueError`` for an EAGLE head or draft model (:data:`OWN_CHECKPOINT_METHODS`), whose
    layers come from a config of its own: a spec-level scenario lists them instead."""
    if scenario.is_spec_level:
        return 0
    method = speculative_method(scenario)
    if method in OWN_CHECKPOINT_METHODS:
        raise ValueError(
            f"speculative_method {method!r}: the draft's KV layers come from its own "
            "checkpoint's config, which a model-level scenario cannot state; list them in a "
            "spec-level scenario ([[layer_specs]], e.g. deepseek-v3-mtp1-with-draft.toml)"
        )
    if method != "mtp" or scenario.model is None:
        return 0
    return scenario.model.num_nextn_predict_layers


#: Targets whose MTP model sits under the ``mtp`` prefix and numbers its layers from 0
#: (``Qwen3NextMTP``, ``Qwen3_5MTP``: ``maybe_prefix(prefix, "mtp")``, qwen3_next_mtp.py, qwen3_5_mtp.py;
#: likewise nemotron_h_mtp.py, mimo_mtp.py); the others number them after the target's
#: (``DeepSeekMultiTokenPredictor``: ``model.layers.{num_hidden_layers + k}``).
MTP_PREFIXED_ARCHITECTURES = (
    "Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "NemotronHForCausalLM", "MiMoForCausalLM",
)  # fmt: skip


#: Target -> whether its MTP model implements ``SupportsPP``: always (True), from the release
#: that has a change of :data:`.releases.CHANGES` (its name), or in no release 0.23 ... 0.33
#: (False); read in each wheel (vllm/model_executor/models/*_mtp.py).
MTP_SUPPORTS_PP: dict[str, bool | str] = {
    "DeepseekV3ForCausalLM": "mtp_pipeline_parallel", "DeepseekV2ForCausalLM": "mtp_pipeline_parallel",
    "Qwen3_5ForConditionalGeneration": "mtp_pipeline_parallel",
    "Qwen3_5MoeForConditionalGeneration": "mtp_pipeline_parallel",
    "Qwen3NextForCausalLM": False, "Glm4MoeLiteForCausalLM": True,
}  # fmt: skip


def verify_drafter_pipeline(scenario: Scenario, release: RuleSet = LATEST) -> None:
    """Pipeline stages with an MTP drafter whose model does not implement ``SupportsPP``:
    ``ModelConfig.verify_with_parallel_config`` (vllm/config/model.py) refuses the draft model's
    config when the engine is configured (``NotImplementedError``, as for a target without it)."""
    model = scenario.model
    if model is None or scenario.runtime.pipeline_parallel_size == 1 or not num_draft_layers(scenario):
        return
    supported = MTP_SUPPORTS_PP.get(model.architecture)
    if supported is None:
        raise Rejected("not_modelled", f"whether {model.architecture}'s MTP model supports pipeline "
                       "parallelism is not modelled")  # fmt: skip
    if not (supported is True or (isinstance(supported, str) and release.has(supported))):
        raise NotImplementedError(
            "Pipeline parallelism is not supported for this model. Supported models implement the "
            "`SupportsPP` interface."
        )


def draft_layer_names(scenario: Scenario) -> list[str]:
    """The MTP layers' module prefixes, as vLLM names them (:data:`MTP_PREFIXED_ARCHITECTURES`)."""
    count = num_draft_layers(scenario)
    if not count:
        return []
    assert scenario.model is not None
    if scenario.model.architecture in MTP_PREFIXED_ARCHITECTURES:
        return [f"mtp.layers.{k}" for k in range(count)]
    first = scenario.model.num_hidden_layers
    return [f"model.layers.{first + k}" for k in range(count)]
