"""The private vLLM symbols the vllm backend patches or reads, in one table, checked per release.

The backend watches vLLM's own planning from inside (it stands in for the admission check and
the auto-fit to record what they saw, it answers a child-process probe in this process, it swaps
the platform object's class). Each such symbol is listed in :data:`SYMBOLS` with the releases
that have it and, for a function the backend replaces, the parameters its stand-in expects.
:func:`private` returns a symbol after checking it against the installed release; a symbol that
moved, vanished or changed its parameters raises :class:`VllmPrivateApiError`, one line naming
the symbol, what changed and the release: every test that needs it crashes with that line,
instead of declining or planning with the wrong stand-in.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

#: the module of the planning functions: 0.33's, else the one before it
PLANNING = ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils")


@dataclass(frozen=True)
class PrivateSymbol:
    """One private symbol: where it lives (the first of ``modules`` that has it), the releases
    that have it (``since``, ``until`` inclusive; "" for open), the leading parameters a function
    the backend replaces must take, and why the backend touches it."""

    name: str
    modules: tuple[str, ...]
    why: str
    params: tuple[str, ...] | None = None
    since: str = "0.23"
    until: str = ""


SYMBOLS: dict[str, PrivateSymbol] = {
    s.name: s
    for s in (
        PrivateSymbol(
            "_check_enough_kv_cache_memory",
            PLANNING,
            "replaced while get_kv_cache_configs runs, to record the admission check it makes",
            ("available_memory", "get_needed_memory", "max_model_len", "estimate_max_model_len"),
        ),
        PrivateSymbol(
            "_auto_fit_max_model_len",
            PLANNING,
            "replaced while get_kv_cache_configs runs, to record the length and the text it logs",
        ),
        PrivateSymbol("logger", PLANNING, "replaced while auto-fit runs, to keep its info_once text"),
        PrivateSymbol(
            "_run_in_subprocess",
            ("vllm.model_executor.models.registry",),
            "model classes are inspected in this process (they are built here anyway)",
            ("fn",),
        ),
        PrivateSymbol(
            "_cached_get_attn_backend",
            ("vllm.v1.attention.selector",),
            "cleared when the platform class is swapped (cached per selector config, not platform)",
        ),
        PrivateSymbol(
            "_align_hybrid_block_size",
            ("vllm.platforms.interface:Platform",),
            "Phase 2 of update_block_size_for_backend, asked alone for the hybrid alignment rule",
            ("vllm_config", "backend_cls"),
        ),
        PrivateSymbol(
            "_set_default_chunked_prefill_and_prefix_caching_args",
            ("vllm.engine.arg_utils:EngineArgs",),
            "the prefix-caching default of `vllm serve`, asked of the scenario's ModelConfig",
            ("self", "model_config"),
        ),
    )
}


class VllmPrivateApiError(RuntimeError):
    """A private vLLM symbol the backend relies on moved or changed (one line)."""


def _key(release: str) -> tuple[int, int]:
    major, minor = release.split(".")[:2]
    return int(major), int(minor)


def _holder(location: str) -> Any:
    module_name, _, attr = location.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


@functools.cache
def locate(name: str, version: str) -> tuple[Any, Any]:
    """``(holder, value)`` of the private symbol ``name`` in vLLM ``version``, checked against
    :data:`SYMBOLS`; :class:`VllmPrivateApiError` when it is not where it should be."""
    symbol = SYMBOLS[name]
    release = ".".join(version.split(".")[:2])
    expected = _key(release) >= _key(symbol.since) and (
        not symbol.until or _key(release) <= _key(symbol.until)
    )
    for location in symbol.modules:
        try:
            holder = _holder(location)
        except (ImportError, AttributeError):
            continue
        if hasattr(holder, name):
            value = getattr(holder, name)
            if symbol.params is not None:
                _check_params(name, value, symbol.params, version)
            return holder, value
    where = " or ".join(symbol.modules)
    if not expected:
        raise VllmPrivateApiError(f"vLLM {version} has no {name} (since {symbol.since}), which is asked for")
    raise VllmPrivateApiError(
        f"vLLM {version}: private symbol {name} is not in {where} any more; the vllm backend uses it "
        f"({symbol.why}): pytest_kvconform/backends/vllm/private.py lists what it expects"
    )


def _check_params(name: str, fn: Any, params: tuple[str, ...], version: str) -> None:
    try:
        have = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return
    if "self" in params and have[:1] != ("self",):
        have = ("self", *have)  # a classmethod or bound method does not show its first parameter
    if have[: len(params)] != params:
        raise VllmPrivateApiError(
            f"vLLM {version}: {name} takes ({', '.join(have)}), the vllm backend's stand-in expects "
            f"({', '.join(params)}): pytest_kvconform/backends/vllm/private.py"
        )


def private(name: str) -> tuple[Any, Any]:
    """:func:`locate` in the installed vLLM (imported)."""
    from .runtime import vllm_runtime

    return locate(name, vllm_runtime().version)


def check_all(version: str) -> list[str]:
    """Every symbol the installed release should have, as problems (one line each; empty: all there)."""
    problems = []
    release = ".".join(version.split(".")[:2])
    for name, symbol in SYMBOLS.items():
        if _key(release) < _key(symbol.since) or (symbol.until and _key(release) > _key(symbol.until)):
            continue
        try:
            locate(name, version)
        except VllmPrivateApiError as exc:
            problems.append(str(exc))
    return problems
