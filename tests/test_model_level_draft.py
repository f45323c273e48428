"""The MTP drafter's own KV layers in model-level scenarios (reference/speculative.py).

vLLM (0.23, 0.32, 0.33 alike) builds the drafter in the target's worker
(``SpecDecodeBaseProposer.load_model``, vllm/v1/spec_decode/llm_base_proposer.py): the MTP model's
``num_nextn_predict_layers`` decoder layers (``DeepSeekMultiTokenPredictor``, deepseek_mtp.py;
``Qwen3NextMultiTokenPredictor``, qwen3_next_mtp.py) register their attention next to the
target's, and ``GPUModelRunner.get_kv_cache_spec`` reports them. The packaged ``-with-draft``
files list those layers by hand (docs/scenario-derivations.md, 3a and 4): a model-level file and
its twin must plan alike. Other numbers are derived here by hand.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.model import KVPlan
from pytest_kvconform.reference import plan
from pytest_kvconform.reference.releases import rule_set
from pytest_kvconform.reference.rules import reference_rules
from pytest_kvconform.reference.specs import AttentionSpec
from pytest_kvconform.reference.speculative import num_draft_layers
from pytest_kvconform.scenario import Scenario, load_scenario, scenario_from_dict

SCENARIOS = Path(__file__).resolve().parents[1] / "pytest_kvconform" / "scenarios"
TWINS = sorted(
    (p.name.removesuffix("-with-draft.toml") + ".toml", p.name)
    for p in SCENARIOS.glob("*-with-draft.toml")
    if (SCENARIOS / (p.name.removesuffix("-with-draft.toml") + ".toml")).exists()
)
#: KVPlan fields a spec-level file cannot have the same (its name, vllm-metal's one-sequence estimate)
UNCOMPARED = {"scenario", "one_sequence_tokens", "one_sequence_bytes"}


def _fields(p: KVPlan) -> dict[str, Any]:
    """The plan's numbers; the group kinds as a multiset (their order follows the file's layer order)."""
    out = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name not in UNCOMPARED}
    out["group_kinds"] = sorted(p.group_kinds)
    return out


def test_every_packaged_pair_is_found() -> None:
    assert ("deepseek-v3-mtp1.toml", "deepseek-v3-mtp1-with-draft.toml") in TWINS
    assert ("qwen3-next-80b-a3b-mtp2-tp4.toml", "qwen3-next-80b-a3b-mtp2-tp4-with-draft.toml") in TWINS


@pytest.mark.parametrize(("model_level", "with_draft"), TWINS)
@pytest.mark.parametrize("release", ["0.33", "0.32", "0.26"])
def test_model_level_file_plans_as_its_with_draft_twin(
    model_level: str, with_draft: str, release: str
) -> None:
    rules = reference_rules(rule_set(release))
    a, b = load_scenario(SCENARIOS / model_level), load_scenario(SCENARIOS / with_draft)
    assert _fields(rules.plan(scenario=a)) == _fields(rules.plan(scenario=b))


def scenario(
    layers: str = "AAAA", *, nextn: int = 0, attention: dict[str, Any] | None = None, **runtime: Any
) -> Scenario:
    model: dict[str, Any] = {
        "architecture": "DeepseekV3ForCausalLM", "dtype": "bfloat16", "num_hidden_layers": len(layers),
        "layers": layers, "attention": attention or {"kind": "gqa", "num_kv_heads": 8, "head_dim": 128},
    }  # fmt: skip
    if nextn:
        model["num_nextn_predict_layers"] = nextn
    runtime = {"mamba_cache_mode": "none", "max_concurrent_batches": 1, **runtime}
    return scenario_from_dict({"schema": "kv-scenario/1", "name": "t", "model": model, "runtime": runtime})


@pytest.mark.parametrize(
    ("method", "nextn", "tokens", "drafts"),
    [
        ("mtp", 1, 1, 1),
        ("mtp", 2, 1, 2),  # every module is built, whatever the tokens (step i runs module i % n)
        ("mtp", 1, 3, 1),
        ("auto", 2, 2, 2),  # auto -> mtp: the checkpoint ships MTP modules
        ("auto", 0, 2, 0),  # auto -> ngram
        ("ngram", 2, 2, 0),
        ("mtp", 2, 0, 0),  # no speculation
    ],
)
def test_num_draft_layers(method: str, nextn: int, tokens: int, drafts: int) -> None:
    s = scenario(nextn=nextn, num_speculative_tokens=tokens, speculative_method=method)
    assert num_draft_layers(s) == drafts
    specs = reference_rules().layer_specs(scenario=s)
    assert len(specs) == 4 + drafts
    assert len(set(specs.values())) == 1  # the target's own full-attention spec object


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model"])
def test_a_draft_of_its_own_checkpoint_is_rejected_in_one_line(method: str) -> None:
    s = scenario(num_speculative_tokens=1, speculative_method=method)
    with pytest.raises(ValueError, match="spec-level scenario") as info:
        plan(s)
    assert "\n" not in str(info.value)
    assert num_draft_layers(scenario(num_speculative_tokens=0, speculative_method=method)) == 0


def test_dsa_draft_layer_has_its_indexer() -> None:
    """DeepseekV2MLAAttention (deepseek_v2.py): an MTP layer always builds the DSA indexer
    (``not _skip_topk or is_mtp_layer``). MLA 512 + 64 bf16 = 1,152 B/token; the indexer K cache
    128 + 128 // 128 * 4 = 132 B/token. Two target layers + one draft layer: 3 x (1,152 + 132) = 3,852."""
    mla = {"kind": "mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64, "indexer_head_dim": 128}
    s = scenario(
        "AA", nextn=1, attention=mla, num_speculative_tokens=1, speculative_method="mtp", block_size=64
    )
    specs = reference_rules().layer_specs(scenario=s)
    assert [k for k in specs if k.startswith("model.layers.2.")] == [
        "model.layers.2.self_attn", "model.layers.2.indexer",
    ]  # fmt: skip
    assert plan(s).kv_bytes_per_token == 3 * (1152 + 132)


def test_hybrid_draft_layer_joins_the_attention_bucket() -> None:
    """Qwen3.5-35B-A3B-like GDN hybrid, 3 GDN + 1 full per 4, MTP 1 (docs/scenario-derivations.md
    3b and 11): the draft is one more full-attention layer of the target's spec (block 1,056),
    never a state layer."""
    s = load_scenario(SCENARIOS / "qwen3.5-35b-a3b-mtp1.toml")
    specs = reference_rules().layer_specs(scenario=s)
    draft = specs["mtp.layers.0.self_attn"]
    assert isinstance(draft, AttentionSpec) and draft.kind == "full_attention" and draft.block_size == 1056
    assert draft == specs["model.layers.3.self_attn"]
    assert sum(isinstance(v, AttentionSpec) for v in specs.values()) == 11
