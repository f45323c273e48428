"""The reference: the KV-cache sizing rules of vLLM 0.33.0 core and vllm-metal, in pure Python.

Not modelled: ``kv_cache_dtype_skip_layers`` on MLA models (refused: ``MLAAttention`` honours the
list only from vLLM 0.27, and Phase 3 of ``update_block_size_for_backend`` prices an MLA layer as a
K+V ``FullAttentionSpec``), per-layer attention geometry in model-level scenarios beyond the
full-attention layers' own head size and KV heads (Gemma 4's ``global_head_dim`` /
``num_global_key_value_heads``, modelled) and KV-shared layers (Gemma 4's ``num_kv_shared_layers``;
the spec-level form covers both), the align-mode prefill checkpoint alignment of
constructed layers (``extra_block_alignment`` stands for it), the layers of a draft with a
checkpoint of its own (EAGLE heads, draft models: their config is not the scenario's, so a
model-level scenario with one is refused in one line and the spec-level form lists them).
The MTP drafter's layers are modelled (:func:`.speculative.num_draft_layers`), and so are
pipeline stages (:mod:`.parallel`). vLLM's auto-fit of ``max_model_len`` (``max_model_len = -1``)
is modelled for one worker (:func:`.memory.check_memory`); a model without KV cache groups plans
vLLM's one null block (:func:`.memory.attention_free_check`).
Grouping (:mod:`.grouping`): the MLA + sliding-window full-allocation fallback (0.27+) is
modelled; merging specs that differ yet merge and 0.32's per-layer block-stride rounding move no
bytes of any spec the reference builds (followed by construction; docs/scenario-derivations.md
10a, 10c). Not modelled: 0.31's rounding of a group's bytes per block to the block-stride
alignment of one-row sparse MLA caches, which depends on the attention backend and the GPU
generation (FLASHMLA_SPARSE, FLASHINFER_MLA_SPARSE, SM100) that no scenario states.

One module per rule family, each function citing the vLLM source it mirrors. Standard
library only, so any backend can be checked against it without importing vLLM.
"""

from .rules import plan

#: The vLLM release whose rules the reference mirrors.
VLLM_TARGET = "0.33.0"

__all__ = ["VLLM_TARGET", "plan"]
