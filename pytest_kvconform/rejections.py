"""Rejections compared by kind: the closed set of reasons the engine refuses a configuration.

vLLM refuses a configuration by raising ``ValueError``, ``NotImplementedError`` or
``AssertionError`` with a message; the reference raises the same texts. Two rejections agree when
they are of the same :data:`KINDS` entry, whatever their class or wording: a plugin's own message
for "not enough memory" agrees with vLLM's. :func:`rejection_kind` maps a message to its kind
(:data:`PATTERNS`, vLLM's texts first); a backend that words its own refusal raises
:class:`Rejected` with the kind. An exception of those classes that maps to no kind is not a
rejection: it is a crash of whatever raised it (a bad option, a bug), never an answer.
"""

from __future__ import annotations

import re

#: kind -> what the engine refuses (docs/backends.md lists them with vLLM's functions)
KINDS: dict[str, str] = {
    "parallel_split": "a tensor or decode-context parallel size the model's heads do not divide "
    "(ModelConfig.verify_with_parallel_config, ParallelConfig)",
    "pages_not_unifiable": "layer pages the planner cannot unify (unify_kv_cache_spec_page_size, "
    "unify_kv_cache_specs, a KV cache layout that cannot express mixed pages, layers of several "
    "kinds with the hybrid KV cache manager disabled: unify_hybrid_kv_cache_specs)",
    "not_enough_memory": "no memory for one block, for one max-length request, or for one token "
    "when auto-fitting (_check_enough_kv_cache_memory, get_kv_cache_configs, _auto_fit_max_model_len)",
    "unsupported_kv_cache_dtype": "a kv_cache_dtype the release, the layer or the attention backend "
    "does not support (CacheConfig, the backend's supported dtypes, a pool that stores no such dtype)",
    "unsupported_block_size": "a block size the kernel or the engine refuses (no kernel block "
    "of the attention backends divides it: select_common_block_size; align mode above "
    "max_num_batched_tokens before vLLM 0.27)",
    "unsupported_combination": "a combination of features the engine refuses (sliding window with "
    "decode context parallelism, a prefix-match unit the groups do not align with)",
    "unsupported_setting": "a setting value the release does not accept (--mamba-cache-mode all from "
    "vLLM 0.32: CacheConfig.mamba_cache_mode)",
    "invalid_padding": "a padded page smaller than the page it pads "
    "(Platform._align_heterogeneous_kv_block_size)",
    "oversized_config": "an engine KV cache config of more blocks than the allocated pool (vllm-metal #527)",
    "no_attention_backend": "the platform has no attention backend for the model's layers "
    "(Platform.get_attn_backend_cls refuses)",
    "not_modelled": "an input the reference does not model (it says which): nothing to compare with",
}

#: (kind, message pattern), vLLM's texts and the reference's (which repeat them); first match wins
PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(pattern, re.IGNORECASE | re.DOTALL))
    for kind, pattern in (
        ("not_enough_memory", r"No available memory for the cache blocks"),
        ("not_enough_memory", r"KV cache is needed, which is larger than the available KV cache memory"),
        ("not_enough_memory", r"Cannot auto-fit max_model_len"),
        ("not_enough_memory", r"Cannot fit both KV pools under gpu_memory_utilization"),  # tpu-inference
        ("pages_not_unifiable", r"page size (of the layer )?is not divisible by the maximum page size"),
        ("pages_not_unifiable", r"block scaling cannot change a Mamba page"),
        ("pages_not_unifiable", r"Failed to promote local KV cache specs to one unified type"),
        ("pages_not_unifiable", r"Hybrid KV cache manager is disabled but failed to convert"),
        ("pages_not_unifiable", r"KV cache layout \w+ cannot express this model's mixed page sizes"),
        (
            "parallel_split",
            r"must be divisible by ?(tensor parallel size|dcp_size|dcp world size|"
            r"`--decode-context-parallel-size`)",
        ),
        ("parallel_split", r"Decode context parallelism for GQA/MQA requires"),
        # vllm/distributed/utils.py ensure_divisibility (divide: heads or groups over TP ranks)
        ("parallel_split", r"^\d+ is not divisible by \d+$"),
        ("parallel_split", r"tensor parallel world size does not divide num_groups"),
        ("parallel_split", r"Tensor parallel world size must divide num heads"),
        ("parallel_split", r"`--decode-context-parallel-size` \(\d+\) exceeds the maximum"),
        ("parallel_split", r"tensor parallel size \d+ must be greater than total num kv heads"),
        ("parallel_split", r"decode context parallel size must less than or equal to"),
        ("unsupported_combination", r"DCP not support sliding window"),
        ("unsupported_combination", r"Pipeline parallelism is not supported for this model"),
        ("unsupported_combination", r"Invalid prefix_match_unit"),
        ("unsupported_kv_cache_dtype", r"Invalid kv_cache_dtype"),
        ("unsupported_kv_cache_dtype", r"is not a CacheDType of vLLM"),
        ("unsupported_kv_cache_dtype", r"FlashInfer nvfp4 KV cache needs"),
        ("unsupported_kv_cache_dtype", r"KDA recurrent state supports only"),
        ("unsupported_kv_cache_dtype", r"no packed or padded KV pages"),
        (
            "unsupported_kv_cache_dtype",
            r"unsupported dtype '\w+'; expected one of float16, bfloat16, float32",
        ),
        ("unsupported_block_size", r"is not divisible by any supported kernel block size"),
        ("unsupported_block_size", r"No common block size for \d+"),
        ("unsupported_block_size", r"block_size \(\d+\) must be <= max_num_batched_tokens"),
        ("unsupported_setting", r"mamba_cache_mode\n\s+Input should be 'align' or 'none'"),
        ("invalid_padding", r"padded-spec per-token page \(\d+B\) < primary"),
        ("oversized_config", r"requests \d+ blocks but the [\w ]*pool was allocated with \d+"),
        ("no_attention_backend", r"Sparse Attention is not supported on CPU"),
        ("no_attention_backend", r"No valid attention backend found for"),
        (
            "not_modelled",
            r"not modelled|a model-level scenario cannot state|need the model's \[model\.attention\]",
        ),
    )
)


