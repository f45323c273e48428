"""The ``metal`` backend: the bundled MLX paged-attention runtime, sized from real allocations.

What vllm-metal takes from vLLM core (page specs, the hybrid alignment it delegates upstream,
grouping, the admission check) is inherited from the reference. What vllm-metal computes
itself comes from :mod:`pytest_kvconform.metal_runtime` and arrays it really allocates:

* the kernel block size and the block-table split (``_pick_kernel_block_size``,
  ``_build_block_tables``), and each cache as the kernel is handed it (``sdpa_forward``);
* the bytes of one pool block (``get_cache_block_size_bytes``: the paged layers only) and
  the number of blocks a budget holds (``_paged_attention_plan``: ``budget // per_block``);
* the one-sequence estimate (``estimate_one_sequence_kv_bytes``);
* the allocation of a planned pool and its guard against a larger engine config
  (``ModelCachePolicy.initialize_kv_cache``, PR #527).

Like vllm-metal, the runtime stores K/V in the model dtype (float16, bfloat16 or float32)
and never reads ``--kv-cache-dtype``; scenarios that ask for a packed or 8-bit cache are
known departures of this backend, each naming its field (:attr:`MetalBackend.known_departures`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from ..model import KVCacheView, KVPlan, MemoryCheck, PoolAllocation
from ..reference import plan as reference_plan
from ..reference.specs import AttentionSpec, KVCacheSpec, MambaSpec
from ..reference.speculative import num_draft_layers, speculative_method
from ..requirements import (
    NO_KV_CACHE,
    NO_PAGED_ATTENTION,
    PIPELINE_PARALLEL,
    QUANTIZED_KV,
    SPEC_LEVEL,
    TENSOR_PARALLEL,
    Declines,
    InputKind,
    KnownDeparture,
)
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
_NO_QUANTIZED_CACHE = (
    "vllm-metal stores K/V in the model dtype and never reads --kv-cache-dtype (vllm-metal @ 211a1e4, "
    "attention/caches/kv_cache.py allocates model_config.dtype): the MLX pool has no cache in a "
    "quantized or packed kv_cache_dtype for the kernel to read"
)
_FROM_VLLM_CORE = "vllm-metal takes it from vLLM core (its platform and worker call vLLM's own code)"
_QUANTIZED = (
    "vllm-metal stores K/V in the model dtype and never reads --kv-cache-dtype (vllm-metal @ 211a1e4, "
    "v1/cache_policy.py and attention/caches/kv_cache.py allocate model_config.dtype): a quantized "
    "kv_cache_dtype's pages are billed at the model dtype"
)


def _mtp_draft(scenario: Scenario) -> bool:
    return (
        scenario.model is not None
        and speculative_method(scenario) == "mtp"
        and num_draft_layers(scenario) > 0
    )


def _pool_per_layer(scenario: Scenario) -> bool:
    model = scenario.model
    if model is None or not model.is_hybrid:
        return False
    try:
        return reference_plan(scenario).group_size != model.num_attention_layers
    except ValueError:  # a plan the reference rejects has no groups
        return False


#: The MTP drafter's attention layers (vLLM's worker reports them; the MLX pool holds the target's)
MTP_DRAFT = InputKind("mtp_draft", "MTP draft layers (num_nextn_predict_layers, method mtp)", _mtp_draft)
#: A hybrid whose vLLM groups hold more pages per block than it has attention layers
SHARED_GROUP_SLOTS = InputKind(
    "shared_group_slots",
    "a hybrid whose KV cache groups (get_kv_cache_groups) bill more pages per block than its "
    "attention layers",
    _pool_per_layer,
)


#: how a departure in which the MLX pool refuses the input shows (``conformance.assert_same_outcome``)
_REFUSES = "rejects: unsupported_kv_cache_dtype"


def _refuses(rule: str, test: str, field: str, reason: str) -> KnownDeparture:
    return KnownDeparture(rule=rule, test=test, field=field, reason=reason, value=_REFUSES)


class MetalBackend(ReferenceBackend):
    """vllm-metal's own sizing rules answered by the MLX runtime (Metal GPU on macOS, CPU on Linux)."""

    name: ClassVar[str] = "metal"
    #: the runtime allocates a pool; it serves one device, model-level scenarios with paged layers
    declines: ClassVar[Declines] = ReferenceBackend.declines.without("allocation") | Declines({
        ("allocation", SPEC_LEVEL): "a spec-level scenario has no model geometry for the Metal pool",
        ("allocation", TENSOR_PARALLEL): "the Metal runtime serves one device: it holds every head, "
        "not a tensor-parallel shard",
        ("allocation", NO_PAGED_ATTENTION): "no paged attention layers: the Metal pool is empty",
        ("allocation", PIPELINE_PARALLEL): "the Metal runtime serves one device: its pool holds every "
        "layer, not one pipeline stage's",
        ("memory", PIPELINE_PARALLEL): "vllm-metal serves one device: no pipeline stages to plan",
        ("memory", NO_KV_CACHE): "vllm-metal sizes its paged pool from attention layers; "
        "a model without a KV cache is planned by vLLM core",
    })  # fmt: skip
    #: What vllm-metal does not compute itself: the reference's code answers, reported as inherited.
    inherits: ClassVar[Mapping[str, str]] = dict.fromkeys(
        ("dtype", "hybrid_alignment", "block_size", "state_page", "layer_specs", "attention_page",
         "max_memory", "unification", "grouping"), _FROM_VLLM_CORE,
    )  # fmt: skip
    known_departures: ClassVar[Sequence[KnownDeparture]] = (
        # the pool refuses a quantized or packed kv_cache_dtype (it stores the model dtype)
        *(_refuses(rule, test, field, reason) for rule, test, field, reason in (
            ("plan", "test_plan[glm-5-fp8-ds-mla]", "plan", _FP8_DS_MLA),
            ("plan", "test_expectations[glm-5-fp8-ds-mla]", "plan", _FP8_DS_MLA),
            ("memory", "test_check_memory[glm-5-fp8-ds-mla]", "check_memory", _FP8_DS_MLA),
            ("plan", "test_plan_golden[glm5-fp8-ds-mla]", "plan", _FP8_DS_MLA),
            ("attention_page", "test_glm5_fp8_ds_mla_pages", "plan", _FP8_DS_MLA),
            ("plan", "test_plan_golden[vllm-b2-mla-mamba-fp8-ds-mla]", "plan", _FP8_DS_MLA),
            ("plan", "test_plan_golden[vllm-b2-kimi-linear-mla-kda-fp8-ds-mla]", "plan", _FP8_DS_MLA),
            ("plan", "test_expectations[*-mla-*-fp8-ds-mla-probe]", "plan", _FP8_DS_MLA),
            ("dtype", "test_registered_kv_cache_dtype[int8]", "plan", _INT_STORAGE),
            ("plan", "test_plan_golden[vllm-39931-qwen36-turboquant-k8v4]", "plan", _TURBOQUANT),
            ("plan", "test_vllm39931_qwen36_turboquant_k8v4_real_run", "plan", _TURBOQUANT),
        )),
        *(_refuses(rule, f"{test}[{scenario}]", field, reason)
          for scenario, reason in (("deepseek-v3-fp8", _FP8), ("deepseek-v3.2-fp8-ds-mla", _FP8_DS_MLA),
                                   ("llama-3.1-8b-instruct-turboquant-k8v4", _TURBOQUANT_DENSE),
                                   ("qwen3.6-35b-a3b-turboquant-k8v4", _TURBOQUANT))
          for rule, test, field in (("plan", "test_plan", "plan"), ("plan", "test_expectations", "plan"),
                                    ("memory", "test_check_memory", "check_memory"))),
        # the pool of 3 blocks the test allocates: 3 x its bytes per block (one page per attention
        # layer, the model dtype)
        *(KnownDeparture("allocation", "bytes_held", reason,
                         f"test_pool_holds_exactly_the_planned_blocks[{name}]",
                         reference=str(3 * reference), value=str(3 * value))
          for name, reference, value, reason in (
              ("gemma-3-27b-it", 1_310_720, 8_126_464, _PER_LAYER_POOL),
              ("gemma-3-1b-it-rbln-cr03", 4_194_304, 27_262_976, _PER_LAYER_POOL),
              ("gemma-4-31b-it", 2_621_440, 14_417_920, _PER_LAYER_POOL),
              ("gpt-oss-20b", 393_216, 786_432, _PER_LAYER_POOL),
              ("qwen3.5-35b-a3b-mtp1", 23_789_568, 21_626_880, _MTP_DRAFT_NOT_POOLED),
              ("glm-5-fp8-ds-mla", 3_933_696, 5_750_784, _FP8_DS_MLA),
              ("llama-3.1-8b-instruct-turboquant-k8v4", 1_929_216, 4_194_304, _TURBOQUANT_DENSE),
              # fp8 (1 B) billed at bf16 (2 B): 32 layers x 16 tokens x 2 x 8 x 128 x 2 B
              ("llama-3.1-8b-instruct-fp8", 1_048_576, 2_097_152, _QUANTIZED),
              ("qwen3.6-35b-a3b-turboquant-k8v4", 21_479_680, 56_688_640, _TURBOQUANT),
          )),
        # generated inputs, by kind of input
        KnownDeparture("memory", "check_memory", _QUANTIZED, when=QUANTIZED_KV, value=_REFUSES),
        KnownDeparture("plan", "plan", _QUANTIZED, when=QUANTIZED_KV, value=_REFUSES),
        KnownDeparture("kernel_block", "kernel_cache_views", _NO_QUANTIZED_CACHE, when=QUANTIZED_KV,
                       value=_REFUSES),
        *(KnownDeparture(rule, "bytes_per_block", reason, when=kind) for rule in ("memory", "plan")
          for kind, reason in ((MTP_DRAFT, _MTP_DRAFT_NOT_POOLED), (SHARED_GROUP_SLOTS, _PER_LAYER_POOL))),
    )  # fmt: skip

    def __init__(self) -> None:
        import mlx.core as mx  # ImportError here becomes the registry's install hint

        self._mx = mx

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

    def kernel_cache_views(
        self, specs: dict[str, KVCacheSpec], num_blocks: int, scenario: Scenario | None = None
    ) -> tuple[KVCacheView, ...]:
        """The caches of a pool really allocated for each paged layer of ``specs`` (one pool per
        distinct layer geometry), as the kernel is handed them."""
        from ..metal_runtime import KVPool

        pools: dict[tuple[Any, int], Any] = {}
        views: list[KVCacheView] = []
        for name, spec in specs.items():
            if isinstance(spec, AttentionSpec):
                layer = _pool_layer(spec)
                if (layer, spec.block_size) not in pools:
                    pools[layer, spec.block_size] = KVPool([layer], num_blocks, spec.block_size, 0)
                views += _kernel_views(name, spec, pools[layer, spec.block_size])
        return tuple(views)

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

        paged = [layer for layer in _scenario_layers(scenario) if layer.is_paged]
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


