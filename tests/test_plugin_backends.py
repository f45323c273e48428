"""The backend API as a plugin uses it: a toy package registered through the entry point group.

``tests/toy_plugin`` is laid out as an installed distribution (``kvtoy`` plus its
``.dist-info`` with ``[pytest_kvconform.backends]`` entry points), so each pytester run selects
its backends by name, as a plugin's CI would.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pytest_kvconform.scenario import load_scenario, packaged_scenario_names

pytestmark = pytest.mark.usefixtures("toy_on_path")
SUITES = Path(__file__).resolve().parents[1] / "pytest_kvconform" / "suites"
RULES, ALLOCATION = str(SUITES / "test_kvconform_rules.py"), str(SUITES / "test_kvconform_allocation.py")
SCENARIOS = [load_scenario(name) for name in packaged_scenario_names()]
#: the scenarios every release plans (an engine refusal in [expect] has no pool to allocate)
PLANNED = [s for s in SCENARIOS if "rejects" not in s.expect]
#: ... of which some layer holds a KV cache (an encoder-only model allocates no tensor)
ALLOCATED = [
    s for s in PLANNED if s.model is None or s.model.num_attention_layers or s.model.num_state_layers
]
#: refused when the engine builds its config (a setting the installed release does not take):
#: the reference's code refuses them before any step the toy answers (inherited)
UNCONFIGURED = [s for s in SCENARIOS if s.expect.get("rejects") == "unsupported_setting"]


@pytest.fixture
def toy(pytester: pytest.Pytester, toy_on_path: Path) -> pytest.Pytester:
    pytester.syspathinsert(toy_on_path)
    return pytester


def run(pytester: pytest.Pytester, *args: str, subprocess: bool = False) -> tuple[pytest.RunResult, dict]:
    """In-process by default; ``subprocess`` for runs that import vLLM (pytester restores
    ``sys.modules`` after an in-process run, and torch's extensions cannot be imported twice)."""
    report = pytester.path / "report.json"
    runner = pytester.runpytest_subprocess if subprocess else pytester.runpytest
    result = runner(*args, f"--kvconform-report={report}", "-p", "no:cacheprovider")
    return result, json.loads(report.read_text())["rules"]


def test_the_toy_backends_are_found_by_entry_point(toy: pytest.Pytester) -> None:
    from pytest_kvconform.backends.registry import available_backends

    assert {"toy", "toy-mla-kv", "toy-no-guard", "toy-broken-kernel"} <= set(available_backends())


def test_own_layer_specs_are_compared_layer_by_layer(
    toy: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 1: a spec bug in the plugin's own get_kv_cache_spec fails layer_specs and the plan
    that composes it, naming the layer and the field; every other family passes. In a
    subprocess: after another in-process run, a departure raised here may be of a stale copy of
    its class and count as a crash."""
    selected = "glm or (granite and not hma-disabled and not mamba-all)"
    result, rules = run(toy, RULES, "--kvconform-backend=toy-mla-kv", "-k", selected, subprocess=True)
    failed = {rule for rule, counts in rules.items() if counts["departed"] or counts["crashed"]}
    assert failed == {"layer_specs", "plan"}
    assert rules["layer_specs"]["departed"] == 2  # GLM-4.7-Flash and GLM-5 are MLA; Granite is not
    assert rules["layer_specs"]["agreed"] == 4  # the Granite scenarios: its own specs, right
    # GLM-5's fp8_ds_mla latent is packed (656 B/token whatever head_size_v says): its plan does
    # not move, only the layer-by-layer comparison sees the wrong spec.
    assert rules["plan"]["departed"] == 2  # GLM-4.7-Flash's test_plan and its [expect] table
    result.stdout.fnmatch_lines([
        "*[[]layer_specs[]] backend 'toy-mla-kv' on scenario 'zai-org/GLM-4.7-Flash' "
        "(glm-4.7-flash-bf16.toml): layer 0 (attention): head_size_v: reference 0, backend 576",
    ])  # fmt: skip


def test_a_model_the_backend_declines_is_declined_not_agreed(toy: pytest.Pytester) -> None:
    """The scenario reaches every rule; a step the backend declines for an input kind (MLA for its
    kernel, anything but dense GQA for its specs) is answered by the reference and reported in
    the summary, and a plan whose load-bearing steps are not all the backend's is not agreed:
    declined where it declined one, inherited where the reference's code answered one."""
    result, rules = run(toy, RULES, "--kvconform-backend=toy", "-k", "plan or kernel")
    assert result.ret == 0
    dense = [s for s in SCENARIOS if s.model is not None and set(s.model.layers) == {"A"}
             and s.model.attention.kind == "gqa" and s.runtime.kv_cache_dtype == "auto"]  # fmt: skip
    assert dense  # Qwen2.5-3B at TP 4, its auto-fit sibling
    assert (rules["plan"]["agreed"], rules["plan"]["departed"], rules["plan"]["crashed"]) == (0, 0, 0)
    assert (rules["plan"]["inherited"], rules["plan"]["declined"]) == (
        len(dense) + len(UNCONFIGURED),
        len(SCENARIOS) - len(dense) - len(UNCONFIGURED),
    )
    mla = sum(s.model is not None and s.model.use_mla for s in SCENARIOS)
    result.stdout.fnmatch_lines(
        [
            "plan steps the reference answered because the backend declined them:",
            f"*{mla} plans  kernel_block.kernel_block_size: reference (does not serve an MLA model*"
            "MLA models never take the toy paged kernel)",
        ]
    )


def test_an_unexpected_exception_fails_every_plan_naming_the_rule(toy: pytest.Pytester) -> None:
    """Item 4: a kernel that cannot load is a failure of the kernel_block rule wherever it is asked."""
    result, rules = run(toy, RULES, "--kvconform-backend=toy-broken-kernel", "-k", "plan")
    mla = sum(s.model is not None and s.model.use_mla for s in SCENARIOS)  # never asked: declined
    refused = len(SCENARIOS) - len(PLANNED)  # the engine refuses them before the kernel block
    assert (rules["plan"]["crashed"], rules["plan"]["declined"]) == (
        len(PLANNED) - mla, mla + refused - len(UNCONFIGURED),
    )  # fmt: skip
    result.stdout.fnmatch_lines([
        "*[[]kernel_block[]] backend 'toy-broken-kernel'.kernel_block_size raised on scenario*"
        "RuntimeError: cannot load libtoy_paged_attention.so*",
    ])  # fmt: skip


def test_one_sequence_gets_the_chosen_block(toy: pytest.Pytester) -> None:
    """Item 3: one_sequence_bytes(block_size, state_page_padded, scenario) with the block choice
    as its own step (the toy inherits both: reported inherited, not passed)."""
    result, rules = run(toy, RULES, "--kvconform-backend=toy", "-k", "one_sequence or choose_block")
    assert result.ret == 0
    model_level = sum(s.model is not None for s in SCENARIOS)  # spec-level ones skip one_sequence
    assert rules["one_sequence"]["inherited"] == model_level - len(UNCONFIGURED)  # those have no block
    assert rules["block_size"]["inherited"] == len(SCENARIOS)


def test_backend_options_and_notes_reach_the_header(toy: pytest.Pytester) -> None:
    """Item 5: options go to the constructor; the backend's notes are in the header."""
    toy.makepyfile("def test_x(kv_backend): assert kv_backend.device == 'gpu0'")
    result = toy.runpytest("--kvconform-backend=toy", "--kvconform-backend-option=device=gpu0")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["kvconform: backend=toy *, options: device=gpu0, toy device: gpu0"])


def test_allocation_family(toy: pytest.Pytester) -> None:
    """Item 6: a backend that allocates is checked for bytes held and the oversized-config guard."""
    _, rules = run(toy, ALLOCATION, "--kvconform-backend=toy", "-k", "pool_holds or larger_than")
    assert rules["allocation"] == {
        **rules["allocation"],
        "agreed": 2 * len(ALLOCATED),
        "departed": 0,
        "crashed": 0,
    }
    result, rules = run(toy, ALLOCATION, "--kvconform-backend=toy-no-guard", "-k", "larger_than")
    assert rules["allocation"]["departed"] == len(ALLOCATED)
    result.stdout.fnmatch_lines(
        ["*check_kv_cache_config(4 of 3 blocks): reference 'rejects: oversized_config', backend 'accepts'"]
    )


def test_a_plugin_platform_is_driven_through_the_vllm_backend(
    toy: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin's own Platform subclass (``kvtoy.broken.RepadsMambaPlatform``, via ``class
    RepadsVllm(ToyVllm): platform = RepadsMambaPlatform``): its hooks run end to end and the
    platform suite catches its non-idempotent ``check_and_update_config``."""
    if importlib.util.find_spec("vllm") is None:  # not imported here: pytester drops modules at teardown
        pytest.skip("vLLM is not installed")
    platform_suite = str(SUITES / "test_kvconform_platform.py")
    result, rules = run(
        toy,
        platform_suite,
        "--kvconform-backend=toy-vllm-repads",
        "-k",
        "granite-4.0-h-tiny and not tp4 and not hma-disabled and not mamba-all",
        subprocess=True,
    )
    # update_block_size_for_backend is vLLM core's Platform method, which the toy does not override
    platform = rules["platform"]
    assert (platform["departed"], platform["agreed"], platform["core"]) == (1, 2, 1)
    result.stdout.fnmatch_lines([
        "kvconform: backend=toy-vllm-repads *vLLM platform rules: kvtoy.broken.RepadsMambaPlatform*",
        "*RepadsMambaPlatform.check_and_update_config (second run) set cache_config.mamba_page_size_padded: "
        "819200 -> 1638400*",
    ])  # fmt: skip