#: vLLM's bare ``assert`` statements (no message) that refuse a configuration, by where they stand:
#: (file, function) -> kind; the reference's mirrors of them are listed too
BARE_ASSERTS: dict[tuple[str, str], str] = {
    # AttentionSpec / MambaSpec.page_size_bytes: a padded page below the real one (unify scaling a
    # padded page's block; vllm/v1/kv_cache_interface.py)
    ("vllm/v1/kv_cache_interface.py", "page_size_bytes"): "invalid_padding",
    ("pytest_kvconform/reference/specs.py", "__post_init__"): "invalid_padding",
    # unify_kv_cache_spec_page_size scaling a Mamba spec's block, which moves no Mamba page
    # (vLLM 0.23's scale-only unification: "assert new_spec.page_size_bytes == max_page_size")
    ("vllm/v1/core/kv_cache_utils.py", "unify_kv_cache_spec_page_size"): "pages_not_unifiable",
}


def raised_at(error: BaseException) -> tuple[str, int, str]:
    """(file, line, function) of the innermost frame of ``error``, or what its own process
    recorded (``kvconform_where``: ``file:line in function``, for an exception from a backend's
    process); ``("", 0, "")`` when it has no traceback."""
    crossed = getattr(error, "kvconform_where", None)
    if crossed:
        place, _, function = str(crossed).partition(" in ")
        file, _, line = place.rpartition(":")
        return file, int(line) if line.isdigit() else 0, function
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "", 0, ""
    return tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name


class Rejected(ValueError):
    """A backend's own refusal, of a :data:`KINDS` kind: ``raise Rejected("not_enough_memory",
    "0.18 GiB needed, 0.16 GiB free")``. Compared by kind with the reference's rejection."""

    def __init__(self, kind: str, message: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"Rejected({kind!r}): expected one of {', '.join(KINDS)}")
        super().__init__(message)
        self.kind = kind


#: the exception classes a rejection may be raised as (vLLM's, and :class:`Rejected`)
REJECTION_CLASSES: tuple[type[BaseException], ...] = (ValueError, NotImplementedError, AssertionError)


def rejection_kind(error: BaseException) -> str | None:
    """The :data:`KINDS` entry ``error`` refuses with, or None when it is no rejection (another
    class, or a message no pattern knows: a crash, not an answer)."""
    kind = getattr(error, "kind", None)
    if isinstance(error, Rejected) and kind in KINDS:
        return str(kind)
    if not isinstance(error, REJECTION_CLASSES):
        return None
    text = str(error)
    kind = next((kind for kind, pattern in PATTERNS if pattern.search(text)), None)
    if kind is None and isinstance(error, AssertionError):
        path, _, function = raised_at(error)
        path = path.replace("\\", "/")
        kind = next(
            (k for (file, fn), k in BARE_ASSERTS.items() if path.endswith(file) and fn == function), None
        )
    return kind