def _pool_layer(spec: AttentionSpec) -> Any:
    """The Metal pool's layer for an attention spec: K/V (or an MLA latent) in the spec's dtype."""
    from ..metal_runtime import attention_layer, mla_layer

    if spec.state_content_bytes is not None or spec.num_head_slots is not None or spec.page_size_padded:
        raise ValueError(
            f"the Metal runtime has no packed or padded KV pages ({spec.kind}, "
            f"{spec.state_content_size_bytes} B per head slot); it stores plain K/V"
        )
    if spec.is_mla:
        return mla_layer(spec.head_size, 0, spec.dtype)
    return attention_layer(spec.num_kv_heads, spec.head_size, spec.dtype, spec.head_size_v)


def _pool_bytes_per_block(specs: Sequence[KVCacheSpec]) -> int:
    """Bytes of one block of a pool allocated for the attention layers of ``specs`` (the Metal
    pool holds paged layers only; state lives in separate slots)."""
    from ..metal_runtime import KVPool

    attention = [s for s in specs if isinstance(s, AttentionSpec)]
    if not attention:
        raise ValueError("the Metal pool holds paged attention layers; these specs have none")
    block_sizes = {s.block_size for s in attention}
    if len(block_sizes) != 1:
        raise ValueError(f"the Metal pool has one block size; the specs have {sorted(block_sizes)}")
    return KVPool([_pool_layer(s) for s in attention], 1, block_sizes.pop(), 0).bytes_per_block()


