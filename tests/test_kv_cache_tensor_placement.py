"""Where each layer's pages sit in the pool and how its kernel views them (vLLM 0.29+,
``kv_cache_tensor_placement``; before, one tensor per layer slot): the reference against numbers
derived by hand (docs/scenario-derivations.md, section 23); a backend that places every tensor of
a group at byte 0 fails ``test_kv_cache_tensors``, one that gives each layer a tensor of its own
before 0.29 fails it too, and one that views pages head-major fails ``test_kv_cache_views``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_kvconform.backends.base import ReferenceBackend
from pytest_kvconform.model import KVCacheTensorPlacement, KVCacheView
from pytest_kvconform.reference.releases import rule_set
from pytest_kvconform.reference.rules import reference_rules
from pytest_kvconform.rejections import Rejected
from pytest_kvconform.scenario import load_scenario

RULES = str(Path(__file__).resolve().parents[1] / "pytest_kvconform" / "suites" / "test_kvconform_rules.py")


def _tensors(name: str, release: str = "0.33") -> list[KVCacheTensorPlacement]:
    reference, scenario = reference_rules(rule_set(release)), load_scenario(name)
    return list(reference.kv_cache_tensors(reference.layer_specs(scenario=scenario), 3, scenario=scenario))


def _layout(t: KVCacheTensorPlacement) -> tuple[int, int, int, int, int, tuple[int, int, int]]:
    return len(t.layers), t.size, t.offset, t.block_stride, t.layer_stride, t.page_shape


def test_one_group_is_one_tensor() -> None:
    assert [_layout(t) for t in _tensors("h2o-danube3-500m")] == [
        (16, 2_359_296, 0, 49_152, 147_456, (8, 16, 384))
    ]


def test_each_group_starts_at_byte_0() -> None:
    tensors = _tensors("gemma-3-1b-it-rbln-cr03")
    assert {_layout(t)[1:] for t in tensors} == {(12_582_912, 0, 1_048_576, 3_145_728, (1, 1024, 1024))}
    assert len(tensors) == 7 and tensors[0].layers[:2] == (
        "model.layers.0.self_attn",
        "model.layers.7.self_attn",
    )


def test_a_padded_state_page_is_its_block_stride() -> None:
    tensors = _tensors("granite-4.0-h-tiny")
    assert len(tensors) == 10
    assert {(t.block_stride, t.layer_stride, t.size, t.offset) for t in tensors} == {
        (819_200, 2_457_600, 9_830_400, 0)
    }
    assert {t.page_shape for t in tensors} == {(1, 1, 806_400), (4, 400, 512)}


def test_a_groups_tensors_follow_each_other() -> None:
    assert [_layout(t) for t in _tensors("gemma-4-31b-it-hma-disabled")] == [
        (50, 43_253_760, 0, 262_144, 786_432, (16, 16, 1024)),
        (10, 43_253_760, 39_321_600, 131_072, 393_216, (4, 16, 2048)),
    ]


def test_before_0_29_a_tensor_is_one_layer_slot_of_every_group() -> None:
    """0.23 to 0.28: tensor ``i`` is shared by layer ``i`` of each group, 3 pages of 1,048,576 B;
    the 4 full layers and six sliding groups of 4, 4, 4, 4, 3 and 3 give 4 tensors of 7, 7, 7
    and 5 layers, each at byte 0."""
    tensors = _tensors("gemma-3-1b-it-rbln-cr03", "0.28")
    assert [len(t.layers) for t in tensors] == [7, 7, 7, 5]
    assert {(t.size, t.offset, t.layer_stride, t.block_stride, t.page_shape) for t in tensors} == {
        (3_145_728, 0, 0, 1_048_576, None)
    }
    assert "model.layers.5.self_attn" in tensors[0].layers  # the first full layer
    assert "model.layers.23.self_attn" in tensors[3].layers  # the fourth


def test_before_0_29_a_uniform_type_group_has_a_tensor_per_layer() -> None:
    """Gemma-4-31B with HMA disabled at 0.23: 60 tensors, each of its layer's own page, 3 x 262,144
    (a promoted sliding layer) or 3 x 131,072 (a full one)."""
    tensors = _tensors("gemma-4-31b-it-hma-disabled", "0.23")
    assert len(tensors) == 60 and all(len(t.layers) == 1 for t in tensors)
    sizes = {t.layers[0]: t.size for t in tensors}
    assert (sizes["model.layers.0.self_attn"], sizes["model.layers.5.self_attn"]) == (786_432, 393_216)


def _views(name: str) -> dict[str, KVCacheView]:
    reference, scenario = ReferenceBackend(), load_scenario(name)
    views = reference.kv_cache_views(reference.layer_specs(scenario=scenario), 3, scenario=scenario)
    return {v.layer: v for v in views}


def test_a_layers_view_is_token_major_in_its_dtype() -> None:
    """LBNHC: within a page of 8 heads x 16 tokens x 384 B, a head is 384 B (192 bf16) from the
    next and a token 8 x 384 B; blocks 49,152 B apart, layers 147,456 B."""
    views = _views("h2o-danube3-500m")
    assert len(views) == 16
    assert views["model.layers.1.self_attn"] == KVCacheView(
        "model.layers.1.self_attn", "bfloat16", (3, 8, 16, 192), (24_576, 192, 1_536, 1), 73_728
    )


def test_a_state_view_is_bytes_and_a_padded_page_its_block_stride() -> None:
    views = _views("granite-4.0-h-tiny")
    assert views["model.layers.0.mixer"] == KVCacheView(
        "model.layers.0.mixer", "int8", (3, 1, 1, 806_400), (819_200, 806_400, 806_400, 1), 0
    )
    # the 4 attention layers (5, 15, 25, 35) share one tensor: layer 15 is its second
    assert views["model.layers.15.self_attn"] == KVCacheView(
        "model.layers.15.self_attn", "bfloat16", (3, 4, 400, 256), (409_600, 256, 1_024, 1), 1_228_800
    )


def test_a_second_tensors_views_begin_after_the_first() -> None:
    views = _views("gemma-4-31b-it-hma-disabled")
    assert views["model.layers.5.self_attn"] == KVCacheView(  # the first full layer
        "model.layers.5.self_attn", "bfloat16", (3, 4, 16, 1024), (65_536, 1_024, 4_096, 1), 19_660_800
    )


def _views_at(name: str, release: str) -> dict[str, KVCacheView]:
    reference, scenario = reference_rules(rule_set(release)), load_scenario(name)
    views = reference.kv_cache_views(reference.layer_specs(scenario=scenario), 3, scenario=scenario)
    return {v.layer: v for v in views}


@pytest.mark.parametrize("release", ["0.23", "0.25"])
def test_before_0_26_an_attention_view_is_k_and_v_per_block(release: str) -> None:
    """FlashAttention's ``(num_blocks, 2, block_size, kv_heads, head_size)``, NHD as is: a block is
    a page of 49,152 B (24,576 bf16), V 16 x 8 x 96 = 12,288 after K, a token 8 x 96 = 768."""
    name = "model.layers.1.self_attn"
    assert _views_at("h2o-danube3-500m", release)[name] == KVCacheView(
        name, "bfloat16", (3, 2, 16, 8, 96), (24_576, 12_288, 768, 96, 1), 0
    )


def test_before_0_26_a_state_layer_has_a_view_per_state() -> None:
    """Granite-4.0-H-Tiny: the conv state (3, 3,328) then the SSM state (48, 64, 128), both bf16,
    after 3 x 3,328 = 9,984 elements, each block one padded page of 819,200 B (409,600 bf16); the
    attention layers at block 400: (3, 2, 400, 4, 128)."""
    views = _views_at("granite-4.0-h-tiny", "0.23")
    conv, ssm, attention = "model.layers.0.mixer[0]", "model.layers.0.mixer[1]", "model.layers.5.self_attn"
    assert views[conv] == KVCacheView(conv, "bfloat16", (3, 3, 3_328), (409_600, 3_328, 1), 0)
    assert views[ssm] == KVCacheView(ssm, "bfloat16", (3, 48, 64, 128), (409_600, 8_192, 128, 1), 9_984)
    assert views[attention] == KVCacheView(
        attention, "bfloat16", (3, 2, 400, 4, 128), (409_600, 204_800, 512, 128, 1), 0
    )


def test_the_views_of_0_26_to_0_28_are_not_modelled() -> None:
    reference, scenario = reference_rules(rule_set("0.26")), load_scenario("h2o-danube3-500m")
    with pytest.raises(Rejected, match=r"0\.26 to 0\.28"):
        reference.kv_cache_views(reference.layer_specs(scenario=scenario), 3, scenario=scenario)


def test_the_placement_is_modelled_from_0_29() -> None:
    """0.29 gave ``KVCacheTensor`` its layers and strides and the engine its layout."""
    assert rule_set("0.29").has("kv_cache_tensor_placement")
    assert not rule_set("0.28").has("kv_cache_tensor_placement")


BROKEN = """
import dataclasses

