"""Pool planning: bytes per block, num_blocks, the null block, admission and the estimate.

Mirrors ``get_kv_cache_configs``, ``_check_enough_kv_cache_memory``,
``_estimate_max_model_len_from_groups`` (v1/core/kv_cache_planning.py in vLLM 0.33.0,
v1/core/kv_cache_utils.py before), ``BlockPool`` (v1/core/block_pool.py: block 0 is the null
block), ``get_max_concurrency_for_kv_cache_config`` (v1/core/kv_cache_utils.py: ``num_blocks``
over the blocks one request needs, the null block included) and ``format_gib``
(vllm/utils/mem_utils.py).

Where the null block is subtracted, per release (read in each release's source): never inside
``_check_enough_kv_cache_memory`` nor ``_estimate_max_model_len_from_groups``, in no release.
From 0.29 (``null_block_reserved``) ``get_kv_cache_configs`` subtracts one pool block from each
worker's budget (its ``check_memory`` list) and hands that to the admission check, which hands the
same bytes to the estimate (and to auto-fit); allocation still gets the whole budget. In 0.23
... 0.28 the check and the estimate get the whole budget. :func:`admission_budget` is that step,
:func:`check_memory` the check, :func:`estimate_max_model_len` the estimate on the bytes it is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..model import MemoryCheck
from ..scenario import RuntimeSettings
from .grouping import GroupSpec

NO_MEMORY_ERROR = (
    "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
    "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, "
    "despite its name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ "
    "for more details."
)


#: ``_auto_fit_max_model_len``'s error when not one token fits (vLLM 0.23 ... 0.33).
AUTO_FIT_ERROR = (
    "Cannot auto-fit max_model_len: not enough GPU memory available to serve even a single token. "
    "Try increasing `gpu_memory_utilization`."
)


def format_gib(num_bytes: int) -> str:
    """``format_gib``: GiB rounded to two decimals by ``round`` (so ``1.0``, not ``1.00``)."""
    return f"{round(num_bytes / 2**30, 2)}"


def not_enough_memory_error(max_model_len: int, needed: int, available: int, estimate: int) -> str:
    """The exact text of ``_check_enough_kv_cache_memory`` (unbalanced "(" included)."""
    estimate_msg = (
        f"Based on the available memory, the estimated maximum model length is {estimate}. "
        if estimate > 0
        else ""
    )
    return (
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"({format_gib(needed)} GiB KV cache is needed, which is larger than the available KV "
        f"cache memory ({format_gib(available)} GiB). {estimate_msg}Try increasing "
        "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or decreasing "
        "`max_model_len` when initializing the engine. See "
        "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    )


def auto_fit_message(derived: int, fitted: int, memory: int, *, kv_cache_memory_text: bool) -> str:
    """The text ``_auto_fit_max_model_len`` logs (``logger.info_once``) for one worker's ``memory``
    bytes (the limiting worker's; the budget the admission check sees): ``fitted < derived``
    reduces ``max_model_len``, else the model's whole context fits. From vLLM 0.32
    (``auto_fit_kv_cache_memory_text``) it names "available KV cache memory (<GiB> GiB GPU)"
    (``_kv_cache_device_name``: "GPU" on CUDA; the reference plans for CUDA); in 0.23 ... 0.31
    "available GPU memory", the reduced form adding "(<GiB> GiB available for KV cache)"."""
    gib = format_gib(memory)
    if fitted >= derived:
        return (
            f"Auto-fit max_model_len: full model context length {derived} fits in available KV cache "
            f"memory ({gib} GiB GPU)"
            if kv_cache_memory_text
            else f"Auto-fit max_model_len: full model context length {derived} fits in available GPU memory"
        )
    where = (
        f"available KV cache memory ({gib} GiB GPU)"
        if kv_cache_memory_text
        else f"available GPU memory ({gib} GiB available for KV cache)"
    )
    return f"Auto-fit max_model_len: reduced from {derived} to {fitted} to fit in {where}"


@dataclass(frozen=True)
class NeededBytes:
    """What the admission check reads of the groups: the bytes one block id costs and the bytes
    one request of a given ``max_model_len`` needs (``_max_memory_usage_bytes_from_groups``)."""

    bytes_per_block: int
    needed: Callable[[int], int]


def need_of_groups(groups: Sequence[GroupSpec], rt: RuntimeSettings) -> NeededBytes:
    return NeededBytes(
        bytes_per_block(groups),
        lambda length: needed_bytes(groups, dataclasses.replace(rt, max_model_len=length)),
    )


def bytes_per_block(groups: Sequence[GroupSpec]) -> int:
    """``max`` over groups of the bytes one block id costs (layer-outer layout)."""
    return max((g.bytes_per_block for g in groups), default=0)


def blocks_per_request(groups: Sequence[GroupSpec], rt: RuntimeSettings) -> int:
    """Blocks one request at ``rt.max_model_len`` needs, summed over groups."""
    return sum(g.blocks_per_request(rt) for g in groups)


def needed_bytes(groups: Sequence[GroupSpec], rt: RuntimeSettings) -> int:
    """``_max_memory_usage_bytes_from_groups``: ``bytes_per_block * sum(blocks per group)``."""
    return bytes_per_block(groups) * blocks_per_request(groups, rt)


def estimate_max_model_len(
    groups: Sequence[GroupSpec] | NeededBytes, rt: RuntimeSettings, available: int
) -> int:
    """Binary search over ``[1, max_model_len]`` for the longest length that fits ``available``.

    Returns 0 when not even one token fits (``_estimate_max_model_len_from_groups``). It reserves
    nothing: ``available`` is the budget the caller hands it, as vLLM's (0.23 ... 0.33) is
    handed the admission check's bytes (:func:`admission_budget`).
    """
    need = groups if isinstance(groups, NeededBytes) else need_of_groups(groups, rt)

    def fits(length: int) -> bool:
        return need.needed(length) <= available

    lo, hi = 1, rt.max_model_len
    if fits(hi):  # needed bytes grow with the length: the search would end here
        return hi
    if not fits(lo):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def available_kv_bytes(groups: Sequence[GroupSpec] | NeededBytes, rt: RuntimeSettings) -> int:
    """Bytes the pool may use: ``kv_cache_memory_bytes``, or ``override * bytes_per_block``."""
    if rt.num_gpu_blocks_override is not None:
        bpb = groups.bytes_per_block if isinstance(groups, NeededBytes) else bytes_per_block(groups)
        return rt.num_gpu_blocks_override * bpb
    return rt.kv_cache_memory_bytes


def admission_budget(available: int, bytes_per_block: int, *, reserve_null_block: bool) -> int:
    """The bytes ``get_kv_cache_configs`` hands to ``_check_enough_kv_cache_memory``, which hands
    them on to ``_estimate_max_model_len_from_groups``: from vLLM 0.29 (``null_block_reserved``,
    vllm#47272 / vllm#48724) ``available - bytes_per_block`` (its ``check_memory`` list: block 0 is
    ``BlockPool``'s null block); in 0.23 ... 0.28 all of ``available``."""
    return available - bytes_per_block if reserve_null_block else available


#: ``_auto_fit_max_model_len``'s text for a model without KV cache groups (vLLM 0.23 ... 0.33).
ATTENTION_FREE_AUTO_FIT = "Auto-fit max_model_len: attention-free model, using derived max_model_len={}"


def attention_free_check(rt: RuntimeSettings) -> MemoryCheck:
    """The plan of a model no layer of which holds a KV cache (no groups: an encoder-only model,
    ``is_kv_cache_type_attention_free``), the same in vLLM 0.23 ... 0.33. ``EngineCore.
    _initialize_kv_caches`` hands ``get_kv_cache_configs`` 0 bytes without probing the worker;
    no admission check runs; ``get_kv_cache_config_from_groups`` returns ``num_blocks=1`` ("BlockPool
    always needs a null_block"); the capacity (``update_kv_cache_capacity``) is not computed:
    ``max_concurrency`` 0.0 here. Auto-fit keeps the derived length and logs so."""
    fit = rt.auto_fit_max_model_len
    return MemoryCheck(
        bytes_per_block=0, num_blocks=1, needed_bytes=0, available_bytes=0, admission="ok",
        max_model_len_estimate=0, max_concurrency=0.0, max_model_len=rt.max_model_len if fit else None,
        auto_fit=ATTENTION_FREE_AUTO_FIT.format(rt.max_model_len) if fit else "",
    )  # fmt: skip


def check_memory(
    groups: Sequence[GroupSpec] | NeededBytes,
    rt: RuntimeSettings,
    estimate_for: Callable[[int], int] | None = None,
    *,
    reserve_null_block: bool = True,
    kv_cache_memory_text: bool = True,
) -> MemoryCheck:
    """Plan one worker's pool and run the admission check (``get_kv_cache_configs`` for one worker).

    ``num_blocks = available // bytes_per_block`` counts the null block (0 when not one block fits
    beyond it: ``get_kv_cache_configs`` raises "No available memory" before planning a pool); the check sees
    :func:`admission_budget` (``available - bytes_per_block`` from vLLM 0.29; without
    ``reserve_null_block``, all of ``available``) and passes when ``needed <= check``; the
    estimate is asked for those same bytes, ``estimate_for(check)`` (default
    :func:`estimate_max_model_len`), and reserves nothing more.

    With ``rt.auto_fit_max_model_len`` (``max_model_len = -1``: vLLM's ``original_max_model_len
    == -1``; ``rt.max_model_len`` holds the derived length) ``_auto_fit_max_model_len`` runs first
    on those same bytes: the estimate over ``[1, derived]`` becomes the ``max_model_len`` the
    engine serves (``max_model_len``), which the admission check and the concurrency then use
    (and pass), with the text it logs (``auto_fit``); not one token fitting is its ``ValueError``
    (:data:`AUTO_FIT_ERROR`, the admission text here).
    """
    need = groups if isinstance(groups, NeededBytes) else need_of_groups(groups, rt)
    bpb = need.bytes_per_block
    if bpb == 0:
        return attention_free_check(rt)
    available = available_kv_bytes(need, rt)
    check = admission_budget(available, bpb, reserve_null_block=reserve_null_block)
    estimate_for = estimate_for or (lambda available: estimate_max_model_len(need, rt, available))
    length, auto_fit, fit_error = rt.max_model_len, "", False
    if rt.auto_fit_max_model_len:
        fitted = estimate_for(check) if check > 0 else 0
        if fitted <= 0:
            fit_error = True
        else:
            length = min(fitted, rt.max_model_len)
            auto_fit = auto_fit_message(
                rt.max_model_len, fitted, check, kv_cache_memory_text=kv_cache_memory_text
            )
    needed = need.needed(length)
    estimate = estimate_for(check) if check > 0 else 0
    if fit_error:
        admission = AUTO_FIT_ERROR
    elif check <= 0:
        admission = NO_MEMORY_ERROR
    elif needed > check:
        admission = not_enough_memory_error(length, needed, check, estimate)
    else:
        admission = "ok"
    # the engine stops before it has a pool when not one block fits beyond the null block
    num_blocks, per_request = (available // bpb if check > 0 else 0), needed // bpb
    return MemoryCheck(
        bytes_per_block=bpb, num_blocks=num_blocks, needed_bytes=needed, available_bytes=check,
        admission=admission, max_model_len_estimate=estimate,
        max_concurrency=num_blocks / per_request if check > 0 and per_request else 0.0,
        max_model_len=length if auto_fit else None, auto_fit=auto_fit,
    )  # fmt: skip