def _kernel_views(name: str, spec: AttentionSpec, pool: Any) -> list[KVCacheView]:
    """The ``[B, H, N, C]`` views of one layer's arrays in ``pool`` (a pool of that layer alone)
    as the kernel is handed them: K and V reshaped to kernel blocks (``reshape_cache_for_kernel``,
    as vllm-metal's ``sdpa_forward``), an MLA latent whole. The axes are the allocated arrays'
    (K/V ``[blocks, tokens, heads, dim]``, latent ``[blocks, tokens, dim]``); MLX arrays are
    row-major, so an axis's stride is the product of the later axes' extents."""
    from ..metal_runtime import pick_kernel_block_size, reshape_cache_for_kernel

    views = []
    for cache, array in pool.caches[0].items():
        if spec.is_mla:
            array = array.reshape(array.shape[0], array.shape[1], 1, array.shape[2])
        else:
            array = reshape_cache_for_kernel(array, pick_kernel_block_size(spec.block_size))
        blocks, tokens, heads, width = array.shape
        dtype = str(array.dtype).rsplit(".", 1)[-1]
        shape, stride = (blocks, heads, tokens, width), (tokens * heads * width, width, heads * width, 1)
        views.append(KVCacheView(f"{name}.{_CACHE_NAMES[cache]}", dtype, shape, stride, 0))
    return views


#: the pool's array names -> vllm-metal's cache names
_CACHE_NAMES = {"k": "key_cache", "v": "value_cache", "latent": "latent_cache"}