from pytest_kvconform.backends.base import ReferenceBackend


class EveryTensorAtZero(ReferenceBackend):
    '''Places each tensor of a group at byte 0: the layers of a group's second spec overwrite the first's.'''

    name = "every-tensor-at-zero"

    def kv_cache_tensors(self, specs, num_blocks, scenario):
        tensors = super().kv_cache_tensors(specs, num_blocks, scenario=scenario)
        return tuple(dataclasses.replace(t, offset=0) for t in tensors)


class TensorPerLayer(ReferenceBackend):
    '''Gives each layer a tensor of its own before 0.29 (a pool per layer, as the Metal pool does),
    where vLLM shares one per layer slot among the groups.'''

    name = "tensor-per-layer"

    def kv_cache_tensors(self, specs, num_blocks, scenario):
        tensors = super().kv_cache_tensors(specs, num_blocks, scenario=scenario)
        return tuple(dataclasses.replace(t, layers=(name,)) for t in tensors for name in t.layers)


class KvFirst(ReferenceBackend):
    '''Views an attention layer K/V-first, (2, num_blocks, ...), where vLLM 0.23's FlashAttention
    and Triton put the block first.'''

    name = "kv-first"

    def kv_cache_views(self, specs, num_blocks, scenario):
        views = super().kv_cache_views(specs, num_blocks, scenario=scenario)
        swap = lambda t: (t[1], t[0], *t[2:])  # noqa: E731
        return tuple(dataclasses.replace(v, shape=swap(v.shape), stride=swap(v.stride)) if len(v.shape) == 5
                     else v for v in views)  # fmt: skip


