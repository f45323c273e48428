"""Attention-backend selection: the engine's refusal before any sizing.

vLLM picks each attention layer's backend while it builds the model (``Attention.__init__`` ->
``vllm/v1/attention/selector.py::get_attn_backend`` -> ``Platform.get_attn_backend_cls``). On a
GPU platform (vllm/platforms/cuda.py, ``CudaPlatformBase.get_valid_backends``) each candidate's
``AttentionBackend.validate_configuration`` (vllm/v1/attention/backend.py) lists why it cannot
serve the layer, and a layer no candidate serves is ``ValueError("No valid attention backend found
for cuda with <selector config>. Reasons: {...}.")``: the engine does not start.

The reference models the backend a layer cannot avoid: a ``turboquant_*`` cache is served only by
``TurboQuantAttentionBackend`` (vllm/v1/attention/backends/turboquant_attn.py; no other backend,
MLA backends included, lists those dtypes in ``supported_kv_cache_dtypes``), which supports
float16/bfloat16 models, decoder self-attention, no MLA (``is_mla``), no attention sinks
(``supports_sink``), no sliding window (``supports_sliding_window``; checked from
``attention_selection_checks_sliding_window``) and no decode context parallelism (its impl's
``supports_dcp``; checked from ``attention_selection_checks_dcp``); any head size. A skip
layer (``--kv-cache-dtype-skip-layers``) keeps the model dtype and another backend. The other
backends' checks (head sizes, compute capability) depend on the device: not modelled; their
block-size check is the runner's (:func:`kernel_block_sizes`).

After the pool is planned, the runner picks each group's kernel block
(:func:`kernel_block_sizes`): the engine's refusal of a ``--block-size`` its attention backends do
not serve.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..model import KVCacheGroup
from ..scenario import Scenario
from .mamba import verify_mamba2_split, verify_mamba_cache_mode
from .parallel import verify_parallel
from .releases import LATEST, RuleSet
from .speculative import verify_drafter_pipeline

#: layer code -> the kind of attention spec it builds
ATTENTION_KIND = {"A": "full_attention", "P": "full_attention", "S": "sliding_window", "L": "chunked_local",
                  "X": "cross_attention"}  # fmt: skip


def turboquant_reasons(scenario: Scenario, index: int, code: str, release: RuleSet = LATEST) -> list[str]:
    """What ``TurboQuantAttentionBackend.validate_configuration`` says of layer ``index`` (its
    layer code ``code``): [] when it serves the layer or the layer is not a TurboQuant layer."""
    from .hybrid import is_skip_layer, skip_layers  # hybrid asks this module first

    model, rt = scenario.model, scenario.runtime
    assert model is not None and model.attention is not None
    kind = ATTENTION_KIND[code]
    if not rt.kv_cache_dtype.startswith("turboquant_") or is_skip_layer(index, kind, skip_layers(scenario)):
        return []
    reasons = []
    if model.dtype not in ("float16", "bfloat16"):
        reasons.append("dtype not supported")
    if model.attention.sinks:
        reasons.append("attention sinks not supported")
    if model.use_mla:  # no MLA backend lists a turboquant dtype, and TurboQuant's is not one
        reasons.append("MLA not supported")
    if kind == "cross_attention":
        reasons.append("attention type encoder_decoder not supported")
    if kind == "sliding_window" and release.has("attention_selection_checks_sliding_window"):
        reasons.append("sliding window not supported")
    if rt.decode_context_parallel_size > 1 and release.has("attention_selection_checks_dcp"):
        reasons.append("DCP not supported")
    return reasons


def select_attention_backends(scenario: Scenario, release: RuleSet = LATEST) -> None:
    """Raise the engine's ``ValueError`` for the first attention layer no backend serves."""
    model = scenario.model
    if model is None or model.attention is None:
        return
    for index, code in enumerate(model.layers):
        if code in ATTENTION_KIND and (reasons := turboquant_reasons(scenario, index, code, release)):
            raise ValueError(
                f"No valid attention backend found for cuda with layer {index} ({ATTENTION_KIND[code]}, "
                f"kv_cache_dtype={scenario.runtime.kv_cache_dtype}). "
                f"Reasons: {{TURBOQUANT: [{', '.join(reasons)}]}}."
            )


def refuse_config(scenario: Scenario, release: RuleSet = LATEST) -> None:
    """What the engine refuses while it builds its config, before any model: a cache mode the
    release does not take (:func:`~.mamba.verify_mamba_cache_mode`), the parallel layout
    (``VllmConfig``'s validation, :func:`~.parallel.verify_parallel`), an MTP drafter without
    pipeline support (:func:`~.speculative.verify_drafter_pipeline`)."""
    verify_mamba_cache_mode(scenario, release)
    verify_parallel(scenario, release)
    verify_drafter_pipeline(scenario, release)


def refuse_before_sizing(scenario: Scenario, release: RuleSet = LATEST) -> None:
    """What the engine refuses before it sizes anything, in its order: its config
    (:func:`refuse_config`), then model construction: the Mamba2 layers' TP split
    (:func:`~.mamba.verify_mamba2_split`) and the layers' attention backends
    (:func:`select_attention_backends`)."""
    refuse_config(scenario, release)
    verify_mamba2_split(scenario)
    select_attention_backends(scenario, release)


def kernel_block_sizes(groups: Sequence[KVCacheGroup], alignment: int) -> list[int]:
    """Each group's kernel block, as ``GPUModelRunner.initialize_kv_cache`` picks it
    (``prepare_kernel_block_sizes`` in vllm/v1/worker/utils.py, the same rule in 0.23 ... 0.33): a
    state group keeps its block; an attention group's block must be served by its backends,
    ``MultipleOf(alignment)`` here (``select_common_block_size``: the block itself when every
    backend accepts it, else the largest fixed size of one that divides it, which
    ``MultipleOf`` backends have none of). Else the engine does not start:
    ``ValueError("No common block size for ...")``. A hybrid's attention block is aligned
    before (``Platform._align_hybrid_block_size``); a ``--block-size`` of an attention-only
    model is taken as given, so an unaligned one is refused here."""
    kernels = []
    for group in groups:
        if group.kind != "mamba" and group.block_size % alignment:
            raise ValueError(
                f"No common block size for {group.block_size} (attention backend: [MultipleOf({alignment})])."
            )
        kernels.append(group.block_size)
    return kernels
