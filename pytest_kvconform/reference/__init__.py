"""The reference: the KV-cache sizing rules of vLLM 0.33.0 core and vllm-metal, in pure Python.

Not modelled: Phase 3 of ``update_block_size_for_backend`` (heterogeneous KV dtypes from
``kv_cache_dtype_skip_layers``), per-layer attention geometry in model-level scenarios beyond
the full-attention layers' own head size and KV heads (Gemma 4's ``global_head_dim`` /
``num_global_key_value_heads``, modelled) and KV-shared layers (Gemma 4's ``num_kv_shared_layers``;
the spec-level form covers both), the align-mode prefill checkpoint alignment of
constructed layers (``extra_block_alignment`` stands for it), speculative draft layers and
pipeline parallelism. vLLM's auto-fit of ``max_model_len`` (``max_model_len = -1``) is modelled
for one worker (:func:`.memory.check_memory`); its attention-free case is not (no groups: no plan).

One module per rule family, each function citing the vLLM source it mirrors. Standard
library only, so any backend can be checked against it without importing vLLM.
"""

from .rules import plan

#: The vLLM release whose rules the reference mirrors.
VLLM_TARGET = "0.33.0"

__all__ = ["VLLM_TARGET", "plan"]
