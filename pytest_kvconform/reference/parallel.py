"""The parallel settings vLLM refuses before it sizes anything, and the layers of each
pipeline stage.

Mirrors ``get_pp_indices`` (vllm/distributed/utils.py, the same in 0.23 ... 0.33),
``ParallelConfig`` validation (vllm/config/parallel.py: ``tp % dcp``) and
``ModelConfig.verify_with_parallel_config`` (vllm/config/model.py: query heads divisible by
TP; decode context parallelism for GQA/MQA needs TP above the KV heads, at most
``tp // kv_heads`` DCP ranks, and query heads per KV head divisible by DCP), vLLM 0.32/0.33;
the texts (and, for the DCP checks, the exception) of older releases where they differ.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..scenario import Scenario
from .releases import LATEST, RuleSet

#: ``layers.N`` in a module prefix: the decoder layer's index (``model.layers.3.self_attn``)
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
#: an MTP drafter that numbers its own layers from 0 (``mtp.layers.N``, ``MTP_PREFIXED_ARCHITECTURES``)
DRAFTER_PREFIX = "mtp."


def pp_layer_range(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``get_pp_indices`` without ``VLLM_PP_LAYER_PARTITION``: ``num_hidden_layers // pp_size``
    layers per stage, the remainder one each to the stages before the last, from the last but
    one backwards. Returns ``[start, end)``."""
    partitions = [num_hidden_layers // pp_size] * pp_size
    for i in range(2, num_hidden_layers % pp_size + 2):
        partitions[-i] += 1
    start = sum(partitions[:pp_rank])
    return start, start + partitions[pp_rank]


def pipeline_stages(names: Iterable[str], scenario: Scenario) -> list[frozenset[str]]:
    """The layer names each pipeline stage's worker reports (``get_kv_cache_spec`` of a model
    built with ``make_layers``, which builds layers ``get_pp_indices`` gives the rank): a decoder
    layer by its index; the speculative drafter's layers (an index past ``num_hidden_layers``,
    the ``mtp.`` prefix, or no index) on the last stage, whose runner builds the drafter
    (``GPUModelRunner.__init__``)."""
    model, pp = scenario.model, scenario.runtime.pipeline_parallel_size
    names = list(names)
    if pp == 1 or model is None:
        return [frozenset(names)]
    ranges = [pp_layer_range(model.num_hidden_layers, rank, pp) for rank in range(pp)]
    stages: list[set[str]] = [set() for _ in range(pp)]
    for name in names:
        found = None if name.startswith(DRAFTER_PREFIX) else LAYER_INDEX.search(name)
        index = int(found.group(1)) if found else model.num_hidden_layers
        stage = next((r for r, (lo, hi) in enumerate(ranges) if lo <= index < hi), pp - 1)
        stages[stage].add(name)
    return [frozenset(s) for s in stages]


def verify_parallel(scenario: Scenario, release: RuleSet = LATEST) -> None:
    """Raise ``ValueError`` with vLLM's message when vLLM would refuse the TP/DCP layout.

    Before ``dcp_tp_message_spaced`` (vLLM 0.26) the ``tp % dcp`` text lacks a space ("divisible
    bydcp_size"); before ``dcp_checks_value_error`` (0.27) the three GQA/MQA DCP checks are
    ``AssertionError`` with the older texts of ``ModelConfig.verify_with_parallel_config``."""
    rt, model = scenario.runtime, scenario.model
    tp, dcp = rt.tensor_parallel_size, rt.decode_context_parallel_size
    if tp % dcp:
        space = " " if release.has("dcp_tp_message_spaced") else ""
        raise ValueError(f"tp_size={tp} must be divisible by{space}dcp_size={dcp}.")
    attn = model.attention if model is not None else None
    if attn is None:
        return
    query_heads = attn.num_attention_heads
    if query_heads and query_heads % tp:
        raise ValueError(
            f"Total number of attention heads ({query_heads}) must be divisible by tensor parallel size "
            f"({tp})."
        )
    if dcp == 1 or attn.kind == "mla":
        return
    kv_heads = attn.num_kv_heads
    if not release.has("dcp_checks_value_error"):
        _verify_dcp_before_027(tp, dcp, kv_heads, query_heads)
        return
    if tp <= kv_heads:
        raise ValueError(
            f"Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` ({tp}) to be "
            f"greater than the model's total number of KV heads ({kv_heads}). Increase "
            "`--tensor-parallel-size` or set `--decode-context-parallel-size 1`."
        )
    if dcp > tp // kv_heads:
        raise ValueError(
            f"`--decode-context-parallel-size` ({dcp}) exceeds the maximum supported value "
            f"({tp // kv_heads}) for `--tensor-parallel-size` ({tp}) and {kv_heads} model KV heads."
        )
    if query_heads and (query_heads // kv_heads) % dcp:
        raise ValueError(
            f"The model's number of query heads per KV head ({query_heads // kv_heads}) must be "
            f"divisible by `--decode-context-parallel-size` ({dcp}) for GQA/MQA."
        )


def _verify_dcp_before_027(tp: int, dcp: int, kv_heads: int, query_heads: int) -> None:
    """The GQA/MQA DCP asserts of ``ModelConfig.verify_with_parallel_config``, vLLM 0.23 ... 0.26."""
    if tp <= kv_heads:
        raise AssertionError(
            f"tensor parallel size {tp} must be greater than total num kv heads {kv_heads} when enable "
            "decode context parallel for GQA/MQA"
        )
    if dcp > tp // kv_heads:
        raise AssertionError(
            "decode context parallel size must less than or equal to (tensor parallel size "
            f"{tp} // total num kv heads {kv_heads}) = {tp // kv_heads}, but got {dcp}"
        )
    if query_heads and (query_heads // kv_heads) % dcp:
        raise AssertionError(
            f"Total number of q per kv attn heads ({query_heads // kv_heads}) must be divisible by dcp world "
            f"size when enable decode context parallel for GQA ({dcp})."
        )
