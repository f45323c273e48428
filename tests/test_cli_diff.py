"""``kvconform diff`` and ``--vllm`` on ``kvconform plan``: a plan under two releases' rules, each
changed field with the sizing change that moves it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pytest_kvconform.cli import main
from pytest_kvconform.reference.releases import CHANGES, RuleSet

GRANITE = "granite-4.0-h-tiny"
WHERE = {c.name: c.where for c in CHANGES}

# Granite 4.0-H tiny (8 GiB, L = 32768): the Mamba-2 state is conv (4 - 1) x (3072 + 2 x 1 x 128) x 2 B
# = 19968 + ssm 48 x 64 x 128 x 2 B = 786432, 806400 B; attention 4 KV heads x (128 + 128) x 2 B =
# 2048 B/token; block 16 x cdiv(806400, 16 x 2048) = 16 x 25 = 400, page 400 x 2048 = 819200 B,
# 36 Mamba + 4 attention layers in 10 groups of 4: 4 x 819200 = 3276800 B per block.
GIB8 = 8 * 1024**3  # 8589934592
BLOCK = 4 * 819_200  # 3276800


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def diff_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = run(capsys, "diff", GRANITE, "--json", *argv)
    assert (code, err) == (0, "")
    return dict(json.loads(out))


def cause(name: str, since: str) -> dict[str, str]:
    return {"name": name, "since": since, "where": WHERE[name]}


def test_granite_0_27_to_0_33_moves_the_available_bytes_by_the_null_block(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Of the changes in (0.27, 0.33] only null_block_reserved (0.29) touches Granite as packaged: no
    # sliding-window layers, mamba_cache_mode "none" (no checkpoint block, no checkpoint alignment),
    # no speculative tokens (K - 1 + 0 conv rows either way), no GDN layers. From 0.29 the admission
    # check sees 8589934592 - 3276800 = 8586657792 B; the pool stays 8589934592 // 3276800 = 2621
    # blocks, and 91 blocks per request (9 Mamba groups x 1 + cdiv(32768, 400) = 82) need
    # 298188800 B, far below either budget, so admission and the estimate (32768) do not move.
    doc = diff_json(capsys, "--vllm", "0.27", "--vllm", "0.33")
    assert (doc["scenario"], doc["from"], doc["to"]) == (GRANITE, "0.27", "0.33")
    assert doc["changes"] == [
        {
            "field": "available_bytes",
            "from": GIB8,
            "to": GIB8 - BLOCK,
            "causes": [cause("null_block_reserved", "0.29")],
        }
    ]
    code, out, _ = run(capsys, "diff", GRANITE, "--vllm", "0.27", "--vllm", "0.33")
    assert code == 0
    lines = out.splitlines()
    assert lines[1].split() == ["field", "vLLM", "0.27", "vLLM", "0.33", "moved", "by"]
    assert lines[2].split() == ["available_bytes", "8589934592", "8586657792", "null_block_reserved"]
    assert f"null_block_reserved (vLLM 0.29): {WHERE['null_block_reserved']}" in lines


def test_b_older_than_a_moves_back(capsys: pytest.CaptureFixture[str]) -> None:
    doc = diff_json(capsys, "--vllm", "0.33", "--vllm", "0.27")
    assert (doc["from"], doc["to"]) == ("0.33", "0.27")
    assert doc["changes"] == [
        {
            "field": "available_bytes",
            "from": GIB8 - BLOCK,
            "to": GIB8,
            "causes": [cause("null_block_reserved", "0.29")],
        }
    ]


def test_the_null_block_moves_admission_and_the_estimate_at_a_tight_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A budget of exactly one request: 91 x 3276800 = 298188800 B. 0.27: all of it is available, the
    # request fits, admission ok and the estimate is max_model_len, 32768. 0.33: 298188800 - 3276800
    # = 294912000 B = 90 blocks; 9 Mamba blocks + cdiv(L, 400) <= 90 gives L <= 81 x 400 = 32400.
    doc = diff_json(capsys, "--vllm", "0.27", "--vllm", "0.33", "--set", "kv_cache_memory_bytes=298188800")
    by_field = {c["field"]: c for c in doc["changes"]}
    assert set(by_field) == {"available_bytes", "admission", "max_model_len_estimate"}
    assert (by_field["available_bytes"]["from"], by_field["available_bytes"]["to"]) == (
        298_188_800,
        294_912_000,
    )
    assert (by_field["max_model_len_estimate"]["from"], by_field["max_model_len_estimate"]["to"]) == (
        32768,
        32400,
    )
    assert by_field["admission"]["from"] == "ok"
    assert by_field["admission"]["to"].startswith(
        "To serve at least one request with the model's max seq len"
    )
    assert all(c["causes"] == [cause("null_block_reserved", "0.29")] for c in doc["changes"])


def test_a_field_two_changes_move_together_names_both(capsys: pytest.CaptureFixture[str]) -> None:
    # Align mode with a prefill checkpoint alignment of 64. 0.33 (prefill_checkpoint_alignment):
    # k = lcm(16, 64) = 64, block 64 x cdiv(806400, 64 x 2048) = 64 x 7 = 448, 4 x 448 x 2048 =
    # 3670016 B per block; 0.27: block 400, 3276800 B. Available: 0.27 8589934592; 0.33
    # 8589934592 - 3670016 = 8586264576. The null block alone (0.27 + it) gives 8589934592 - 3276800,
    # the alignment alone gives 8589934592 (no reservation), but 0.33 without the alignment gives
    # 8589934592 - 3276800 too: both are named.
    # Blocks per request: 0.27, 9 Mamba groups x (2 + 0) + cdiv(32768, 400) = 18 + 82 = 100; 0.33,
    # 9 x (3 + 0) (mamba2_prefill_checkpoint_block) + cdiv(32768, 448) = 27 + 74 = 101; either change
    # alone moves it (0.27 + checkpoint block: 27 + 82 = 109; 0.27 + alignment: 18 + 74 = 92).
    doc = diff_json(
        capsys, "--vllm", "0.27", "--vllm", "0.33", "--set", "mamba_cache_mode=align",
        "--set", "extra_block_alignment=64",
    )  # fmt: skip
    by_field = {c["field"]: c for c in doc["changes"]}
    assert (by_field["block_size"]["from"], by_field["block_size"]["to"]) == (400, 448)
    assert by_field["block_size"]["causes"] == [cause("prefill_checkpoint_alignment", "0.33")]
    assert (by_field["bytes_per_block"]["from"], by_field["bytes_per_block"]["to"]) == (3_276_800, 3_670_016)
    assert (by_field["available_bytes"]["from"], by_field["available_bytes"]["to"]) == (GIB8, 8_586_264_576)
    assert by_field["available_bytes"]["causes"] == [
        cause("null_block_reserved", "0.29"), cause("prefill_checkpoint_alignment", "0.33")
    ]  # fmt: skip
    assert (by_field["blocks_per_request"]["from"], by_field["blocks_per_request"]["to"]) == (100, 101)
    assert by_field["blocks_per_request"]["causes"] == [
        cause("mamba2_prefill_checkpoint_block", "0.32"), cause("prefill_checkpoint_alignment", "0.33")
    ]  # fmt: skip


def test_a_plan_rejected_at_one_release_is_a_change(capsys: pytest.CaptureFixture[str]) -> None:
    # Align mode, 2 speculative tokens: the layers' conv state has 4 - 1 + 2 = 5 rows, 5 x 3328 x 2 B
    # = 33280 + 786432 = 819712 B. Before 0.32 (alignment_counts_speculative_rows) the alignment prices
    # 3 rows, 806400 B: block 400, page 819200 B < 819712 B, and MambaSpec's assertion
    # page_size_padded >= real_page_size_bytes refuses it. 0.32 prices 819712 B: block
    # 16 x cdiv(819712, 32768) = 16 x 26 = 416, page 851968 B.
    settings = ("--set", "mamba_cache_mode=align", "--set", "num_speculative_tokens=2")
    doc = diff_json(capsys, "--vllm", "0.31", "--vllm", "0.32", *settings)
    [change] = doc["changes"]
    assert (change["field"], change["to"]) == ("plan", "accepted")
    # the assertion's text (pytest rewrites the package's asserts: it varies under pytest)
    assert change["from"].startswith("rejected: AssertionError")
    assert change["causes"] == [cause("alignment_counts_speculative_rows", "0.32")]
    code, out, _ = run(capsys, "diff", GRANITE, "--vllm", "0.31", "--vllm", "0.32", *settings)
    row = out.splitlines()[2]
    assert code == 0 and row.split()[:2] == ["plan", "rejected:"] and "AssertionError" in row
    assert row.split()[-2:] == ["accepted", "alignment_counts_speculative_rows"]
    code, _, err = run(capsys, "plan", GRANITE, "--vllm", "0.31", *settings)
    assert code == 1 and "rejected: AssertionError" in err
    code, out, _ = run(capsys, "plan", GRANITE, "--vllm", "0.32", "--json", *settings)
    assert code == 0 and json.loads(out)["block_size"] == 416


def test_no_change_between_two_releases(capsys: pytest.CaptureFixture[str]) -> None:
    # (0.29, 0.32]: a sliding-window block rule (Granite has none), the align-mode checkpoint block
    # (mode "none") and the speculative conv rows (0 speculative tokens): the plan does not move.
    doc = diff_json(capsys, "--vllm", "0.29", "--vllm", "0.32")
    assert doc["changes"] == []
    code, out, _ = run(capsys, "diff", GRANITE, "--vllm", "0.29", "--vllm", "0.32")
    assert code == 0 and len(out.splitlines()) == 1 and ": no change (" in out


def test_vllm_on_plan_chooses_the_rules(capsys: pytest.CaptureFixture[str]) -> None:
    plans = {}
    for release in ("0.28", "0.29"):
        code, out, _ = run(capsys, "plan", GRANITE, "--vllm", release, "--json")
        assert code == 0
        plans[release] = json.loads(out)
    assert (plans["0.28"]["available_bytes"], plans["0.29"]["available_bytes"]) == (GIB8, GIB8 - BLOCK)
    assert {k for k in plans["0.28"] if plans["0.28"][k] != plans["0.29"][k]} == {"available_bytes"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["diff", GRANITE, "--vllm", "abc", "--vllm", "0.33"], "kvconform: --vllm: vLLM version 'abc'"),
        (["diff", GRANITE, "--vllm", "0.27", "--vllm", "0.1"], "kvconform: --vllm: vLLM 0.1: no rule set"),
        (["diff", GRANITE, "--vllm", "0.27"], "kvconform: --vllm: give it twice"),
        (["diff", GRANITE], "kvconform: --vllm: give it twice"),
        (["plan", GRANITE, "--vllm", "0.1"], "kvconform: --vllm: vLLM 0.1: no rule set"),
        (["plan", GRANITE, "--vllm", "x.y"], "kvconform: --vllm: vLLM version 'x.y'"),
        (["diff", "no-such-scenario", "--vllm", "0.27", "--vllm", "0.33"], "kvconform: bad scenario"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.startswith(message), err
    assert err.count("\n") == 1 and "Traceback" not in err
    if "--vllm" in message:
        assert "0.27, 0.28" in err.partition("known releases ")[2]


def test_rule_set_toggles_one_change() -> None:
    old = RuleSet("0.27")
    assert not old.has("null_block_reserved")
    assert old.toggled("null_block_reserved").has("null_block_reserved")
    new = RuleSet("0.33").toggled("null_block_reserved")
    assert not new.has("null_block_reserved") and new.has("prefill_checkpoint_alignment")
    assert new.toggled("null_block_reserved").has("null_block_reserved")
    with pytest.raises(ValueError, match="no sizing change named 'nope'"):
        old.toggled("nope")
