"""The ``metal`` backend: what it measures with the runtime, and where it departs from vLLM."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx.core")

from pytest_kvconform.backends.base import ReferenceBackend
from pytest_kvconform.backends.metal import SHARED_GROUP_SLOTS, MetalBackend
from pytest_kvconform.conformance import assert_same_outcome, outcome, plan_view
from pytest_kvconform.provenance import ledger
from pytest_kvconform.rejections import rejection_kind
from pytest_kvconform.requirements import known_departures_for
from pytest_kvconform.scenario import Scenario, load_scenario, parse_scenario
from pytest_kvconform.verdict import Departure

# The shrunk hypothesis counterexample that found the group-size divergence
# (pytest_kvconform/suites/test_kvconform_properties.py).
ATTENTION_MINORITY_HYBRID = """
schema = "kv-scenario/1"
name = "generated"
[model]
architecture = "Generated"
dtype = "bfloat16"
num_hidden_layers = 7
layers = "MAMAMAM"
[model.attention]
kind = "mla"
kv_lora_rank = 256
qk_rope_head_dim = 64
[model.state]
kind = "mamba1"
conv_kernel = 2
intermediate_size = 1024
d_state = 16
[runtime]
max_model_len = 1
kv_cache_memory_bytes = 1048576
"""


@pytest.fixture(scope="module")
def metal() -> MetalBackend:
    return MetalBackend()


def _plan_departure(metal: MetalBackend, scenario: Scenario) -> dict[str, str]:
    """The first difference of the metal backend's plan from the reference's, as a test reports it."""
    with ledger():
        expected = outcome(ReferenceBackend(), "plan", scenario=scenario)
        got = outcome(metal, "plan", scenario=scenario)
        with pytest.raises(Departure) as departed:
            assert_same_outcome("plan", metal, scenario, "plan", expected, got, plan_view)
    return departed.value.to_dict()


def test_version_names_mlx_and_device(metal: MetalBackend) -> None:
    assert metal.version.startswith("MLX ") and metal.version.endswith(("CPU", "Metal GPU"))


def test_block_tables_are_plain_lists(metal: MetalBackend) -> None:
    # vllm-metal attention/impls/sdpa.py, _build_block_tables([[0,2],[1]], 160) (vllm-metal#235)
    assert metal.build_block_tables([[0, 2], [1]], 160) == (
        [[0, 1, 2, 3, 4, 10, 11, 12, 13, 14], [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]],
        32,
    )


def test_granite_plan_matches_the_reference(metal: MetalBackend) -> None:
    scenario = load_scenario("granite-4.0-h-tiny")
    assert metal.plan(scenario) == ReferenceBackend().plan(scenario)


def test_pool_block_holds_only_the_attention_layers(metal: MetalBackend) -> None:
    """vllm-metal bills a block as its paged (attention) layers; vLLM bills group_size pages.

    3 MLA layers + 4 Mamba layers: 4 < 1.5 * 3, so vLLM's group size is 4 (vLLM 0.33.0
    _get_kv_cache_groups_uniform_page_size). The MLA floor of 128 in vLLM 0.33.0
    Platform._align_hybrid_block_size aligns the block to 128 tokens; one latent is
    (256 + 64) * 2 B = 640 B/token. The Metal pool block holds 3 * 128 * 640 = 245,760 B while vLLM
    bills 4 * 81,920 = 327,680 B, so vLLM plans fewer blocks than the Metal pool allocated
    (budget // 245,760 = 4 vs 3).
    """
    scenario = parse_scenario(ATTENTION_MINORITY_HYBRID)
    reference, measured = ReferenceBackend().plan(scenario), metal.plan(scenario)
    assert (reference.block_size, reference.group_size) == (128, 4)
    assert (reference.bytes_per_block, measured.bytes_per_block) == (327_680, 245_760)
    assert (reference.num_blocks, measured.num_blocks) == (3, 4)
    # a known departure by kind of input (the property tests count it as known), pinned here
    departure = _plan_departure(metal, scenario)
    assert departure == {"field": "bytes_per_block", "reference": "327680", "backend": "245760"}
    known = known_departures_for(metal.known_departures, "plan", "test_plan_generated", scenario)
    assert [k.when for k in known if k.matches(departure)] == [SHARED_GROUP_SLOTS]


def test_packed_kv_dtype_is_not_modelled(metal: MetalBackend) -> None:
    """vllm-metal stores K/V in the model dtype only (v1/model_lifecycle.py sets kv_cache_dtype from
    model_config.dtype, vllm-metal#198; --kv-cache-dtype is never read); the runtime refuses to size
    a pool of fp8_ds_mla latents and uint8 indexer keys instead of guessing."""
    scenario = load_scenario("glm-5-fp8-ds-mla")
    assert metal.declines.reason("plan", scenario) is None  # not declined: the pool refuses it
    with pytest.raises(ValueError, match="no packed or padded KV pages") as refused:
        metal.plan(scenario)
    assert rejection_kind(refused.value) == "unsupported_kv_cache_dtype"
    # a known departure of test_plan on this scenario, naming fp8_ds_mla, matching the refusal
    departure = _plan_departure(metal, scenario)
    assert departure["backend"] == "'rejects: unsupported_kv_cache_dtype'"
    known = known_departures_for(metal.known_departures, "plan", "test_plan[glm-5-fp8-ds-mla]", scenario)
    named = [k for k in known if k.test == "test_plan[glm-5-fp8-ds-mla]"]
    assert len(named) == 1 and "fp8_ds_mla" in named[0].reason and named[0].matches(departure)


def test_state_slot_is_billed_fp32_when_pages_are_not_padded(metal: MetalBackend) -> None:
    """vllm-metal PR #243: the GDN recurrent state is fp32 on Metal even for a bf16 model.

    Qwen3.5-0.8B GDN, one layer: conv (3, 6144) bf16 = 36,864 B; recurrent 16 x 128 x 128 fp32 =
    1,048,576 B (vllm-metal v1/cache_policy.py, linear_cache_bytes_per_slot). A pure-state model is
    never padded, so the slot is billed.
    """
    scenario = parse_scenario(
        'schema = "kv-scenario/1"\nname = "gdn-only"\n[model]\narchitecture = "X"\ndtype = "bfloat16"\n'
        'num_hidden_layers = 1\nlayers = "M"\n[model.state]\nkind = "gdn"\nnum_key_heads = 16\n'
        "num_value_heads = 16\nkey_head_dim = 128\nvalue_head_dim = 128\nconv_kernel = 4\n"
    )
    assert metal.one_sequence_bytes(16, None, scenario=scenario) == 36_864 + 1_048_576


@pytest.mark.parametrize("release", ["0.27", "0.29", "0.33"])
def test_the_pool_is_sized_from_the_whole_budget_in_every_release(release: str) -> None:
    """Granite-4.0-H-tiny: Mamba2 state page 3 * (3072 + 2 * 128) * 2 + 48 * 64 * 128 * 2 =
    806,400 B, attention 2 * 4 * 128 * 2 = 2,048 B/token, so block 16 * cdiv(806,400, 32,768) =
    400 and pages of 819,200 B; 4 attention + 36 Mamba layers give group size 4 and 3,276,800 B
    per block. The 8 GiB budget holds 8,589,934,592 // 3,276,800 = 2,621 blocks whether or not
    the release takes the null block out of the admission budget (0.29+): adding that block back
    before 0.29 counted 2,622."""
    from pytest_kvconform.reference.releases import rule_set

    metal, reference = MetalBackend(), ReferenceBackend()
    metal.release = reference.release = rule_set(release)
    scenario = load_scenario("granite-4.0-h-tiny")
    check = metal.check_memory(reference.layer_specs(scenario), scenario=scenario)
    assert (check.bytes_per_block, check.num_blocks) == (3_276_800, 2_621)
