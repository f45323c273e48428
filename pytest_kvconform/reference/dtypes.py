"""KV cache and Mamba dtypes: storage dtype and element size.

Mirrors ``STR_DTYPE_TO_TORCH_DTYPE`` and ``get_dtype_size`` (vllm/utils/torch_utils.py),
``kv_cache_dtype_str_to_dtype`` and ``MambaStateDtypeCalculator``
(vllm/model_executor/layers/mamba/mamba_utils.py) of vLLM 0.33.0.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..scenario import KV_CACHE_DTYPES
from .releases import LATEST, RuleSet

#: torch dtype name -> element size in bytes (``get_dtype_size``).
DTYPE_SIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2,
    "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip

_NAME_ALIASES = {"half": "float16", "float": "float32"}

#: ``kv_cache_dtype`` -> the ``releases.CHANGES`` entry that added it to ``CacheDType``
#: (vllm/config/cache.py); the others are in every release with a rule set (0.23+).
DTYPE_SINCE = {
    "int4_per_token_head": "int4_per_token_head_dtype", "nvfp4_4over6": "nvfp4_4over6_dtype",
    "nvfp4_ds_mla": "nvfp4_ds_mla_dtype", "ultraquant_4bit": "ultraquant_4bit_dtype",
    "octave_k3v4": "octave_dtypes", "octave_k3v3": "octave_dtypes", "octave_k3v3_compact": "octave_dtypes",
}  # fmt: skip


def release_kv_cache_dtypes(release: RuleSet = LATEST) -> tuple[str, ...]:
    """``CacheDType`` of ``release``: :data:`KV_CACHE_DTYPES` less those added later."""
    return tuple(d for d in KV_CACHE_DTYPES if d not in DTYPE_SINCE or release.has(DTYPE_SINCE[d]))


def storage_dtype(
    kv_cache_dtype: str,
    model_dtype: str,
    registered: Iterable[tuple[str, str]] = (),
    release: RuleSet = LATEST,
) -> str:
    """The torch dtype a ``kv_cache_dtype`` string stores in (``STR_DTYPE_TO_TORCH_DTYPE``).

    ``auto`` is the model dtype (``kv_cache_dtype_str_to_dtype``). Every fp8, fp4,
    int4 and packed format is one byte: ``uint8``, except ``int8``/``int8_per_token_head``
    (``int8``) and ``fp8_inc`` (``float8_e4m3fn``). A name in ``registered`` stores in its
    handler's ``torch_dtype()``, which ``register_kv_cache_dtype`` (vllm/config/cache.py, vLLM
    0.33) writes into ``STR_DTYPE_TO_TORCH_DTYPE``, overwriting a built-in entry of that name.
    A name ``release`` lacks (:data:`DTYPE_SINCE`) is refused as ``CacheConfig``'s pydantic
    validation refuses it (a ``ValueError``).
    """
    registered = dict(registered)
    if kv_cache_dtype in registered:
        return registered[kv_cache_dtype]
    name = _NAME_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name == "auto":
        return model_dtype
    if name in ("float16", "bfloat16", "float32"):
        return name
    if name in ("int8", "int8_per_token_head"):
        return "int8"
    if name == "fp8_inc":
        return "float8_e4m3fn"
    if name in DTYPE_SINCE and not release.has(DTYPE_SINCE[name]):
        raise ValueError(
            f"cache_dtype: {kv_cache_dtype!r} is not a CacheDType of vLLM {release.release}; valid values "
            f"are: {list(release_kv_cache_dtypes(release))}"
        )
    if name in KV_CACHE_DTYPES:
        return "uint8"
    raise ValueError(f"Invalid kv_cache_dtype: {kv_cache_dtype!r}. Valid values are: {list(KV_CACHE_DTYPES)}")


def kv_cache_dtype_bytes(
    kv_cache_dtype: str,
    model_dtype: str,
    registered: Iterable[tuple[str, str]] = (),
    release: RuleSet = LATEST,
) -> int:
    """Element size of the KV storage dtype (``get_dtype_size(kv_cache_dtype_str_to_dtype(...))``)."""
    return DTYPE_SIZE[storage_dtype(kv_cache_dtype, model_dtype, registered, release)]


def mamba_dtypes(
    state_kind: str,
    model_dtype: str,
    mamba_cache_dtype: str,
    mamba_ssm_cache_dtype: str,
    model_ssm_dtype: str = "auto",
    release: RuleSet = LATEST,
) -> tuple[str, str]:
    """(conv dtype, recurrent dtype) of a state layer (``MambaStateDtypeCalculator``).

    The conv state follows ``mamba_cache_dtype`` (``auto`` = model dtype). The recurrent
    state follows ``mamba_ssm_cache_dtype``; its ``auto`` is resolved per model first:
    ``model_ssm_dtype`` carries that resolution (Qwen3.5/3.6 copy the config's
    ``mamba_ssm_dtype``, NemotronH defaults to float32, KDA is always float32 on auto).
    A remaining ``auto`` follows the conv dtype. short_conv has no recurrent state; its
    second entry repeats the conv dtype. Before ``kda_ssm_cache_dtype`` (vLLM 0.30) KDA's
    recurrent state is float32 whatever ``mamba_ssm_cache_dtype`` says (``kda_state_dtype``).
    """
    conv = model_dtype if mamba_cache_dtype == "auto" else mamba_cache_dtype
    if state_kind == "kda" and not release.has("kda_ssm_cache_dtype"):
        return conv, "float32"
    ssm = mamba_ssm_cache_dtype
    if ssm == "auto":
        ssm = "float32" if state_kind == "kda" else model_ssm_dtype
    if ssm == "auto":
        ssm = conv
    if state_kind == "kda" and ssm not in ("float32", "bfloat16"):
        raise ValueError(f"KDA recurrent state supports only auto, float32, and bfloat16; got {ssm}")
    return conv, ssm
