"""A plugin profile: what the ``vllm`` backend needs to drive a vLLM hardware plugin's own code
on a CPU host, and nothing about how the plugin sizes.

A profile is a :class:`PluginProfile` subclass: the plugin's Platform and Worker (the engine's
hooks run in the engine's order, :mod:`..layers`), the environment it reads at import, the device
libraries it imports that the host lacks (:class:`~.stubs.Stub`: they answer nothing a size is
made of), the distribution names it checks (:class:`~.stubs.DistributionAlias`), and three hooks:
:meth:`~PluginProfile.load_plugin` (its imports and the process-wide patches it applies, as its
entry points would), :meth:`~PluginProfile.init_device` (what its worker's ``init_device`` makes
besides the device and the process group: its model runner) and
:meth:`~PluginProfile.load_model` (what its ``load_model`` leaves, given the model on ``meta``).
A plugin that patches vLLM process-wide says what in ``registers_process_wide``: the harness
then builds it in a process of its own. docs/plugins.md shows a whole profile.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Mapping
from typing import Any, ClassVar

from ....requirements import SPECULATIVE, Declines
from ..backend import VllmBackend
from ..runtime import VllmUnavailableError
from ..worker import WorkerSteps, build_worker, resolve_worker
from . import stubs as stub_modules
from .stubs import DistributionAlias, Stub

#: profiles whose plugin this process has loaded
_LOADED: set[type] = set()


class PluginProfile(VllmBackend):
    """A vLLM hardware plugin driven by the ``vllm`` backend (subclass it; see the module)."""

    #: the plugin's pip distribution; its version goes in the report header
    distribution: ClassVar[str] = ""
    #: what installs the plugin where the suites run (said when it is missing)
    install_hint: ClassVar[str] = ""
    #: variables the plugin reads at import, set before it is imported (values already set are kept)
    environment: ClassVar[Mapping[str, str]] = {}
    #: modules the plugin imports that this host lacks, each with why (:class:`~.stubs.Stub`)
    stubs: ClassVar[tuple[Stub, ...]] = ()
    #: distribution names the plugin checks that are installed under another name
    aliases: ClassVar[tuple[DistributionAlias, ...]] = ()
    #: how the worker's ``init_device`` and ``load_model`` run (:class:`~..worker.WorkerSteps`);
    #: None: the worker's own (a step it keeps of vLLM's GPU worker is not run: it needs CUDA).
    #: A worker whose steps need its device or the weights names the hooks that replace them.
    steps: ClassVar[WorkerSteps | None] = None
    declines: ClassVar[Declines] = VllmBackend.declines | Declines({
        ("allocation", SPECULATIVE): "a drafter's attention layers are registered by its load_model, which "
        "needs the draft weights: the worker's initialize_from_config cannot set up its drafter here",
    })  # fmt: skip

    def __init__(self, platform: type | str | None = None, cpu_features: str = "native",
                 worker: type | str | None = None) -> None:  # fmt: skip
        target = platform or type(self).platform
        module = target.partition(":")[0].partition(".")[0] if isinstance(target, str) else None
        if module and importlib.util.find_spec(module) is None:
            raise VllmUnavailableError(f"{self.distribution or module} is not installed: {self.install_hint}")
        for name, value in self.environment.items():
            os.environ.setdefault(name, value)
        # before vLLM is imported: it resolves an installed platform plugin on its first import
        stub_modules.install(self.stubs, self.aliases)
        self.stub_device()
        super().__init__(platform=platform, cpu_features=cpu_features, worker=worker)

    def notes(self) -> list[str]:
        from importlib.metadata import version

        plugin = (
            f"{self.distribution} {version(self.distribution)}" if self.distribution else type(self).__name__
        )
        stubbed = ", ".join(s.module for s in self.stubs)
        return [*super().notes(), plugin + (f"; stubbed: {stubbed}" if stubbed else "")]

    def platform_for(self, scenario: Any) -> type:
        if type(self) not in _LOADED:
            self.load_plugin()
            _LOADED.add(type(self))
        return super().platform_for(scenario)

    # -- the hooks a profile overrides

    def stub_device(self) -> None:
        """What importing the stubbed device library would set besides its modules (a ``torch``
        attribute, a device name), before vLLM is imported; nothing by default."""

    def load_plugin(self) -> None:
        """Import the plugin (its Platform's and Worker's modules), once per process, after its
        environment and stubs; a profile adds what the plugin's entry points or
        ``pre_register_and_update`` would apply before an engine's config is built."""
        for target in (self.platform, self.worker):
            if isinstance(target, str):
                importlib.import_module(target.partition(":")[0])

    def init_device(self, worker: Any) -> None:
        """What the worker's ``init_device`` makes besides the device and the process group
        (the harness has its own): typically its model runner, on the CPU. Run in place of the
        worker's own where :attr:`steps` says ``hook``."""

    def worker_steps(self) -> WorkerSteps:
        return self.steps or super().worker_steps()

    def make_worker(self, config: Any, distributed_init_method: str) -> Any:
        return build_worker(
            resolve_worker(self._worker_arg), config, distributed_init_method, self.worker_steps(),
            self.init_device,
        )  # fmt: skip


__all__ = ["DistributionAlias", "PluginProfile", "Stub", "WorkerSteps"]
