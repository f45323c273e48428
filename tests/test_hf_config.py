"""A model's config.json read as a scenario (pytest_kvconform/hf_config.py).

Three directions: the packaged scenarios written as config.json by the vllm backend's writers and
read back (round trip, every architecture with a writer); real config.json files of models the
packaged scenarios cite (tests/data/configs, sources in its README.md) read into the packaged
geometry; and the CLI, which plans a config.json as it plans the packaged scenario. vLLM's own
specs of those real files are compared in CI's vllm runs (``--kvconform-scenarios=tests/data/configs``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pytest_kvconform.backends.vllm.configs import WRITERS, hf_config_dict
from pytest_kvconform.cli import main
from pytest_kvconform.hf_config import READERS, ConfigError, load_config_scenario, scenario_toml
from pytest_kvconform.scenario import (
    ModelGeometry,
    Scenario,
    load_scenario,
    packaged_scenario_names,
    parse_scenario,
)

CONFIGS = Path(__file__).parent / "data" / "configs"

#: tests/data/configs/<model> -> the packaged scenario whose [model] it must read as
REAL = {
    "granite-4.0-h-tiny": "granite-4.0-h-tiny",
    "mistral-7b-v0.1": "mistral-7b-v0.1-pp2",
    "gemma-3-27b-it": "gemma-3-27b-it",
    "gemma-3-1b-it": "gemma-3-1b-it-rbln-cr03",
    "qwen3-next-80b-a3b": "qwen3-next-80b-a3b",
    "deepseek-v3": "deepseek-v3-mtp1",
    "qwen2.5-3b-instruct": "qwen2.5-3b-instruct-tp4",
    "llama-3.1-8b-instruct": "llama-3.1-8b-instruct-fp8",
}

#: tests/data/configs/<model> with no packaged scenario -> its [model], read by hand off the
#: published file (tests/data/configs/README.md) and the model's own code (comments)
HAND_READ = {
    # 42 layers alternating from a sliding layer 0 (Gemma2Config's layer_types default, vLLM's
    # Gemma2Attention); served in bfloat16 (its vllm-serve-args: the weights are float32)
    "gemma-2-9b": """architecture = "Gemma2ForCausalLM"
dtype = "bfloat16"
num_hidden_layers = 42
layers = "SASASASASASASASASASASASASASASASASASASASASA"
max_position_embeddings = 8192
[model.attention]
kind = "gqa"
num_kv_heads = 8
head_dim = 256
sliding_window = 4096""",
    # MLA on all 27 layers: the latent (kv_lora_rank 512) and the rope part (64) per token
    "deepseek-v2-lite": """architecture = "DeepseekV2ForCausalLM"
dtype = "bfloat16"
num_hidden_layers = 27
layers = "AAAAAAAAAAAAAAAAAAAAAAAAAAA"
max_position_embeddings = 163840
[model.attention]
kind = "mla"
kv_lora_rank = 512
qk_rope_head_dim = 64""",
    # 10 short-conv + 6 attention layers (2, 5, 8, 10, 12, 14); head size 2048 / 32 = 64
    "lfm2-1.2b": """architecture = "Lfm2ForCausalLM"
dtype = "bfloat16"
num_hidden_layers = 16
layers = "MMAMMAMMAMAMAMAM"
max_position_embeddings = 128000
[model.attention]
kind = "gqa"
num_kv_heads = 8
head_dim = 64
[model.state]
kind = "short_conv"
conv_dim = 2048
conv_kernel = 3""",
    # attention where i % 8 == 4 (layers 4, 12, 20, 28), Mamba elsewhere; head size 4096 / 32 = 128;
    # the Mamba inner width 2 * 4096
    "jamba-v0.1": """architecture = "JambaForCausalLM"
