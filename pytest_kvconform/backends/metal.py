"""The ``metal`` backend: the bundled MLX paged-attention runtime, sized from real allocations.

What vllm-metal takes from vLLM core (page specs, the hybrid alignment it delegates upstream,
grouping, the admission check) is inherited from the reference. What vllm-metal computes
itself comes from :mod:`pytest_kvconform.metal_runtime` and arrays it really allocates:

* the kernel block size and the block-table split (``_pick_kernel_block_size``,
  ``_build_block_tables``);
* the bytes of one pool block (``get_cache_block_size_bytes``: the paged layers only) and
  the number of blocks a budget holds (``_paged_attention_plan``: ``budget // per_block``);
* the one-sequence estimate (``estimate_one_sequence_kv_bytes``);
* the allocation of a planned pool and its guard against a larger engine config
  (``ModelCachePolicy.initialize_kv_cache``, PR #527).

Like vllm-metal, the runtime stores K/V in the model dtype (float16, bfloat16 or float32)
and never reads ``--kv-cache-dtype``; scenarios that ask for a packed or 8-bit cache are
known failures of this backend, listed in :attr:`MetalBackend.known_failures`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from ..errors import RuleNotApplicable
from ..model import KVPlan, MemoryCheck, PoolAllocation
from ..reference import plan as reference_plan
from ..reference.specs import AttentionSpec, KVCacheSpec, MambaSpec
from ..reference.speculative import num_draft_layers, speculative_method
from ..scenario import Scenario
from .base import ReferenceBackend

_FP8_DS_MLA = (
    "vllm-metal stores K/V in the model dtype and never reads --kv-cache-dtype (vllm-metal @ 211a1e4, "
    "v1/cache_policy.py and attention/caches/kv_cache.py allocate model_config.dtype): the runtime "
    "cannot allocate the 656 B/token fp8_ds_mla latent nor the uint8 DSA indexer cache that vLLM plans "
    "for GLM-5"
)
_TURBOQUANT = (
    "vllm-metal has its own TurboQuant (--additional-config, q8_0/q3_0 ..., attention/caches/turboquant.py) "
    "and ignores vLLM's turboquant_* kv_cache_dtype: the runtime cannot allocate the 776 B/token k8v4 "
    "slots vLLM plans"
)
_TURBOQUANT_DENSE = (
    "vllm-metal has its own TurboQuant (--additional-config, attention/caches/turboquant.py) and ignores "
    "vLLM's turboquant_* kv_cache_dtype: the runtime stores every layer in the model dtype, not the "
    "1,568 B/token k8v4 slots (and bf16 boundary layers) vLLM plans for Llama-3.1-8B"
)
_FP8 = (
    "vllm-metal stores K/V in the model dtype and never reads --kv-cache-dtype (vllm-metal @ 211a1e4, "
    "v1/cache_policy.py and attention/caches/kv_cache.py allocate model_config.dtype): the MLX pool "
    "cannot allocate the uint8 (fp8) 576 B/token MLA latent vLLM plans for DeepSeek-V3 with fp8"
)
_PER_LAYER_POOL = (
    "the MLX pool (metal_runtime/pool.py) holds one page per attention layer per block, while vLLM's "
    "hybrid allocator lets the layers of its equal-size groups (sliding-window and full attention) "
    "share one tensor (KVCacheTensor.shared_by), so a block is one page per group slot"
)
_MTP_DRAFT_NOT_POOLED = (
    "the MLX pool (metal_runtime/pool.py, laid out by layers_from_scenario from the model's own "
    "layers) holds the target's attention layers only; the MTP drafter's layer that vLLM's worker "
    "reports (GPUModelRunner.get_kv_cache_spec; reference/speculative.py) has no page in it: "
    "Qwen3.5-35B-A3B with MTP 1, 10 x 2,162,688 = 21,626,880 B per block instead of 11 x = 23,789,568"
)
_INT_STORAGE = (
    "the MLX pool stores K/V in float16, bfloat16 or float32 only (metal_runtime/pool.py; vllm-metal's "
    "attention/caches/kv_cache.py allocates the model dtype): a plugin-registered int8 kv_cache_dtype "
    "cannot be allocated"
)
_FROM_VLLM_CORE = "vllm-metal takes it from vLLM core (its platform and worker call vLLM's own code)"


class MetalBackend(ReferenceBackend):
    """vllm-metal's own sizing rules answered by the MLX runtime (Metal GPU on macOS, CPU on Linux)."""

    name: ClassVar[str] = "metal"
    capabilities: ClassVar[frozenset[str]] = frozenset({"allocation", "paged_attention"})
    #: What vllm-metal does not compute itself: the reference's code answers, reported as inherited.
    inherits: ClassVar[Mapping[str, str]] = dict.fromkeys(
        ("dtype", "hybrid_alignment", "block_size", "state_page", "layer_specs", "attention_page",
         "max_memory", "unification", "grouping"), _FROM_VLLM_CORE,
    )  # fmt: skip
    known_failures: ClassVar[Mapping[str, str]] = {
        "plan::test_plan[glm-5-fp8-ds-mla]": _FP8_DS_MLA,
        "dtype::test_registered_kv_cache_dtype[int8]": _INT_STORAGE,
        "plan::test_expectations[glm-5-fp8-ds-mla]": _FP8_DS_MLA,
        "allocation::test_pool_holds_exactly_the_planned_blocks[glm-5-fp8-ds-mla]": _FP8_DS_MLA,
        "memory::test_check_memory[glm-5-fp8-ds-mla]": _FP8_DS_MLA,
        "plan::test_plan_golden[glm5-fp8-ds-mla]": _FP8_DS_MLA,
        "attention_page::test_glm5_fp8_ds_mla_pages": _FP8_DS_MLA,
        "plan::test_plan_golden[vllm-b2-mla-mamba-fp8-ds-mla]": _FP8_DS_MLA,
        "plan::test_plan_golden[vllm-b2-kimi-linear-mla-kda-fp8-ds-mla]": _FP8_DS_MLA,
        # the vLLM #55449 probes' own [expect] (MLA + state layers with the 656 B/token latent)
        "plan::test_expectations[*-mla-*-fp8-ds-mla-probe]": _FP8_DS_MLA,
        **{
            f"{family}::{test}[{scenario}]": reason
            for scenario, reason in (("deepseek-v3-fp8", _FP8), ("deepseek-v3.2-fp8-ds-mla", _FP8_DS_MLA))
            for family, test in (
                ("plan", "test_plan"),
                ("plan", "test_expectations"),
                ("memory", "test_check_memory"),
                ("allocation", "test_pool_holds_exactly_the_planned_blocks"),
            )
        },
        "allocation::test_pool_holds_exactly_the_planned_blocks[gemma-3-27b-it]": _PER_LAYER_POOL,
        "allocation::test_pool_holds_exactly_the_planned_blocks[gemma-4-31b-it]": _PER_LAYER_POOL,
        "allocation::test_pool_holds_exactly_the_planned_blocks[gpt-oss-20b]": _PER_LAYER_POOL,
        "allocation::test_pool_holds_exactly_the_planned_blocks[qwen3.5-35b-a3b-mtp1]": _MTP_DRAFT_NOT_POOLED,
        "plan::test_plan[qwen3.6-35b-a3b-turboquant-k8v4]": _TURBOQUANT,
        "plan::test_expectations[qwen3.6-35b-a3b-turboquant-k8v4]": _TURBOQUANT,
        "allocation::test_pool_holds_exactly_the_planned_blocks[qwen3.6-*-turboquant-k8v4]": _TURBOQUANT,
        "memory::test_check_memory[qwen3.6-35b-a3b-turboquant-k8v4]": _TURBOQUANT,
        "plan::test_plan_golden[vllm-39931-qwen36-turboquant-k8v4]": _TURBOQUANT,
        "plan::test_vllm39931_qwen36_turboquant_k8v4_real_run": _TURBOQUANT,
        **{
            f"{family}::{test}[llama-3.1-8b-instruct-turboquant-k8v4]": _TURBOQUANT_DENSE
            for family, test in (
                ("plan", "test_plan"),
                ("plan", "test_expectations"),
                ("memory", "test_check_memory"),
                ("allocation", "test_pool_holds_exactly_the_planned_blocks"),
            )
        },
    }

    def __init__(self) -> None:
        import mlx.core as mx  # ImportError here becomes the registry's install hint

        self._mx = mx

    def unsupported(self, scenario: Scenario) -> str | None:
        model = scenario.model
        kv_dtype = scenario.runtime.kv_cache_dtype
        if kv_dtype not in ("auto", model.dtype if model is not None else None):
            return f"the runtime stores K/V in the model dtype; kv_cache_dtype {kv_dtype!r} is not modelled"
        if model is not None and speculative_method(scenario) == "mtp" and num_draft_layers(scenario):
            return "the MLX pool holds the target's attention layers only, not the MTP drafter's"
        if model is not None and model.is_hybrid:
            group_size = reference_plan(scenario).group_size
            if group_size != model.num_attention_layers:
                return (
                    f"vllm-metal's pool block holds the {model.num_attention_layers} attention layers while "
                    f"vLLM bills group_size={group_size} pages per block (see tests/test_metal_backend.py)"
                )
        return None

    @property
    def version(self) -> str:
        device = "Metal GPU" if self._mx.metal.is_available() else "CPU"
        return f"MLX {self._mx.__version__} runtime on {device}"

    # -- kernel_block: the runtime's own translation
    def kernel_block_size(self, block_size: int, scenario: Scenario | None = None) -> int:
        from ..metal_runtime import pick_kernel_block_size

        return pick_kernel_block_size(block_size)

    def build_block_tables(
        self, rows: Sequence[Sequence[int]], block_size: int, scenario: Scenario | None = None
    ) -> tuple[list[list[int]], int]:
        from ..metal_runtime import build_block_tables

        table, kernel_block = build_block_tables(rows, block_size)
        return table.tolist(), kernel_block

    # -- one_sequence: measured on a really allocated pool
    def one_sequence_bytes(self, block_size: int, state_page_padded: int | None, scenario: Scenario) -> int:
        from ..metal_runtime import KVPool

        layers = _scenario_layers(scenario)
        if state_page_padded is None:
            return KVPool.one_sequence_bytes(scenario.runtime.max_model_len, block_size, layers)
        # vllm-metal PR #575: each state layer is billed at the padded page the upstream alignment set.
        paged = [layer for layer in layers if layer.is_paged]
        num_state = len(layers) - len(paged)
        max_model_len = scenario.runtime.max_model_len
        return KVPool.one_sequence_bytes(max_model_len, block_size, paged) + num_state * state_page_padded

    # -- memory: per-block bytes and block count from the pool; the admission check stays vLLM's
    def check_memory(self, specs: dict[str, KVCacheSpec], scenario: Scenario) -> MemoryCheck:
        from ..metal_runtime import KVPool

        upstream = super().check_memory(specs, scenario=scenario)
        kinds = {s.kind for s in specs.values() if isinstance(s, AttentionSpec)}
        if kinds & {"sliding_window", "chunked_local", "cross_attention"}:
            # vllm-metal PR #563: mixed layouts report a budget and adopt vLLM's own layout.
            return upstream
        has_state = any(isinstance(s, MambaSpec) for s in specs.values())
        if has_state and len({s.page_size_bytes for s in specs.values()}) > 1:
            # State pages the hybrid alignment did not equalise: vLLM's unification rescales or
            # pads them, and the pool follows the layout vLLM plans (the probes of vLLM core).
            return upstream
        per_block = _pool_bytes_per_block(list(specs.values()))
        available = upstream.available_bytes  # the admission budget; from vLLM 0.29, less the null block
        if self.release.has("null_block_reserved"):
            available += upstream.bytes_per_block  # the pool is sized from the whole budget
        return dataclasses.replace(
            upstream, bytes_per_block=per_block, num_blocks=KVPool.num_blocks_for_budget(available, per_block)
        )

    # -- allocation: a pool really allocated for the planned config
    def allocate_kv_cache(self, plan: KVPlan, num_blocks: int, scenario: Scenario) -> PoolAllocation:
        from ..metal_runtime import KVPool

        if scenario.is_spec_level:
            raise RuleNotApplicable("a spec-level scenario has no model geometry for the Metal pool")
        if scenario.runtime.tensor_parallel_size > 1:
            raise RuleNotApplicable(
                "the Metal runtime serves one device: it holds every head, not a "
                f"tensor_parallel_size={scenario.runtime.tensor_parallel_size} shard"
            )
        paged = [layer for layer in _scenario_layers(scenario) if layer.is_paged]
        if not paged:
            raise RuleNotApplicable("the model has no paged attention layers: the Metal pool is empty")
        pool = KVPool(paged, num_blocks, plan.block_size, 0)
        return PoolAllocation(num_blocks, pool.bytes_per_block(), pool.bytes_held(), handle=pool)

    def check_kv_cache_config(self, allocation: PoolAllocation, num_blocks: int, scenario: Scenario) -> None:
        allocation.handle.check_kv_cache_config(num_blocks)


