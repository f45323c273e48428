"""The layout vllm-metal's kernel reads (``test_kernel_cache_views``): the reference against numbers
derived by hand (docs/scenario-derivations.md, section 25), the metal backend's really allocated
pool agreeing through the documented command, and a pool handed to the kernel in whole logical
blocks (vllm-metal before PR #235) failing it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_kvconform import checks
from pytest_kvconform.backends.base import ReferenceBackend
from pytest_kvconform.model import KVCacheView
from pytest_kvconform.scenario import load_scenario

RULES = str(Path(__file__).resolve().parents[1] / "pytest_kvconform" / "suites" / "test_kvconform_rules.py")


def _views(name: str) -> dict[str, KVCacheView]:
    """The reference's views of the pages vLLM plans (the specs unified), at 3 blocks."""
    reference, scenario = ReferenceBackend(), load_scenario(name)
    specs = reference.unify_page_sizes(reference.layer_specs(scenario=scenario), scenario=scenario)
    return {v.layer: v for v in reference.kernel_cache_views(specs, 3, scenario=scenario)}


def test_k_and_v_are_token_major_arrays_of_their_own() -> None:
    """8 KV heads x 96 at block 16 (a kernel block): a head 96 elements from the next, a token 8 x 96."""
    views = _views("h2o-danube3-500m")
    assert len(views) == 32  # 16 layers, K and V each
    for cache in ("key_cache", "value_cache"):
        name = f"model.layers.1.self_attn.{cache}"
        assert views[name] == KVCacheView(name, "bfloat16", (3, 8, 16, 96), (12_288, 96, 768, 1), 0)


def test_a_hybrid_block_is_handed_over_in_kernel_blocks() -> None:
    """Qwen3.5-0.8B's attention block 544 = 17 x 32: 3 blocks are 51 kernel blocks of 32 tokens,
    2 heads x 256; its 18 GDN layers have no paged cache."""
    views = _views("qwen3.5-0.8b")
    assert len(views) == 12  # 6 attention layers, K and V each
    name = "model.layers.3.self_attn.value_cache"
    assert views[name] == KVCacheView(name, "bfloat16", (51, 2, 32, 256), (16_384, 256, 512, 1), 0)


def test_a_mixed_models_groups_keep_their_own_blocks() -> None:
    """Gemma-4-31B: a sliding layer's page is 16 tokens x 16 heads x 256 x 2 x 2 B = 262,144; a
    full layer's 16 x 4 x 512 x 2 x 2 = 131,072, which unify doubles to block 32, and the kernel
    reads it in kernel blocks of 32 (vllm-metal's layout adopts the groups' blocks, PR #563)."""
    views = _views("gemma-4-31b-it")
    sliding, full = "model.layers.0.self_attn.key_cache", "model.layers.5.self_attn.key_cache"
    assert views[sliding] == KVCacheView(sliding, "bfloat16", (3, 16, 16, 256), (65_536, 256, 4_096, 1), 0)
    assert views[full] == KVCacheView(full, "bfloat16", (3, 4, 32, 512), (65_536, 512, 2_048, 1), 0)


def test_the_check_hands_over_the_pages_vllm_plans() -> None:
    """``test_kernel_cache_views`` asks for the unified specs: Gemma-4-31B's full layers at 32."""
    handed: dict[str, object] = {}

    class Spy(ReferenceBackend):
        name = "spy"

        def kernel_cache_views(self, specs, num_blocks, scenario=None):  # type: ignore[no-untyped-def]
            handed.update(specs)
            return super().kernel_cache_views(specs, num_blocks, scenario=scenario)

    checks.kernel_cache_views(Spy(), ReferenceBackend(), load_scenario("gemma-4-31b-it"))
    assert handed["model.layers.5.self_attn"].block_size == 32  # type: ignore[attr-defined]


def test_an_mla_latent_is_one_head_a_block_whole() -> None:
    """GLM-4.7-Flash: 512 + 64 = 576 per token at block 64, no V."""
    views = _views("glm-4.7-flash-bf16")
    assert len(views) == 47
    name = "model.layers.0.self_attn.latent_cache"
    assert views[name] == KVCacheView(name, "bfloat16", (3, 1, 64, 576), (36_864, 576, 576, 1), 0)


BROKEN = """
from pytest_kvconform.backends.metal import MetalBackend


class WholeBlocks(MetalBackend):
    '''Hands the kernel the cache in logical blocks (vllm-metal before PR #235: Qwen3.5 at block 544
    dispatched a kernel of block 544, which does not exist).'''

    name = "whole-blocks"

    def kernel_cache_views(self, specs, num_blocks, scenario=None):
        from unittest import mock

        with mock.patch("pytest_kvconform.metal_runtime.reshape_cache_for_kernel", lambda cache, kbs: cache):
            return super().kernel_cache_views(specs, num_blocks, scenario=scenario)
"""


SCENARIOS = ("h2o-danube3-500m", "qwen3.5-0.8b", "glm-4.7-flash-bf16", "gemma-4-31b-it")


def _verdicts(pytester: pytest.Pytester, backend: str) -> dict[str, str]:
    """Scenario -> verdict of ``test_kernel_cache_views`` for ``backend`` on :data:`SCENARIOS`."""
    pytester.makepyfile(broken_metal=BROKEN)
    pytester.syspathinsert()
    report = pytester.path / "report.json"
    pytester.runpytest_subprocess(
        RULES, f"--kvconform-backend={backend}", "-k",
        f"test_kernel_cache_views and ({' or '.join(f'{name}]' for name in SCENARIOS)})",
        f"--kvconform-report={report}", "-p", "no:cacheprovider",
    )  # fmt: skip
    return {r["scenario"]: r["verdict"] for r in json.loads(report.read_text())["results"]}


def test_the_metal_pool_agrees_and_whole_blocks_fail(pytester: pytest.Pytester) -> None:
    pytest.importorskip("mlx.core")
    expected = dict.fromkeys(SCENARIOS, "agreed")
    assert _verdicts(pytester, "metal") == expected
    broken = _verdicts(pytester, "broken_metal:WholeBlocks")
    # block 16 is a kernel block, 32 too, and an MLA latent is not split: only block 544 departs
    assert broken == {**expected, "qwen3.5-0.8b": "departed"}