dtype = "bfloat16"
num_hidden_layers = 32
layers = "MMMMAMMMMMMMAMMMMMMMAMMMMMMMAMMM"
max_position_embeddings = 262144
[model.attention]
kind = "gqa"
num_kv_heads = 8
head_dim = 128
[model.state]
kind = "mamba1"
intermediate_size = 8192
d_state = 16
conv_kernel = 4""",
}


def stated_differences(stated: ModelGeometry, read: ModelGeometry) -> list[tuple[str, object, object]]:
    """Fields of ``stated`` (a packaged [model]) that ``read`` gives otherwise; a field the file
    leaves at its default (0, None: not stated, e.g. query heads only Metal reads) is not held."""
    out = []
    for name in ("architecture", "dtype", "num_hidden_layers", "layers", "num_nextn_predict_layers",
                 "max_position_embeddings"):  # fmt: skip
        want, got = getattr(stated, name), getattr(read, name)
        if want and want != got:
            out.append((name, want, got))
    for part in ("attention", "state"):
        want_part, got_part = getattr(stated, part), getattr(read, part)
        if (want_part is None) != (got_part is None):
            out.append((part, want_part, got_part))
            continue
        if want_part is None:
            continue
        defaults = type(want_part)(**({"kind": want_part.kind, "conv_kernel": 0} if part == "state" else {}))
        for f in dataclasses.fields(want_part):
            want, got = getattr(want_part, f.name), getattr(got_part, f.name)
            if want != getattr(defaults, f.name) and want != got:
                out.append((f"{part}.{f.name}", want, got))
    return out


def assert_round_trips(scenario: Scenario, folder: Path) -> None:
    """configs.py writes the scenario's config.json into ``folder``; read back, its [model] is the same
    (a float32 model served with ``--dtype float32``: ``--dtype auto`` leaves it to the platform)."""
    (folder / "config.json").write_text(json.dumps(hf_config_dict(scenario)), encoding="utf-8")
    assert scenario.model is not None
    read = load_config_scenario(folder, {"dtype": "float32"} if scenario.model.dtype == "float32" else {})
    assert scenario.model is not None and read.model is not None
    assert stated_differences(scenario.model, read.model) == []


def _written() -> list[str]:
    names = []
    for name in packaged_scenario_names():
        model = load_scenario(name).model
        if model is not None and model.architecture in WRITERS:
            names.append(name)
    return names


def test_every_architecture_with_a_config_writer_has_a_reader() -> None:
    assert set(WRITERS) <= set(READERS)


@pytest.mark.parametrize("name", _written())
def test_a_packaged_scenario_round_trips_through_its_config_json(name: str, tmp_path: Path) -> None:
    """configs.py writes the scenario's config.json; reading it back gives the same [model]."""
    assert_round_trips(load_scenario(name), tmp_path)


def test_every_writer_architecture_is_round_tripped() -> None:
    """Each architecture with a writer has a packaged model-level scenario in the round trip."""
    covered = {load_scenario(n).model.architecture for n in _written()}  # type: ignore[union-attr]
    missing = set(WRITERS) - covered
    # families no packaged scenario uses: round-tripped from a scenario of their own below
    assert missing <= set(SYNTHETIC), sorted(missing - set(SYNTHETIC))


#: architectures no packaged scenario uses: a [model] of each (the families' small test geometries)
SYNTHETIC = {
    "Gemma2ForCausalLM": dict(
        layers="SASASA", attention=dict(num_kv_heads=4, head_dim=256, sliding_window=4096)
    ),
    "Gemma3ForCausalLM": dict(
        layers="SSSSSA", attention=dict(num_kv_heads=1, head_dim=256, sliding_window=512)
    ),
    "Gemma4ForCausalLM": dict(
        layers="SSSSSA",
        attention=dict(num_kv_heads=8, head_dim=256, sliding_window=1024, global_head_dim=512),
    ),
    "MistralForCausalLM": dict(layers="AAAA", attention=dict(num_kv_heads=8, head_dim=128)),
    "Qwen3ForCausalLM": dict(layers="AAAA", attention=dict(num_kv_heads=8, head_dim=128)),
    "DeepseekV2ForCausalLM": dict(
        layers="AAAA", attention=dict(kind="mla", kv_lora_rank=512, qk_rope_head_dim=64)
    ),
    "DeepseekV32ForCausalLM": dict(
        layers="AAAA", attention=dict(kind="mla", kv_lora_rank=512, qk_rope_head_dim=64, indexer_head_dim=128)
    ),
    "JambaForCausalLM": dict(
        layers="MMMMAMMM",
        attention=dict(num_kv_heads=8, head_dim=128),
        state=dict(kind="mamba1", intermediate_size=8192, d_state=16, conv_kernel=4),
    ),
    "Lfm2ForCausalLM": dict(
        layers="MMAMMA",
        attention=dict(num_kv_heads=8, head_dim=64),
        state=dict(kind="short_conv", conv_dim=2048, conv_kernel=3),
    ),
    "KimiLinearForCausalLM": dict(
        layers="MMMA",
        attention=dict(kind="mla", kv_lora_rank=512, qk_rope_head_dim=64),
        state=dict(kind="kda", num_heads=32, head_dim=128, conv_kernel=4),
    ),
    "NemotronHForCausalLM": dict(
        layers="M-M-A-",
        attention=dict(num_kv_heads=8, head_dim=128),
        state=dict(
            kind="mamba2",
            intermediate_size=8192,
            n_groups=8,
            n_heads=128,
            head_dim=64,
            d_state=128,
            conv_kernel=4,
        ),
    ),
    "BertModel": dict(layers="------", attention=dict(num_kv_heads=12, head_dim=32)),
}