def _scenario_layers(scenario: Scenario) -> list[Any]:
    """The runtime's layers for a scenario, recurrent state in fp32 as vllm-metal stores it (PR #243)."""
    from ..metal_runtime import layers_from_scenario

    return [
        dataclasses.replace(layer, recurrent_dtype="float32") if layer.recurrent_shape else layer
        for layer in layers_from_scenario(scenario)
    ]


def _pool_bytes_per_block(specs: Sequence[KVCacheSpec]) -> int:
    """Bytes of one block of a pool allocated for the attention layers of ``specs`` (the Metal
    pool holds paged layers only; state lives in separate slots)."""
    from ..metal_runtime import KVPool, attention_layer, mla_layer

    attention = [s for s in specs if isinstance(s, AttentionSpec)]
    if not attention:
        raise ValueError("the Metal pool holds paged attention layers; these specs have none")
    layers = []
    for spec in attention:
        if spec.state_content_bytes is not None or spec.num_head_slots is not None or spec.page_size_padded:
            raise ValueError(
                f"the Metal runtime has no packed or padded KV pages ({spec.kind}, "
                f"{spec.state_content_size_bytes} B per head slot); it stores plain K/V"
            )
        if spec.is_mla:
            layers.append(mla_layer(spec.head_size, 0, spec.dtype))
        else:
            layers.append(attention_layer(spec.num_kv_heads, spec.head_size, spec.dtype, spec.head_size_v))
    block_sizes = {s.block_size for s in attention}
    if len(block_sizes) != 1:
        raise ValueError(f"the Metal pool has one block size; the specs have {sorted(block_sizes)}")
    return KVPool(layers, 1, block_sizes.pop(), 0).bytes_per_block()
