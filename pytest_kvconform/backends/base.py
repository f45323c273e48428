"""The backend protocol and the reference backend every other backend is checked against.

A backend answers one method per rule family. The :class:`ReferenceBackend` answers them
all from :mod:`pytest_kvconform.reference`; a third-party backend subclasses it and
overrides the rules its hardware computes itself, inheriting the rest. What a backend does not
do is declared once in ``declines`` (:class:`~pytest_kvconform.requirements.Declines`), where it
knowingly departs in ``known_departures``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from ..errors import REJECTIONS, RuleError
from ..gaps import OfflineGap
from ..reference.rules import ReferenceRules
from ..requirements import Declines, KnownDeparture

#: Rule families, in report order. Each names the backend method(s) that answer it.
RULE_FAMILIES: dict[str, tuple[str, ...]] = {
    "dtype": ("kv_cache_dtype_bytes",),
    "hybrid_alignment": ("align_hybrid_block_size",),
    "block_size": ("choose_block_size", "kernel_block_alignment", "kernel_block_sizes"),
    "state_page": ("state_shapes", "state_page_bytes"),
    "layer_specs": ("layer_specs",),
    "attention_page": ("attention_page_bytes",),
    "max_memory": ("max_memory_usage_bytes",),
    "unification": ("unify_page_sizes",),
    "grouping": ("kv_cache_groups", "kv_cache_tensors", "kv_cache_views"),
    "memory": ("determine_available_memory", "check_memory", "estimate_max_model_len"),
    "one_sequence": ("one_sequence_bytes",),
    "kernel_block": ("kernel_block_size", "build_block_tables", "kernel_cache_views"),
    "allocation": ("allocate_kv_cache", "check_kv_cache_config"),
    "plan": ("plan",),
    "platform": ("check_and_update_config", "engine", "rerun_hooks"),
}
#: method name -> its rule family
METHOD_FAMILY: dict[str, str] = {m: family for family, methods in RULE_FAMILIES.items() for m in methods}

__all__ = [
    "METHOD_FAMILY",
    "REJECTIONS",
    "RULE_FAMILIES",
    "Declines",
    "KnownDeparture",
    "OfflineGap",
    "ReferenceBackend",
    "RuleError",
]


class ReferenceBackend(ReferenceRules):
    """The reference rules as a backend (vLLM 0.33.0 core + vllm-metal's own rules).

    Subclass it and override the rule methods your backend computes itself; every method gets
    the scenario it answers for as ``scenario=``. Its ``plan`` composes this object's own rules
    (:func:`~pytest_kvconform.reference.plan.compose_plan`), so an override reaches the specs,
    the groups, the memory check and the plan. The exception contract is
    :mod:`pytest_kvconform.errors`. Constructor keyword arguments are the backend's options
    (``--kvconform-backend-option key=value``, passed as strings).
    """

    name: ClassVar[str] = "reference"
    #: this very class answers as the reference (a subclass does not: see ``provenance.is_oracle``)
    _kvconform_oracle: ClassVar[bool] = True
    #: What this backend does not do: rule families, and kinds of input per family, each with the
    #: reason (its tests end declined; a plan takes the reference's answer for that step). The
    #: reference allocates no pool and drives no vLLM platform; a backend that does says
    #: ``declines = ReferenceBackend.declines.without("allocation")``.
    declines: ClassVar[Declines] = Declines({
        "allocation": "it allocates no KV cache pool",
        "platform": "it drives no vLLM platform (the vllm backend does)",
    })  # fmt: skip
    #: Rule family -> why this backend answers it with the reference's own code (reported as
    #: "inherited (declared)"; ``--kvconform-strict`` fails on inherited families not listed here).
    inherits: ClassVar[Mapping[str, str]] = {}
    #: Where this backend knowingly departs from the reference, naming the field (strict).
    known_departures: ClassVar[Sequence[KnownDeparture]] = ()

    @property
    def version(self) -> str:
        return f"reference rules of vLLM {self.release.release}"

    def notes(self) -> list[str]:
        """Facts about how this backend answers (its platform, its device), for the header."""
        return []