def synthetic(arch: str) -> Scenario:
    """A scenario of :data:`SYNTHETIC`'s geometry for ``arch``."""
    spec = SYNTHETIC[arch]
    attention = {"kind": "gqa", **spec["attention"]}
    layers = spec["layers"]
    lines = ['schema = "kv-scenario/1"', f'name = "{arch}"', "[model]", f'architecture = "{arch}"',
             'dtype = "bfloat16"', f"num_hidden_layers = {len(layers)}", f'layers = "{layers}"',
             "[model.attention]", *(f"{k} = {json.dumps(v)}" for k, v in attention.items())]  # fmt: skip
    if "state" in spec:
        lines += ["[model.state]", *(f"{k} = {json.dumps(v)}" for k, v in spec["state"].items())]
    lines += ["[runtime]", "max_model_len = 4096"]
    return parse_scenario("\n".join(lines) + "\n", f"{arch}.toml")


@pytest.mark.parametrize("arch", sorted(SYNTHETIC))
def test_an_architecture_no_packaged_scenario_uses_round_trips(arch: str, tmp_path: Path) -> None:
    assert_round_trips(synthetic(arch), tmp_path)


@pytest.mark.parametrize("model", sorted(REAL))
def test_a_real_config_json_reads_as_the_packaged_scenario(model: str) -> None:
    """Hand-written from the published config.json (tests/data/configs/README.md): the read
    [model] is the packaged scenario's, whatever spelling the family used (full_attention_interval,
    a Gemma 3 text_config without a pattern, a sliding_window gated off by use_sliding_window)."""
    read = load_config_scenario(CONFIGS / model)
    packaged = load_scenario(REAL[model])
    assert packaged.model is not None and read.model is not None
    assert stated_differences(packaged.model, read.model) == []


@pytest.mark.parametrize("model", sorted(HAND_READ))
def test_a_real_config_json_reads_as_read_by_hand(model: str) -> None:
    """The architectures no packaged scenario covers: the published file (and its vllm-serve-args)
    reads as the [model] written by hand from the same file."""
    read = load_config_scenario(CONFIGS / model)
    text = f'schema = "kv-scenario/1"\nname = "{model}"\n[model]\n{HAND_READ[model]}\n'
    hand = parse_scenario(text + "[runtime]\nmax_model_len = 4096\n", model)
    assert hand.model is not None and read.model is not None
    assert stated_differences(hand.model, read.model) == []


def test_every_real_config_json_is_checked() -> None:
    assert sorted(p.name for p in CONFIGS.iterdir() if p.is_dir()) == sorted([*REAL, *HAND_READ])


def test_a_float32_model_needs_the_served_dtype(tmp_path: Path) -> None:
    """vLLM's --dtype auto serves a float32 checkpoint in the platform's first supported dtype: the
    file alone does not say, so reading it without --dtype names the key; a model directory's
    vllm-serve-args or the command line says it (the command line wins)."""
    data = json.loads((CONFIGS / "gemma-2-9b" / "config.json").read_text(encoding="utf-8"))
    (tmp_path / "config.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ConfigError, match="torch_dtype: float32: --dtype auto serves it"):
        load_config_scenario(tmp_path)
    (tmp_path / "vllm-serve-args").write_text("--dtype float16 --block-size 32\n", encoding="utf-8")
    read = load_config_scenario(tmp_path)
    assert read.model is not None and read.model.dtype == "float16"
    assert read.runtime.block_size == 32
    assert load_config_scenario(tmp_path, {"dtype": "float32"}).model.dtype == "float32"


def test_a_bad_vllm_serve_args_file_names_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        (CONFIGS / "lfm2-1.2b" / "config.json").read_text(), encoding="utf-8"
    )
    (tmp_path / "vllm-serve-args").write_text("--block-size sixteen\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="vllm-serve-args: options: argument --block-size"):
        load_config_scenario(tmp_path)


def test_every_model_field_names_the_key_it_came_from() -> None:
    text = scenario_toml(CONFIGS / "granite-4.0-h-tiny")
    assert 'layers = "MMMMMAMMMMMMMMMAMMMMMMMMMAMMMMMMMMMAMMMM"  # layer_types' in text
    assert "head_dim = 128  # hidden_size / num_attention_heads" in text
    assert "intermediate_size = 3072  # mamba_expand * hidden_size" in text
    gemma = scenario_toml(CONFIGS / "gemma-3-27b-it")
    assert "num_hidden_layers = 62  # text_config.num_hidden_layers" in gemma


def _config(tmp_path: Path, **fields: object) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(fields), encoding="utf-8")
    return tmp_path