class HeadMajor(ReferenceBackend):
    '''Views every page heads outermost (LBHNC, vLLM's CPU attention), where the engine resolved LBNHC.'''

    name = "head-major"

    def kv_cache_views(self, specs, num_blocks, scenario):
        from pytest_kvconform.reference.placement import kv_cache_views

        return kv_cache_views(self._group_specs(specs, scenario), num_blocks, layout="LBHNC")
"""


def _verdicts(pytester: pytest.Pytester, backend: str, tests: str, release: str = "0.32") -> dict[str, str]:
    """Scenario -> verdict of the rules suite's ``tests`` for ``backend`` of :data:`BROKEN`."""
    pytester.makepyfile(broken_placement=BROKEN)
    pytester.syspathinsert()
    report = pytester.path / "report.json"
    pytester.runpytest_subprocess(
        RULES, f"--kvconform-backend=broken_placement:{backend}", f"--kvconform-vllm={release}", "-k", tests,
        f"--kvconform-report={report}", "-p", "no:cacheprovider",
    )  # fmt: skip
    return {r["scenario"]: r["verdict"] for r in json.loads(report.read_text())["results"]}


def test_a_tensor_placed_at_the_wrong_offset_fails(pytester: pytest.Pytester) -> None:
    verdicts = _verdicts(
        pytester,
        "EveryTensorAtZero",
        "test_kv_cache_tensors and (gemma-4-31b-it-hma-disabled or h2o-danube3-500m)",
    )
    assert verdicts["gemma-4-31b-it-hma-disabled"] == "departed"  # its second tensor moved
    assert verdicts["h2o-danube3-500m"] == "agreed"  # one tensor per group: already at 0


def test_a_tensor_per_layer_before_0_29_fails(pytester: pytest.Pytester) -> None:
    tests = "test_kv_cache_tensors and (gemma-3-1b-it-rbln-cr03 or h2o-danube3-500m)"
    verdicts = _verdicts(pytester, "TensorPerLayer", tests, release="0.28")
    assert verdicts["gemma-3-1b-it-rbln-cr03"] == "departed"  # 7 groups share each slot
    assert verdicts["h2o-danube3-500m"] == "agreed"  # one group: a slot is one layer


def test_a_kv_first_view_before_0_26_fails(pytester: pytest.Pytester) -> None:
    tests = "test_kv_cache_views and (h2o-danube3-500m or glm-4.7-flash-bf16)"
    verdicts = _verdicts(pytester, "KvFirst", tests, release="0.23")
    assert verdicts["h2o-danube3-500m"] == "departed"
    assert verdicts["glm-4.7-flash-bf16"] == "agreed"  # an MLA latent has no K/V axis


def test_a_page_viewed_head_major_fails(pytester: pytest.Pytester) -> None:
    verdicts = _verdicts(
        pytester, "HeadMajor", "test_kv_cache_views and (gemma-3-1b-it-rbln-cr03 or h2o-danube3-500m)"
    )
    assert verdicts["h2o-danube3-500m"] == "departed"
    # one KV head: its H stride differs still (torch keeps a size-1 axis's stride)
    assert verdicts["gemma-3-1b-it-rbln-cr03"] == "departed"
