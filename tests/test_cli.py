"""The ``kvconform`` console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_kvconform.cli import main

REQUIRED_KEYS = {
    "block_size", "kernel_block_size", "attn_bytes_per_token_per_layer", "indexer_bytes_per_token_per_layer",
    "state_bytes_per_layer", "page_size_bytes", "state_padding_pct", "kv_cache_groups", "group_size",
    "bytes_per_block", "kv_bytes_per_token", "blocks_per_request", "num_blocks", "max_concurrency",
    "one_sequence_bytes", "admission",
}  # fmt: skip


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_has_every_documented_key(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "granite-4.0-h-tiny", "--json")
    assert code == 0
    plan = json.loads(out)
    assert set(plan) >= REQUIRED_KEYS
    # Granite-4.0-H-Tiny, 8 GiB, L = 32768: vLLM 0.33.0 Platform._align_hybrid_block_size gives
    # 16 * cdiv(806,400, 16 * 2048) = 400; 4 * 819,200 = 3,276,800 B per block; 8 GiB // 3,276,800 = 2621
    assert (plan["block_size"], plan["bytes_per_block"], plan["num_blocks"]) == (400, 3_276_800, 2621)
    assert plan["admission"] == "ok"


def test_set_overrides_runtime_settings(capsys: pytest.CaptureFixture[str]) -> None:
    # vllm-metal PR #229: max_model_len 2048 at block 400 reserves cdiv(2048, 400) * 400 = 2400 tokens
    code, out, _ = run(capsys, "plan", "granite-4.0-h-tiny", "--set", "max_model_len=2048", "--json")
    assert code == 0
    assert json.loads(out)["one_sequence_tokens"] == 2400


def test_admission_error_is_reported_in_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "plan", "granite-4.0-h-tiny", "--set", "kv_cache_memory_bytes=100000000", "--json"
    )
    assert code == 0
    assert json.loads(out)["admission"].startswith(
        "To serve at least one request with the model's max seq len"
    )


def test_text_output_lists_the_fields(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "qwen3.5-0.8b")
    assert code == 0
    assert any(line.split() == ["block_size", "544"] for line in out.splitlines())  # vllm-metal#584, #235


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "no-such-scenario"], "no-such-scenario: name: not a file and not a packaged scenario"),
        (
            ["plan", "granite-4.0-h-tiny", "--set", "block_size=0"],
            "runtime.block_size: expected an integer >= 1",
        ),
        (["plan", "granite-4.0-h-tiny", "--set", "bogus=1"], "--set: bogus=1: expected KEY=VALUE"),
        (
            ["plan", "granite-4.0-h-tiny", "--set", "kv_cache_dtype=fp7"],
            "runtime.kv_cache_dtype: expected one of",
        ),
    ],
)
def test_bad_input_exits_2_with_the_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert message in err
    assert "Traceback" not in err


def test_bad_file_names_file_and_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('schema = "kv-scenario/1"\nname = "x"\n[model]\narchitecture = "X"\ndtype = "bfloat16"\n'
                   'num_hidden_layers = "two"\nlayers = "AA"\n')  # fmt: skip
    code, _, err = run(capsys, "plan", str(bad))
    assert code == 2
    assert f"{bad}: model.num_hidden_layers: expected an integer, got str 'two'" in err


def test_rule_rejection_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    # vLLM 0.33.0 MambaMixer2.__init__ (layer 0 is Mamba2): 48 heads cannot be split over 5 ranks
    code, _, err = run(capsys, "plan", "granite-4.0-h-tiny", "--set", "tensor_parallel_size=5")
    assert code == 1
    assert "Tensor parallel world size must divide num heads." in err


def test_a_refusal_prints_on_one_line() -> None:
    """vLLM's configs refuse through pydantic, whose message spans lines (vLLM 0.32's CacheConfig
    for --mamba-cache-mode all); kvconform prints every refusal as one line."""
    from pytest_kvconform.cli import refusal

    pydantic_like = ValueError(
        "1 validation error for CacheConfig\nmamba_cache_mode\n  Input should be 'align' or 'none' "
        "[type=literal_error, input_value='all', input_type=str]"
    )
    assert refusal(pydantic_like) == (
        "ValueError: 1 validation error for CacheConfig mamba_cache_mode Input should be 'align' or "
        "'none' [type=literal_error, input_value='all', input_type=str]"
    )
    assert refusal(NotImplementedError()) == "NotImplementedError"


def test_console_script_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pytest_kvconform.cli", "list"], capture_output=True, text=True, check=True
    ).stdout
    assert "granite-4.0-h-tiny" in out.split()


def test_suites_path_points_at_the_conformance_suites(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "suites")
    assert code == 0
    assert (Path(out.strip()) / "test_kvconform_rules.py").is_file()
