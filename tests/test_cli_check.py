"""``kvconform check`` and ``kvconform explain``: outcomes per scenario and rule, the derivation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.cli import main
from pytest_kvconform.scenario import packaged_scenario_names

BACKENDS = """
from pytest_kvconform.backends.base import ReferenceBackend
from pytest_kvconform.gaps import OfflineGap
from pytest_kvconform.requirements import Declines

class WrongAlignment(ReferenceBackend):
    name = "wrong-alignment"
    def align_hybrid_block_size(self, scenario):
        return super().align_hybrid_block_size(scenario.with_runtime(kernel_block_alignment=32))

class Empty(ReferenceBackend):
    name = "empty"

class Partial(ReferenceBackend):
    name = "partial"
    declines = ReferenceBackend.declines | Declines({"one_sequence": "no one-sequence estimate here"})
    def kv_cache_groups(self, specs, scenario):
        raise OfflineGap("cpu_build", "no grouper on this host")
    def one_sequence_bytes(self, block_size, state_page_padded, scenario):
        raise AssertionError("must not be called: declined")
"""

GRANITE = "granite-4.0-h-tiny"


@pytest.fixture
def backends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "clicheck.py").write_text(BACKENDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def check_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code, out, err = run(capsys, "check", "--vllm=0.33", "--json", *argv)
    assert err == ""
    return code, json.loads(out)


def test_the_reference_checks_only_its_expectations(capsys: pytest.CaptureFixture[str]) -> None:
    """The reference against itself is a self-check of the scenario's ``[expect]`` numbers, not
    a matrix of the reference agreeing with itself."""
    code, doc = check_json(capsys, GRANITE)
    assert code == 0
    assert (doc["schema"], doc["producer"], doc["mode"]) == (
        "kvconform-report/2",
        "kvconform check",
        "self-check",
    )
    assert [(r["test"], r["verdict"]) for r in doc["results"]] == [
        (f"test_expectations[{GRANITE}]", "agreed")
    ]
    assert doc["reference"] == {"vllm_release": "0.33", "selected_by": "--kvconform-vllm"}


def test_every_check_of_a_hybrid_applies(backends: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Granite 4.0-H is a hybrid with state layers: every per-scenario family is asked, none is
    not applicable (an empty subclass answers each with the reference's code)."""
    _, doc = check_json(capsys, GRANITE, "--backend", "clicheck:Empty")
    assert {r for r in doc["rules"] if doc["rules"][r]["inherited"]} == {
        "hybrid_alignment",
        "block_size",
        "state_page",
        "layer_specs",
        "attention_page",
        "max_memory",
        "unification",
        "grouping",
        "memory",
        "one_sequence",
        "kernel_block",
        "plan",
    }