def test_an_unknown_architecture_is_an_error_listing_the_known_ones(tmp_path: Path) -> None:
    path = _config(tmp_path, architectures=["FalconForCausalLM"], num_hidden_layers=2, torch_dtype="bfloat16")
    with pytest.raises(
        ConfigError, match=r"architectures: 'FalconForCausalLM' is not known; known: BertModel, "
    ):
        load_config_scenario(path)


def test_an_ambiguous_key_is_an_error_naming_it(tmp_path: Path) -> None:
    """Qwen2's use_sliding_window: which layers slide depends on max_window_layers."""
    path = _config(
        tmp_path, architectures=["Qwen2ForCausalLM"], num_hidden_layers=4, torch_dtype="bfloat16",
        num_attention_heads=4, num_key_value_heads=2, hidden_size=512, use_sliding_window=True,
        sliding_window=1024, max_window_layers=2, max_position_embeddings=4096,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"config\.json: use_sliding_window: true without layer_types"):
        load_config_scenario(path)


def test_a_missing_key_is_an_error_naming_it(tmp_path: Path) -> None:
    config = json.loads((CONFIGS / "qwen3-next-80b-a3b" / "config.json").read_text(encoding="utf-8"))
    del config["linear_key_head_dim"]
    path = _config(tmp_path, **config)
    with pytest.raises(ConfigError, match=r"linear_key_head_dim: missing"):
        load_config_scenario(path)


