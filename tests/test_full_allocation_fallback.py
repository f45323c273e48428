"""The MLA + sliding-window full-allocation fallback (vLLM 0.27+, ``full_allocation_fallback``).

vLLM's ``get_kv_cache_groups`` (vllm/v1/core/kv_cache_utils.py in 0.27 ... 0.32,
kv_cache_planning.py in 0.33.0) catches the ``NotImplementedError`` of page unification and
tries ``_try_get_full_allocation_fallback_groups``: MLA with regular sliding-window layers (no
chunked-local, sliding-window MLA or hidden-state layers) get their sliding-window specs promoted
to full attention at the MLA block (``_promote_local_kv_cache_specs``) and form one
``UniformTypeKVCacheSpecs`` group. The reference raised there in every release.

No real model reaches it (reference/grouping.py), so the worked case is spec-level: 3 MLA layers
(bf16 latent 576: 1,152 B/token, block 64: page 73,728 B) and 2 sliding-window layers (8 KV heads
x (128 + 128) x 2 B = 4,096 B/token, block 64: page 262,144 B), max_model_len 8,192, 1 GiB.
Derived by hand (docs/scenario-derivations.md, section 10b): 262,144 / 73,728 is not whole and an
MLA page is never padded (0.29+), so unification raises; the fallback keeps block 64 and makes one
group of 5 layers: bytes per block 3 x 73,728 + 2 x 262,144 = 745,472; every layer now keeps all
tokens: cdiv(8,192, 64) = 128 blocks per request, needed 128 x 745,472 = 95,420,416 B;
num_blocks 1 GiB // 745,472 = 1,440; max concurrency 1,440 / 128 = 11.25. vLLM 0.32 (.venv) and
the 0.33.0 sources print these numbers end to end (``kvconform plan --backend vllm``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, find, given, settings

from pytest_kvconform import strategies
from pytest_kvconform.reference import grouping
from pytest_kvconform.reference.grouping import (
    full_allocation_fallback,
    get_kv_cache_groups,
    promote_local_specs,
)
from pytest_kvconform.reference.layers import layer_specs
from pytest_kvconform.reference.releases import RuleSet
from pytest_kvconform.reference.rules import reference_rules
from pytest_kvconform.reference.specs import AttentionSpec
from pytest_kvconform.scenario import Scenario, scenario_from_dict

SUITES = grouping.__file__.rsplit("/reference/", 1)[0] + "/suites"

#: The worked case as a spec-level scenario with its hand-derived [expect] (no real model: not packaged).
SCENARIO_FILE = Path(__file__).parent / "data" / "mla-sliding-fallback.toml"
SCENARIO = SCENARIO_FILE.read_text()


def mla(block: int = 64) -> AttentionSpec:
    return AttentionSpec(kind="mla", block_size=block, num_kv_heads=1, head_size=576, dtype="bfloat16")


def window(block: int = 64, **kw: Any) -> AttentionSpec:
    return AttentionSpec(
        kind="sliding_window", block_size=block, num_kv_heads=8, head_size=128, dtype="bfloat16",
        sliding_window=4096, **kw,
    )  # fmt: skip


def worked() -> dict[str, AttentionSpec]:
    return {"m0": mla(), "m1": mla(), "m2": mla(), "w0": window(), "w1": window()}


def test_the_worked_case_falls_back_to_one_full_allocation_group() -> None:
    (group,) = get_kv_cache_groups(worked())
    assert group.kind == "uniform_type" and group.layer_names == ("m0", "m1", "m2", "w0", "w1")
    assert group.block_size == 64 and group.bytes_per_block == 745_472
    promoted = group.specs[-1]
    assert promoted.kind == "full_attention" and promoted.page_size_bytes == 262_144
    assert promoted.sliding_window is None and promoted.extra_retained_tokens == 0


def test_without_the_fallback_unification_raises() -> None:
    """0.23 ... 0.26 (no ``full_allocation_fallback``): the unification error propagates."""
    with pytest.raises(NotImplementedError, match="Padding is only supported for non-MLA attention"):
        get_kv_cache_groups(worked(), fallback=False)


def test_a_window_at_its_own_block_takes_the_mla_block() -> None:
    """``block_size = full_attention_block_size or spec.block_size``: a window at block 32 (page
    131,072) is promoted at the MLA block 64 (page 262,144)."""
    specs = {"m": mla(), "w": window(32)}
    promoted = promote_local_specs(specs)
    assert promoted is not None and promoted["w"].block_size == 64
    assert promoted["w"].page_size_bytes == 262_144
    # a padded page grows to max(padded, unpadded page at the new block): 140,000 -> 262,144
    padded = promote_local_specs({"m": mla(), "w": window(32, page_size_padded=140_000)})
    assert padded is not None and padded["w"].page_size_padded == 262_144


@pytest.mark.parametrize(
    ("specs", "why"),
    [
        (
            {
                "m": mla(),
                "c": AttentionSpec("chunked_local", 64, 8, 128, "bfloat16", attention_chunk_size=8192),
                "w": window(),
            },
            "a chunked-local layer",
        ),
        ({"m": mla(), "n": mla(32), "w": window()}, "two MLA block sizes: no common block"),
        ({"f": AttentionSpec("full_attention", 64, 1, 72, "bfloat16"), "w": window()}, "no MLA layer"),
    ],
)
def test_the_fallback_declines(specs: dict[str, AttentionSpec], why: str) -> None:
    assert full_allocation_fallback(specs) is None, why


@pytest.mark.parametrize(("release", "kinds"), [("0.33", ("uniform_type",)), ("0.29", ("uniform_type",)),
                                                ("0.28", ("mla", "mla", "sliding_window"))])  # fmt: skip
def test_the_releases_that_reach_it(release: str, kinds: tuple[str, ...]) -> None:
    """0.29+ refuses to pad the MLA page, so the fallback answers; 0.27, 0.28 pad it (backends that
    index KV by block stride) and never reach it; 0.23 raises (scale-only, no fallback)."""
    scenario = _scenario()
    plan = reference_rules(RuleSet(release)).plan(scenario)
    assert plan.group_kinds == kinds
    with pytest.raises(NotImplementedError):
        reference_rules(RuleSet("0.23")).plan(scenario)


def _scenario() -> Scenario:
    import tomllib

    return scenario_from_dict(tomllib.loads(SCENARIO), "<fallback>")


def _expectations(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest(
        f"{SUITES}/test_kvconform_rules.py", "--kvconform-backend=reference",
        f"--kvconform-scenarios={SCENARIO_FILE}", "-k", "test_expectations and mla-sliding-fallback",
        "-p", "no:cacheprovider", *args,
    )  # fmt: skip


def test_the_expectation_holds_and_catches_a_broken_fallback(pytester: pytest.Pytester) -> None:
    """The reference meets the hand-derived [expect]; with the fallback broken (``None``: vLLM
    re-raises) the same expectation fails."""
    assert _expectations(pytester).ret == 0
    with mock.patch.object(grouping, "full_allocation_fallback", lambda specs: None):
        result = _expectations(pytester)
    assert result.ret != 0, result.stdout.str()[-2000:]


def test_the_strategy_reaches_the_fallback() -> None:
    def falls_back(data: dict[str, Any]) -> bool:
        s = scenario_from_dict(data, "<hypothesis>")
        if "sliding_window" not in {e.kind for e in s.layer_specs}:
            return False  # MLA + full attention: one uniform-type group without any fallback
        try:
            return reference_rules().plan(s).group_kinds == ("uniform_type",)
        except (NotImplementedError, ValueError):
            return False

    found = find(
        strategies.mla_sliding_spec_dicts(), falls_back, settings=settings(max_examples=500, database=None)
    )
    kinds = {e["kind"] for e in found["layer_specs"]}
    assert kinds == {"mla", "sliding_window"}


@pytest.fixture(scope="module")
def vllm_groups() -> Iterator[Any]:
    """vLLM's own ``get_kv_cache_groups`` on the neutral platform (the vllm backend's adapter)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    from pytest_kvconform.backends.vllm import planning, runtime
    from pytest_kvconform.backends.vllm.platform import neutral_platform, platform_scope

    runtime.vllm_runtime()
    with platform_scope(neutral_platform()):
        yield lambda specs, rt: planning.kv_cache_groups(*planning.neutral_inputs(specs, rt))


@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=strategies.mla_sliding_spec_dicts())
def test_vllm_groups_mla_and_windows_as_the_reference_does(vllm_groups: Any, data: dict[str, Any]) -> None:
    """Generated MLA + sliding-window layers: vLLM's groups (kinds, blocks, layers, bytes per block)
    are the reference's, or both raise ``NotImplementedError``."""
    import vllm

    scenario = scenario_from_dict(data, "<hypothesis>")
    specs = layer_specs(scenario)
    rules = reference_rules(RuleSet(".".join(vllm.__version__.split(".")[:2])))
    try:
        ours = rules.kv_cache_groups(specs, scenario=scenario)
    except NotImplementedError:
        with pytest.raises(NotImplementedError):
            vllm_groups(specs, scenario.runtime)
        return
    theirs = vllm_groups(specs, scenario.runtime)

    def view(groups: Any) -> list[tuple[Any, ...]]:
        return [
            (g.kind, g.block_size, g.layer_names, g.bytes_per_block, g.blocks_per_request) for g in groups
        ]

    assert view(ours) == view(theirs)