def test_a_departure_exits_1_and_names_scenario_rule_field_and_values(
    backends: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Granite 4.0-H tiny: 4 KV heads x (128 + 128) x 2 B = 2048 B/token; the Mamba-2 state is
    # conv (4 - 1) x (3072 + 2 x 1 x 128) x 2 B = 19968 + ssm 48 x 64 x 128 x 2 B = 786432, 806400 B.
    # 806400 / 2048 = 393.75 tokens: at alignment 16 the block is 400, at 32 it is 416.
    code, out, _ = run(capsys, "check", GRANITE, "--backend", "clicheck:WrongAlignment", "--vllm=0.33")
    assert code == 1
    assert "DEPARTED  granite-4.0-h-tiny [hybrid_alignment] block_size: reference 400, backend 416" in out
    # state layers do not depend on the attention block: that rule is inherited, never "passed"
    assert "INHERITED granite-4.0-h-tiny [state_page]" in out
    code, doc = check_json(capsys, GRANITE, "--backend", "clicheck:WrongAlignment")
    first = next(r for r in doc["results"] if r["rule"] == "hybrid_alignment")
    assert first["difference"] == {"field": "block_size", "reference": "400", "backend": "416"}
    assert first["test"] == "test_hybrid_alignment[granite-4.0-h-tiny]"


def test_an_empty_backend_is_inherited_everywhere(backends: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = check_json(capsys, GRANITE, "--backend", "clicheck:Empty")
    assert code == 0
    # the plan's [expect] numbers are compared with the reference's code answering for it
    assert {r["verdict"] for r in doc["results"]} == {"inherited"}
    assert doc["totals"]["agreed"] == 0 and doc["totals"]["inherited"] == len(doc["results"])


def test_a_declined_rule_and_an_offline_gap_are_declined_with_the_reason(
    backends: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc = check_json(capsys, GRANITE, "--backend", "clicheck:Partial")
    by_rule: dict[str, dict[str, Any]] = {}
    for r in doc["results"]:  # a family's first check (grouping: test_kv_cache_groups)
        by_rule.setdefault(r["rule"], r)
    assert by_rule["one_sequence"]["verdict"] == "declined"
    assert "does not provide one_sequence: no one-sequence estimate" in by_rule["one_sequence"]["message"]
    assert by_rule["grouping"]["verdict"] == "declined"
    assert "cannot run this here: cpu_build" in by_rule["grouping"]["message"]
    assert "no grouper on this host" in by_rule["grouping"]["message"]
    # the plan takes the reference's groups for the step the backend cannot run: not agreed
    assert [r["verdict"] for r in doc["results"] if r["rule"] == "plan"] == ["declined"] * 2
    assert code == 0


def test_scenarios_from_files_and_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import pytest_kvconform

    packaged = Path(pytest_kvconform.__file__).parent / "scenarios"
    shutil.copy(packaged / f"{GRANITE}.toml", tmp_path / "a.toml")
    shutil.copy(packaged / "gemma-3-27b-it.toml", tmp_path / "b.toml")
    code, doc = check_json(capsys, str(tmp_path))
    assert code == 0
    assert sorted({r["scenario"] for r in doc["results"]}) == ["a", "b"]
    _, everything = check_json(capsys)
    assert {r["scenario"] for r in everything["results"]} == set(packaged_scenario_names())


def test_check_writes_a_markdown_report_with_the_departure(
    backends: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "summary.md"
    code, _, _ = run(capsys, "check", GRANITE, "--backend", "clicheck:WrongAlignment", f"--report={report}")
    assert code == 1
    text = report.read_text()
    assert "| granite-4.0-h-tiny | hybrid_alignment | block_size | 400 | 416 |" in text
    assert "| rule family | agreed | inherited | core | declined | departed | known | crashed | n/a |" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "no-such-scenario"], "kvconform: bad scenario: no-such-scenario: name: not a file"),
        (["check", GRANITE, "--backend", "nope"], "kvconform: unknown kvconform backend 'nope'"),
        (["check", GRANITE, "--vllm", "0.1"], "kvconform: --vllm: vLLM 0.1: no rule set"),
        (["check", GRANITE, "--xfails", "missing.toml"], "kvconform: --xfails: missing.toml: cannot read"),
        (["explain", "gemma-3-27b-it", "--svg", "x.svg"],
         "kvconform: --svg: google/gemma-3-27b-it (52 sliding-window 1024 + 10 full layers): not a hybrid"),
        (["explain", "no-such-scenario"], "kvconform: bad scenario: no-such-scenario"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str],
    message: str,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.startswith(message), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_an_empty_folder_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "check", str(tmp_path))
    assert code == 2
    assert err == f"kvconform: {tmp_path}: no *.toml scenario files nor a config.json in this folder\n"


def test_explain_shows_each_step_with_its_numbers_and_vllm_function(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "explain", GRANITE, "--vllm=0.33")
    assert code == 0
    # 806400 / 2048 = 393.75 -> 400 (multiple of 16); 400 x 2048 = 819200 B; the state page is
    # padded by 819200 - 806400 = 12800 B = 1.59 %. 36 Mamba + 4 attention layers in groups of 4:
    # 10 groups, 4 x 819200 = 3276800 B per block; 8 GiB // 3276800 = 2621 blocks.
    for fragment in [
        "1. engine defaults  [vllm/engine/arg_utils.py::EngineArgs.",
        "the scenario states every such setting",
        "2. platform config  [vllm/platforms/interface.py::Platform.check_and_update_config]",
        "3. hybrid alignment  [vllm/platforms/interface.py::Platform._align_hybrid_block_size]",
        "806400 / 2048 = 393.75 tokens", "block 400", "attention page 400 x 2048 = 819200 B",
        "state page padded 806400 -> 819200 B (+1.59%)",
        "[vllm/v1/core/kv_cache_planning.py::unify_kv_cache_spec_page_size]",
        "[vllm/v1/core/kv_cache_planning.py::get_kv_cache_groups]",
        "9 groups mamba", "1 group full_attention", "bytes per block = largest group's pages: 3276800 B",
        "num_blocks = 8589934592 B // 3276800 B = 2621",
        "_check_enough_kv_cache_memory", "admission: ok",
        # prepare_kernel_block_sizes: a Mamba group keeps its block (max_model_len, mamba_cache_mode
        # none); the attention group's 400 is a multiple of 16, served as is
        "[vllm/v1/worker/utils.py::prepare_kernel_block_sizes (select_common_block_size)]",
        "kernel block per group: 32768 (x9), 400 (x1)",
        "32800 tokens (cdiv(32768, 400) x 400)",  # vllm-metal PR #229
        "logical block 400 -> kernel block 16 (25 kernel blocks per block)",  # 400 = 25 x 16; not 32 x n
    ]:  # fmt: skip
        assert fragment in out, fragment


def test_explain_formats_every_step() -> None:
    """Each step of a composed plan has its lines in ``kvconform explain`` (a new step without
    them was a KeyError)."""
    from pytest_kvconform.explain import FORMATS
    from pytest_kvconform.reference.plan import STEPS

    assert set(FORMATS) == set(STEPS)


def test_explain_cites_the_release_module(capsys: pytest.CaptureFixture[str]) -> None:
    # get_kv_cache_groups moved to kv_cache_planning.py in vLLM 0.33; 0.32 has it in kv_cache_utils.py
    code, out, _ = run(capsys, "explain", GRANITE, "--vllm=0.32")
    assert code == 0 and "[vllm/v1/core/kv_cache_utils.py::get_kv_cache_groups]" in out


def test_explain_with_a_backend_names_the_first_departing_step(
    backends: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "explain", GRANITE, "--backend", "clicheck:WrongAlignment")
    assert code == 1
    assert out.splitlines()[-1] == "backend wrong-alignment departs first at step 3 (hybrid alignment)"
    assert "3. hybrid alignment" in out and "DEPARTS: block_size: reference 400, backend 416" in out
    code, out, _ = run(capsys, "explain", GRANITE, "--backend", "clicheck:Empty")
    assert code == 0 and "backend empty" in out and "no departure" in out and "inherited" in out


def test_explain_svg_draws_the_padding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import xml.etree.ElementTree as ET

    svg = tmp_path / "block.svg"
    code, _, _ = run(capsys, "explain", GRANITE, f"--svg={svg}")
    assert code == 0
    root = ET.parse(svg).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    titles = {r.findtext(f"{ns}title"): float(r.get("width")) for r in root.iter(f"{ns}rect")}
    # one block: 4 page slots of 819200 B; the state page 806400 B + 12800 B padding; the attention
    # page fills its slot (no padding)
    assert [t for t in titles if t.startswith("page slot")] == [f"page slot {i}: 819200 B" for i in range(4)]
    assert "padding: 12800 B" in titles and "state page: 806400 B" in titles
    assert titles["state page: 806400 B"] / titles["padding: 12800 B"] == pytest.approx(
        806400 / 12800, rel=1e-2
    )
    assert not any(t.startswith("padding") and t != "padding: 12800 B" for t in titles)
