"""The engine's defaults for the sizing settings a scenario file leaves unset.

A ``[runtime]`` key of :data:`~pytest_kvconform.scenario.DEFAULTED` that the file does not state
is *unset* (``RuntimeSettings.unset``): it gets what ``vllm serve`` of the judged release sets
for that model kind, derived as the engine derives it (docs/engine-defaults.md has the research,
release by release). :func:`engine_defaults` applies them; it is the first step of every plan
(``ReferenceRules.engine_defaults``) and the returned scenario lists what it applied
(``Scenario.defaults_applied``), each with the vLLM function that sets it.

Scope, as the scenario format's: a generative model (no pooling runner) on a GPU engine (Triton
present: the V2 model runner where the release defaults to it), vLLM core's platform (a
platform's ``check_and_update_config`` runs after these defaults and is the plan's next step).
A spec-level scenario has no model for the engine's model hooks: its unset keys keep the
format's values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..rejections import Rejected
from ..scenario import Scenario
from .releases import RuleSet
from .speculative import OWN_CHECKPOINT_METHODS, speculative_method

#: Where each default is set (vLLM 0.23 ... 0.33; docs/engine-defaults.md).
PREFIX_CACHING = (
    "vllm/engine/arg_utils.py::EngineArgs._set_default_chunked_prefill_and_prefix_caching_args "
    "(ModelConfig.is_prefix_caching_supported)"
)
MAMBA_HOOK = "vllm/model_executor/models/config.py::MambaModelConfig.verify_and_update_config"
ASYNC_SCHEDULING = (
    "vllm/config/vllm.py::VllmConfig.__post_init__ (async_scheduling is None), "
    "VllmConfig.max_concurrent_batches"
)


def mamba_cache_mode(scenario: Scenario, release: RuleSet) -> tuple[str, str]:
    """The mode ``vllm serve`` gives the scenario's model, and why."""
    model = scenario.model
    if model is None:
        return "none", "spec-level: no model for the engine's hooks; the format's value"
    if model.num_state_layers == 0:
        return "none", "no state layer: the mode sizes nothing"
    if model.num_attention_layers == 0:
        return "none", f"attention-free: prefix caching off by default ({PREFIX_CACHING}), so {MAMBA_HOOK}"
    if release.has("hybrid_prefix_caching_default"):
        return "align", f"hybrid: prefix caching on by default ({PREFIX_CACHING}), so {MAMBA_HOOK}"
    return "none", (
        f"hybrid: prefix caching off by default before vLLM 0.28 ({PREFIX_CACHING}), so {MAMBA_HOOK}"
    )


def max_concurrent_batches(scenario: Scenario, release: RuleSet) -> tuple[int, str]:
    """``VllmConfig.max_concurrent_batches`` with async scheduling left to its default, and why:
    one batch, or two with async scheduling, at pipeline parallel size 1; a pipeline of ``pp``
    stages keeps ``pp`` batches in flight, ``pp + 1`` with async scheduling on the V2 model runner
    (the default for every generative model from vLLM 0.29: ``v2_model_runner_default``)."""
    if scenario.model is None:
        return 1, "spec-level: no model for the engine's defaults; the format's value"
    method = speculative_method(scenario)
    off = {
        "ngram": not release.has("async_scheduling_ngram_v2_runner"),
        "draft_model": not release.has("async_scheduling_draft_model"),
    }
    async_on = not off.get(method or "", False)
    pp = scenario.runtime.pipeline_parallel_size
    if pp > 1:
        if not release.has("v2_model_runner_default"):
            raise Rejected(
                "not_modelled",
                "max_concurrent_batches of a pipeline before vLLM 0.29: the model runner, and so the "
                "batches in flight, depends on the architecture, MoE and quantization: state it",
            )
        if method in OWN_CHECKPOINT_METHODS:
            raise Rejected(
                "not_modelled",
                f"max_concurrent_batches of a pipeline with speculative method {method}: state it",
            )
        if not async_on:
            return (
                pp,
                f"speculative method {method}: async scheduling off by default, {pp} pipeline stages "
                f"({ASYNC_SCHEDULING})",
            )
        return pp + 1, (
            f"async scheduling on by default on the V2 model runner: {pp} pipeline stages + 1 "
            f"({ASYNC_SCHEDULING}, VllmConfig.use_v2_model_runner)"
        )
    if not async_on:
        return 1, f"speculative method {method}: async scheduling off by default ({ASYNC_SCHEDULING})"
    drafter = f" with speculative method {method}" if method else ""
    return 2, f"async scheduling on by default{drafter} ({ASYNC_SCHEDULING})"


#: key -> its derivation
DERIVATIONS: dict[str, Any] = {
    "mamba_cache_mode": mamba_cache_mode,
    "max_concurrent_batches": max_concurrent_batches,
}


def engine_defaults(scenario: Scenario, release: RuleSet) -> tuple[Scenario, list[str]]:
    """``scenario`` with every unset setting given the engine's default of ``release``, and the
    defaults applied, one line each (``key = value: why``). A scenario stating every setting
    is returned as it is."""
    unset = scenario.runtime.unset
    if not unset:
        return scenario, []
    values, applied = {}, []
    for key in unset:
        value, why = DERIVATIONS[key](scenario, release)
        values[key] = value
        applied.append(f"{key} = {value!r}: {why}")
    return with_defaults(scenario, values, applied), applied


def with_defaults(scenario: Scenario, values: dict[str, Any], applied: list[str]) -> Scenario:
    """``scenario`` with ``values`` for its unset keys (none left unset), ``applied`` recorded;
    its expectations kept: they state the plan of the file as the engine serves it."""
    runtime = dataclasses.replace(scenario.runtime, unset=(), **values)
    return dataclasses.replace(
        scenario, runtime=runtime, defaults_applied=(*scenario.defaults_applied, *applied)
    )