def test_kvconform_scenario_prints_a_scenario_that_loads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["scenario", str(CONFIGS / "mistral-7b-v0.1"), "--block-size", "32", "--kv-cache-dtype", "fp8"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    scenario = parse_scenario(text, "printed.toml")
    assert (scenario.runtime.block_size, scenario.runtime.user_specified_block_size) == (32, True)
    assert scenario.runtime.kv_cache_dtype == "fp8"
    assert scenario.runtime.max_model_len == 32768  # vllm serve's default: max_position_embeddings
    assert scenario.runtime.unset == ("mamba_cache_mode", "max_concurrent_batches")  # the engine's


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["plan", *argv, "--json", "--vllm", "0.33"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_kvconform_plans_granite_from_its_config_json_as_the_packaged_scenario(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The bug report's command: Granite-4.0-H-Tiny's own config.json at --block-size 400, with the
    packaged scenario's runtime spelled as vllm serve options."""
    packaged = _plan(capsys, "granite-4.0-h-tiny", "--set", "block_size=400")
    from_config = _plan(
        capsys, str(CONFIGS / "granite-4.0-h-tiny" / "config.json"), "--block-size", "400",
        "--max-model-len", "32768", "--kv-cache-memory-bytes", str(8 << 30), "--mamba-cache-mode", "none",
        "--no-async-scheduling",
    )  # fmt: skip
    assert from_config["scenario"] == "granite-4.0-h-tiny"
    assert {**from_config, "scenario": None} == {**packaged, "scenario": None}
    assert from_config["block_size"] == 400


def test_a_bad_config_json_is_a_one_line_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = _config(tmp_path, architectures=["GraniteMoeHybridForCausalLM"], num_hidden_layers=4)
    assert main(["plan", str(path / "config.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torch_dtype: missing" in err


def test_dtype_is_a_config_json_option(capsys: pytest.CaptureFixture[str]) -> None:
    """--dtype serves a config.json's model; a scenario file states its [model] dtype itself."""
    # a layer's token: K and V, 8 KV heads x 256 each, 4 bytes in float32 and 2 in bfloat16
    served = _plan(capsys, str(CONFIGS / "gemma-2-9b"), "--max-model-len", "4096")  # vllm-serve-args: bf16
    assert served["attn_bytes_per_token_per_layer"] == 2 * 8 * 256 * 2
    fp32 = _plan(capsys, str(CONFIGS / "gemma-2-9b"), "--dtype", "float32", "--max-model-len", "4096")
    assert fp32["attn_bytes_per_token_per_layer"] == 2 * 8 * 256 * 4
    assert main(["plan", "granite-4.0-h-tiny", "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dtype applies to a config.json" in err


def test_async_scheduling_counts_the_files_pipeline_stages(capsys: pytest.CaptureFixture[str]) -> None:
    """--[no-]async-scheduling on a scenario of 2 pipeline stages: 3 batches in flight, or 2."""
    assert _plan(capsys, "mistral-7b-v0.1-pp2", "--async-scheduling")["max_concurrent_batches"] == 3
    assert _plan(capsys, "mistral-7b-v0.1-pp2", "--no-async-scheduling")["max_concurrent_batches"] == 2


def _respelled(arch: str, tmp_path: Path, respell) -> tuple[ModelGeometry, ModelGeometry]:
    """The [model] read from a writer's config.json and from the same file in another spelling."""
    scenario = load_scenario(WRITTEN_BY[arch]) if arch in WRITTEN_BY else synthetic(arch)
    config = hf_config_dict(scenario)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps(respell(dict(config))), encoding="utf-8")
    a, b = load_config_scenario(tmp_path / "a").model, load_config_scenario(tmp_path / "b").model
    assert a is not None and b is not None
    return a, b


WRITTEN_BY = {
    "GraniteMoeHybridForCausalLM": "granite-4.0-h-tiny",
    "NemotronHForCausalLM": "nemotron-3-super-120b-a12b",
}


def _nemotron_5(c: dict) -> dict:
    """transformers 5's NemotronHConfig: layers_block_type, no num_hidden_layers, mamba_chunk_size."""
    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    c["layers_block_type"] = [kinds[x] for x in c.pop("hybrid_override_pattern")]
    del c["num_hidden_layers"]
    return c


def _granite_5(c: dict) -> dict:
    """transformers 5's GraniteMoeHybridConfig: full/linear_attention, mamba_d_head "auto"."""
    c["layer_types"] = [
        "full_attention" if x == "attention" else "linear_attention" for x in c["layer_types"]
    ]
    c["mamba_d_head"] = "auto"
    return c


def _lfm2_old(c: dict) -> dict:
    """Lfm2Config before layer_types: full_attn_idxs."""
    c["full_attn_idxs"] = [i for i, x in enumerate(c.pop("layer_types")) if x == "full_attention"]
    return c


def _gemma2_old(c: dict) -> dict:
    """Gemma2Config before layer_types: even layers slide; transformers 5 spells torch_dtype dtype."""
    del c["layer_types"]
    c["dtype"] = c.pop("torch_dtype")
    return c


def _qwen_next_old(c: dict) -> dict:
    """Qwen3NextConfig before layer_types: every full_attention_interval-th layer full."""
    del c["layer_types"]
    c["full_attention_interval"] = 4
    return c


@pytest.mark.parametrize(
    ("arch", "respell"),
    [
        ("NemotronHForCausalLM", _nemotron_5),
        ("GraniteMoeHybridForCausalLM", _granite_5),
        ("Lfm2ForCausalLM", _lfm2_old),
        ("Gemma2ForCausalLM", _gemma2_old),
    ],
    ids=[
        "nemotron-h-layers_block_type",
        "granite-linear_attention-auto-head",
        "lfm2-full_attn_idxs",
        "gemma2-parity-dtype",
    ],
)
def test_each_spelling_of_a_family_reads_the_same(arch: str, respell, tmp_path: Path) -> None:
    a, b = _respelled(arch, tmp_path, respell)
    assert stated_differences(a, b) == []
    assert a.layers == b.layers and a.num_hidden_layers == b.num_hidden_layers


def test_qwen3_next_reads_full_attention_interval(tmp_path: Path) -> None:
    scenario = load_scenario("qwen3-next-80b-a3b")
    config = _qwen_next_old(hf_config_dict(scenario))
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    read = load_config_scenario(tmp_path).model
    assert read is not None and read.layers == "MMMA" * 12
