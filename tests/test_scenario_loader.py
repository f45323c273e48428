"""The ``kv-scenario/1`` loader: packaged files load, bad files fail with a ScenarioError.

Every bad file is written to disk and loaded by path, so each error must name that file,
the dotted key and what was expected - never escape as KeyError/TypeError.
"""

from __future__ import annotations

import copy
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform.rejections import KINDS
from pytest_kvconform.scenario import (
    DEFAULTED,
    SCHEMA,
    LayerSpecEntry,
    RuntimeSettings,
    Scenario,
    ScenarioError,
    expected_value_matches,
    load_scenario,
    packaged_scenario_names,
    parse_scenario,
    scenario_from_dict,
)

# --------------------------------------------------------------------------- a tiny TOML writer


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r}")


def to_toml(data: dict[str, Any], prefix: str = "") -> str:
    """Scalars first, then ``[tables]`` and ``[[arrays of tables]]`` (enough for scenarios)."""
    lines, tail = [], []
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            tail.append(f"\n[{key}]\n" + to_toml(v, key))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            tail.extend(f"\n[[{key}]]\n" + to_toml(x, key) for x in v)
        else:
            lines.append(f"{k} = {_value(v)}")
    return "\n".join(lines) + "\n" + "".join(tail)


BASE: dict[str, Any] = {
    "schema": SCHEMA,
    "name": "loader-test",
    "model": {
        "architecture": "GraniteMoeHybridForCausalLM",
        "dtype": "bfloat16",
        "num_hidden_layers": 4,
        "layers": "MMMA",
        "sources": ["vLLM 0.33.0 vllm/platforms/interface.py, Platform._align_hybrid_block_size"],
        "attention": {"kind": "gqa", "num_kv_heads": 4, "head_dim": 128},
        "state": {"kind": "mamba2", "intermediate_size": 3072, "n_groups": 1, "n_heads": 48,
                  "head_dim": 64, "d_state": 128, "conv_kernel": 4},
    },
    "runtime": {"max_model_len": 32768, "block_size": 16},
    "expect": {"block_size": 400, "external": {"block_size": 400, "source": "x"}},
}  # fmt: skip

SPEC_LEVEL: dict[str, Any] = {
    "schema": SCHEMA,
    "name": "spec-level",
    "layer_specs": [
        {"kind": "full_attention", "count": 2, "block_size": 1, "num_kv_heads": 1, "head_size": 194},
        {"kind": "mamba", "shapes": [[3, 8192], [32, 128, 128]], "dtypes": ["bfloat16", "float32"]},
    ],
    "runtime": {"unify_policy": "lcm"},
}


def mutate(base: dict[str, Any], path: str, value: Any = ...) -> dict[str, Any]:
    """A deep copy with ``path`` (dotted; ``layer_specs.0.kind``) set, or deleted when value is ``...``."""
    data = copy.deepcopy(base)
    *parents, last = path.split(".")
    node: Any = data
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return data


def write(tmp_path: Path, data: dict[str, Any] | str, name: str = "bad.toml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else to_toml(data), encoding="utf-8")
    return path


def load_error(tmp_path: Path, data: dict[str, Any] | str) -> ScenarioError:
    path = write(tmp_path, data)
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    err = exc.value
    assert err.source == str(path)
    assert str(err).startswith(f"{path}: {err.key}: ")
    return err


def test_writer_round_trips_the_base_files(tmp_path):
    assert tomllib.loads(to_toml(BASE)) == BASE
    assert tomllib.loads(to_toml(SPEC_LEVEL)) == SPEC_LEVEL
    assert load_scenario(write(tmp_path, BASE)).model.layers == "MMMA"


# --------------------------------------------------------------------------- packaged scenarios


def test_there_are_packaged_scenarios():
    names = packaged_scenario_names()
    assert names == sorted(names)
    assert {"granite-4.0-h-tiny", "glm-5-fp8-ds-mla", "qwen3.6-35b-a3b-turboquant-k8v4"} <= set(names)


@pytest.mark.parametrize("name", packaged_scenario_names())
def test_packaged_scenario_loads_and_keeps_sources(name):
    raw = tomllib.loads(
        (resources.files("pytest_kvconform") / "scenarios" / f"{name}.toml").read_text("utf-8")
    )
    s = load_scenario(name)
    assert isinstance(s, Scenario)
    assert s.source == f"{name}.toml"
    assert s.name == raw["name"]
    assert dict(s.expect) == {k: v for k, v in raw["expect"].items() if k not in ("external", "before")}
    if "model" not in raw:  # spec-level (e.g. an MTP draft's layers): the comment cites the sources
        assert s.model is None and s.layer_specs
        text = (resources.files("pytest_kvconform") / "scenarios" / f"{name}.toml").read_text("utf-8")
        assert "# Sources: https://" in text, "every packaged scenario must cite its sources"
        return
    assert s.model is not None
    assert s.model.sources == tuple(raw["model"]["sources"])
    assert s.model.sources, "every packaged model must cite its sources"
    assert all(isinstance(x, str) and x for x in s.model.sources)
    assert len(s.model.layers) == s.model.num_hidden_layers == raw["model"]["num_hidden_layers"]
    assert dict(s.expect_external) == raw["expect"].get("external", {})
    # the same file loaded by path
    path = Path(str(resources.files("pytest_kvconform") / "scenarios" / f"{name}.toml"))
    assert load_scenario(path).model == s.model


def test_unknown_packaged_name_lists_the_packaged_ones():
    with pytest.raises(ScenarioError) as exc:
        load_scenario("no-such-model")
    assert exc.value.key == "name"
    assert "granite-4.0-h-tiny" in exc.value.problem


def test_missing_path(tmp_path):
    with pytest.raises(ScenarioError) as exc:
        load_scenario(tmp_path / "absent.toml")
    assert (exc.value.key, exc.value.problem) == ("path", "no such file")


def test_parse_scenario_names_its_source():
    s = parse_scenario(to_toml(BASE), "inline.toml")
    assert s.source == "inline.toml"
    assert s.expect == {"block_size": 400}
    assert s.expect_external == {"block_size": 400, "source": "x"}


# --------------------------------------------------------------------------- bad model-level files

BAD_CASES = [
    # (id, mutation path, value or ... to delete, key named, words the problem must contain)
    ("missing-schema", "schema", ..., "schema", "missing; expected a string"),
    ("wrong-schema", "schema", "kv-scenario/2", "schema", "expected 'kv-scenario/1'"),
    ("missing-name", "name", ..., "name", "missing; expected a string"),
    ("missing-layers", "model.layers", ..., "model.layers", "missing; expected a string"),
    (
        "missing-num-layers",
        "model.num_hidden_layers",
        ...,
        "model.num_hidden_layers",
        "missing; expected an integer",
    ),
    ("missing-architecture", "model.architecture", ..., "model.architecture", "missing"),
    (
        "missing-head-dim",
        "model.attention.head_dim",
        ...,
        "model.attention.head_dim",
        "missing; expected an integer",
    ),
    (
        "missing-state-field",
        "model.state.n_heads",
        ...,
        "model.state.n_heads",
        "missing; expected an integer",
    ),
    ("missing-attention", "model.attention", ..., "model.attention", "expected [model.attention]"),
    ("missing-state", "model.state", ..., "model.state", "expected [model.state]"),
    (
        "wrong-type-layers",
        "model.num_hidden_layers",
        "4",
        "model.num_hidden_layers",
        "expected an integer, got str",
    ),
    (
        "wrong-type-float",
        "model.attention.head_dim",
        128.0,
        "model.attention.head_dim",
        "expected an integer, got float",
    ),
    (
        "wrong-type-bool-int",
        "runtime.block_size",
        True,
        "runtime.block_size",
        "expected an integer, got bool",
    ),
    ("wrong-type-str", "model.layers", 4, "model.layers", "expected a string, got int"),
    (
        "wrong-type-bool",
        "runtime.user_specified_block_size",
        "yes",
        "runtime.user_specified_block_size",
        "expected true or false",
    ),
    ("wrong-type-table", "model.attention", "gqa", "model.attention", "expected a table"),
    ("wrong-type-runtime", "runtime", [1, 2], "runtime", "expected a table"),
    ("wrong-type-expect", "expect", 3, "expect", "expected a table"),
    ("wrong-type-external", "expect.external", 3, "expect.external", "expected a table"),
    ("wrong-type-sources", "model.sources", "one source", "model.sources", "expected a list of strings"),
    (
        "unknown-attention-kind",
        "model.attention.kind",
        "mqa",
        "model.attention.kind",
        "expected one of gqa, mla",
    ),
    ("unknown-state-kind", "model.state.kind", "rwkv", "model.state.kind", "expected one of mamba1, mamba2"),
    (
        "unknown-model-dtype",
        "model.dtype",
        "fp8",
        "model.dtype",
        "expected one of float16, bfloat16, float32",
    ),
    (
        "unknown-kv-cache-dtype",
        "runtime.kv_cache_dtype",
        "fp9",
        "runtime.kv_cache_dtype",
        "expected one of auto",
    ),
    (
        "unknown-mamba-dtype",
        "runtime.mamba_ssm_cache_dtype",
        "fp8",
        "runtime.mamba_ssm_cache_dtype",
        "expected one of auto, float16, bfloat16, float32",
    ),
    ("unknown-ssm-dtype", "model.state.ssm_dtype", "int8", "model.state.ssm_dtype", "expected one of auto"),
    (
        "unknown-cache-mode",
        "runtime.mamba_cache_mode",
        "every",
        "runtime.mamba_cache_mode",
        "expected one of none, align, all",
    ),
    ("unknown-policy", "runtime.unify_policy", "max", "runtime.unify_policy", "expected one of pad-to-max"),
    (
        "layers-too-short",
        "model.layers",
        "MMA",
        "model.layers",
        "expected 4 characters (num_hidden_layers), got 3",
    ),
    ("layers-too-long", "model.layers", "MMMAA", "model.layers", "expected 4 characters"),
    ("unknown-layer-code", "model.layers", "MMZA", "model.layers", "unknown layer code(s) 'Z'"),
    (
        "negative-heads",
        "model.attention.num_kv_heads",
        -4,
        "model.attention.num_kv_heads",
        "expected an integer >= 1, got -4",
    ),
    ("negative-state", "model.state.d_state", -1, "model.state.d_state", "expected an integer >= 1"),
    ("zero-layers", "model.num_hidden_layers", 0, "model.num_hidden_layers", "expected an integer >= 1"),
    ("block-size-zero", "runtime.block_size", 0, "runtime.block_size", "expected an integer >= 1, got 0"),
    (
        "negative-spec-tokens",
        "runtime.num_speculative_tokens",
        -1,
        "runtime.num_speculative_tokens",
        "expected an integer >= 0",
    ),
    (
        "zero-memory",
        "runtime.kv_cache_memory_bytes",
        0,
        "runtime.kv_cache_memory_bytes",
        "expected an integer >= 1",
    ),
    (
        "zero-override",
        "runtime.num_gpu_blocks_override",
        0,
        "runtime.num_gpu_blocks_override",
        "expected an integer >= 1",
    ),
    ("unknown-top-key", "extra", 1, "extra", "unknown key; expected one of"),
    ("unknown-model-key", "model.num_layers", 4, "model.num_layers", "unknown key"),
    (
        "unknown-runtime-key",
        "runtime.gpu_memory_utilization",
        1,
        "runtime.gpu_memory_utilization",
        "unknown key",
    ),
    ("mla-key-on-gqa", "model.attention.kv_lora_rank", 512, "model.attention.kv_lora_rank", "unknown key"),
    ("gdn-key-on-mamba2", "model.state.num_key_heads", 16, "model.state.num_key_heads", "unknown key"),
    (
        "sliding-window-missing",
        "model.layers",
        "MMSA",
        "model.attention.sliding_window",
        "missing; expected an integer >= 1 (layers has 'S')",
    ),
    ("chunk-missing", "model.layers", "MMLA", "model.attention.attention_chunk_size", "missing"),
    ("state-without-M", "model.layers", "AAAA", "model.state", "expected [model.state] exactly when"),
    ("no-attention-layer", "model.layers", "MM--", "model.attention", "expected [model.attention] exactly"),
]


@pytest.mark.parametrize(
    ("path", "value", "key", "words"), [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES]
)
def test_bad_model_level_file(tmp_path, path, value, key, words):
    err = load_error(tmp_path, mutate(BASE, path, value))
    assert err.key == key
    assert words in err.problem
    assert "expected" in err.problem or "unknown" in err.problem


def test_pure_state_model_loads(tmp_path):
    # a model with state layers only (e.g. a pure Mamba) needs no [model.attention]
    s = load_scenario(write(tmp_path, mutate(mutate(BASE, "model.layers", "MMMM"), "model.attention")))
    assert (s.model.num_attention_layers, s.model.num_state_layers, s.model.is_hybrid) == (0, 4, False)


def test_unknown_expect_key(tmp_path):
    err = load_error(tmp_path, mutate(BASE, "expect.blocksize", 400))
    assert (err.key, err.problem) == ("expect.blocksize", "unknown key; expected a KVPlan field name")


def test_unknown_expect_external_key(tmp_path):
    err = load_error(tmp_path, mutate(BASE, "expect.external.blocksize", 400))
    assert (err.key, err.problem) == (
        "expect.external.blocksize",
        "unknown key; expected a KVPlan field name or source",
    )


@pytest.mark.parametrize(
    ("written", "got", "matches"),
    [
        ("28.8", 28.8, True),
        ("28.8", 28.75, True),  # one place: 28.75 is 28.8 (half to even on the exact binary value)
        ("28.805", 28.8, False),  # the 0.01 tolerance this replaced let it pass
        ("28.80", 28.8, True),
        ("28.80", 28.804, True),
        ("28.80", 28.81, False),
        ("4.35", 4452 * 32 / 32768, True),  # 4.34765625
        ("1e-3", 0.001, True),
        ("1_000.5", 1000.5, True),
        ("2.0", 2, True),
        ("2.0", True, False),
        ("2.0", "2.0", False),
    ],
)
def test_an_expected_float_matches_to_the_places_it_is_written_in(written, got, matches):
    text = (
        to_toml({k: v for k, v in BASE.items() if k != "expect"})
        + f"\n[expect]\nmax_concurrency = {written}\n"
    )
    assert expected_value_matches(parse_scenario(text).expect["max_concurrency"], got) is matches


def test_a_wrong_third_decimal_in_expect_departs():
    """Granite 4.0-H Tiny's file derives max_concurrency = 28.8 (docs/scenario-derivations.md);
    written as 28.805 it must not pass (it did within the 0.01 this replaced)."""
    from pytest_kvconform import checks
    from pytest_kvconform.backends.base import ReferenceBackend
    from pytest_kvconform.reference.rules import reference_rules
    from pytest_kvconform.verdict import Departure

    path = resources.files("pytest_kvconform") / "scenarios" / "granite-4.0-h-tiny.toml"
    text = path.read_text(encoding="utf-8")
    assert "\nmax_concurrency = 28.8\n" in text
    checks.expectations(ReferenceBackend(), reference_rules(), parse_scenario(text))
    wrong = parse_scenario(text.replace("\nmax_concurrency = 28.8\n", "\nmax_concurrency = 28.805\n"))
    with pytest.raises(Departure, match=r"expect\.max_concurrency: expected 28\.805, got 28\.8"):
        checks.expectations(ReferenceBackend(), reference_rules(), wrong)


# --------------------------------------------------------------------------- [expect.before.<change>]


def test_expect_before_states_the_values_of_releases_lacking_a_change(tmp_path):
    from pytest_kvconform.reference.releases import rule_set

    before = {"null_block_reserved": {"available_bytes": 200},
              "speculative_retained_tokens": {"available_bytes": 300}}  # fmt: skip
    data = mutate(mutate(BASE, "expect.available_bytes", 100), "expect.before", before)
    s = load_scenario(write(tmp_path, data))
    assert s.expect == {"block_size": 400, "available_bytes": 100}  # [expect] itself: newest rules
    assert s.expect_before == before

    def under(release):
        return {k: v for k, v in s.expect_for(rule_set(release)).items() if k == "available_bytes"}

    assert under("0.33") == under("0.29") == {"available_bytes": ("expect", 100)}
    assert under("0.28") == {"available_bytes": ("expect.before.null_block_reserved", 200)}
    # 0.27 lacks both changes: the older change's table (0.28's) is the one for releases before it
    assert under("0.27") == {"available_bytes": ("expect.before.speculative_retained_tokens", 300)}
    assert s.with_runtime(block_size=32).expect_before == {}


def test_expect_before_rejects_replaces_every_value(tmp_path):
    """``rejects`` says the releases lacking the change reject the plan, with which kind of refusal
    (``rejections.KINDS``): judged by one of them, it is the only expectation (the oldest change's
    table wins, as for fields)."""
    from pytest_kvconform.reference.releases import rule_set

    before = {"mamba_page_padding": {"rejects": "pages_not_unifiable"},
              "attention_page_padding": {"rejects": "invalid_padding"},
              "null_block_reserved": {"block_size": 16}}  # fmt: skip
    s = load_scenario(write(tmp_path, mutate(BASE, "expect.before", before)))
    assert s.expect_for(rule_set("0.29")) == {"block_size": ("expect", 400)}
    assert s.expect_for(rule_set("0.27")) == {"block_size": ("expect.before.null_block_reserved", 16)}
    assert s.expect_for(rule_set("0.25")) == {
        "rejects": ("expect.before.mamba_page_padding", "pages_not_unifiable")
    }
    assert s.expect_for(rule_set("0.23")) == {
        "rejects": ("expect.before.attention_page_padding", "invalid_padding")
    }


def test_expect_before_fields_replace_a_refusal(tmp_path):
    """A setting the newer releases refuse (``[expect]`` is ``rejects`` alone) and the older ones
    plan (``--mamba-cache-mode all``): ``[expect.before.<change>]`` states the older plan, fields
    [expect] cannot state, and an older change's table still amends it."""
    from pytest_kvconform.reference.releases import rule_set

    data = mutate(BASE, "expect", {"rejects": "unsupported_setting"})
    before = {"mamba_cache_mode_all_removed": {"block_size": 512, "available_bytes": 1},
              "null_block_reserved": {"available_bytes": 2}}  # fmt: skip
    s = load_scenario(write(tmp_path, mutate(data, "expect.before", before)))
    assert s.expect_for(rule_set("0.32")) == {"rejects": ("expect", "unsupported_setting")}
    table = "expect.before.mamba_cache_mode_all_removed"
    assert s.expect_for(rule_set("0.31")) == {"block_size": (table, 512), "available_bytes": (table, 1)}
    assert s.expect_for(rule_set("0.28")) == {
        "block_size": (table, 512),
        "available_bytes": ("expect.before.null_block_reserved", 2),
    }


def test_old_files_load_without_expect_before(tmp_path):
    s = load_scenario(write(tmp_path, BASE))
    assert s.expect_before == {}
    from pytest_kvconform.reference.releases import rule_set

    assert s.expect_for(rule_set("0.27")) == {"block_size": ("expect", 400)}


@pytest.mark.parametrize(
    ("before", "key", "problem"),
    [
        (3, "expect.before", "expected a table of [expect.before.<change>] tables"),
        ({"null_block": {"block_size": 16}}, "expect.before.null_block", "unknown change; expected one of "
         "attention_page_padding, sliding_window_own_block, "),
        ({"null_block_reserved": 3}, "expect.before.null_block_reserved",
         "expected a non-empty table of KVPlan fields"),
        ({"null_block_reserved": {}}, "expect.before.null_block_reserved",
         "expected a non-empty table of KVPlan fields"),
        ({"null_block_reserved": {"blocksize": 16}}, "expect.before.null_block_reserved.blocksize",
         "unknown key; expected a KVPlan field name"),
        ({"null_block_reserved": {"available_bytes": 16}},
         "expect.before.null_block_reserved.available_bytes",
         "not in [expect]; state its value under the newest rules there"),
        ({"mamba_page_padding": {"rejects": "pages_not_unifiable", "block_size": 16}},
         "expect.before.mamba_page_padding.rejects", "expected alone: a rejected plan has no fields"),
        # an exception class is not a kind of refusal (rejections are compared by kind)
        ({"mamba_page_padding": {"rejects": "NotImplementedError"}},
         "expect.before.mamba_page_padding.rejects",
         f"expected a kind of refusal, one of {', '.join(KINDS)}; got 'NotImplementedError'"),
    ],
    ids=["not-a-table", "unknown-change", "change-not-a-table", "empty", "unknown-field", "not-in-expect",
         "rejects-not-alone", "rejects-not-a-rejection"],
)  # fmt: skip
def test_bad_expect_before(tmp_path, before, key, problem):
    err = load_error(tmp_path, mutate(BASE, "expect.before", before))
    assert err.key == key
    assert err.problem.startswith(problem)
    assert "\n" not in str(err)  # one line


def test_mla_geometry_checks(tmp_path):
    mla = {"kind": "mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64, "indexer_head_dim": 128}
    data = mutate(mutate(BASE, "model.attention", mla), "model.layers", "AAAA")
    del data["model"]["state"]
    assert load_scenario(write(tmp_path, data)).model.attention.num_kv_heads == 1
    err = load_error(tmp_path, mutate(data, "model.attention.num_kv_heads", 8))
    assert (err.key, "unknown key" in err.problem) == ("model.attention.num_kv_heads", True)
    err = load_error(tmp_path, mutate(data, "model.attention.indexer_layers", "II"))
    assert (err.key, err.problem) == ("model.attention.indexer_layers", "expected 4 characters of 'I' or '-'")
    err = load_error(tmp_path, mutate(data, "model.attention.indexer_layers", "IIXI"))
    assert err.key == "model.attention.indexer_layers"
    err = load_error(tmp_path, mutate(data, "model.attention.indexer_head_dim", -1))
    assert (err.key, err.problem) == ("model.attention.indexer_head_dim", "expected an integer >= 0, got -1")


def test_full_layer_geometry_checks(tmp_path):
    """``global_head_dim`` / ``num_global_kv_heads`` (Gemma 4): the full layers' own geometry."""
    gqa = {"kind": "gqa", "num_kv_heads": 16, "head_dim": 256, "sliding_window": 1024}
    data = mutate(mutate(BASE, "model.attention", gqa), "model.layers", "SSSA")
    del data["model"]["state"]
    old = load_scenario(write(tmp_path, data)).model.attention
    assert (old.global_head_dim, old.num_global_kv_heads, old.is_heterogeneous) == (None, None, False)
    assert old.for_layer("full_attention") is old
    data["model"]["attention"].update(global_head_dim=512, num_global_kv_heads=4)
    attn = load_scenario(write(tmp_path, data)).model.attention
    full = attn.for_layer("full_attention")
    assert (full.head_dim, full.num_kv_heads, full.sliding_window) == (512, 4, 1024)
    assert attn.for_layer("sliding_window") is attn
    only_dim = mutate(data, "model.attention.num_global_kv_heads")
    full = load_scenario(write(tmp_path, only_dim)).model.attention.for_layer("full_attention")
    assert (full.head_dim, full.num_kv_heads) == (512, 16)
    err = load_error(tmp_path, mutate(data, "model.attention.head_dim_v", 128))
    assert err.key == "model.attention.head_dim_v"
    err = load_error(tmp_path, mutate(data, "model.attention.global_head_dim", 0))
    assert (err.key, err.problem) == ("model.attention.global_head_dim", "expected an integer >= 1, got 0")
    hybrid = mutate(mutate(data, "model.layers", "MMMA"), "model.state", BASE["model"]["state"])
    assert load_error(tmp_path, hybrid).key == "model.attention"
    mla = {"kind": "mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64, "global_head_dim": 512}
    err = load_error(tmp_path, mutate(mutate(data, "model.attention", mla), "model.layers", "AAAA"))
    assert (err.key, "unknown key" in err.problem) == ("model.attention.global_head_dim", True)


@pytest.mark.parametrize(
    "text",
    [
        'schema = "kv-scenario/1"\nname = "x"\n[model\n',
        'schema = "kv-scenario/1"\nname = \n',
        "schema = 'kv-scenario/1'\nschema = 'again'\n",
        "\x00",
    ],
    ids=["unclosed-table", "missing-value", "duplicate-key", "nul"],
)
def test_bad_toml(tmp_path, text):
    err = load_error(tmp_path, text)
    assert err.key == "<toml>"
    assert err.problem.startswith("not valid TOML (")


def test_root_must_be_a_table():
    with pytest.raises(ScenarioError) as exc:
        scenario_from_dict([1, 2], "list.toml")  # type: ignore[arg-type]
    assert (exc.value.source, exc.value.key, exc.value.problem) == ("list.toml", "<root>", "expected a table")


# --------------------------------------------------------------------------- spec-level form


def test_spec_level_valid(tmp_path):
    s = load_scenario(write(tmp_path, SPEC_LEVEL))
    assert s.is_spec_level and s.model is None
    assert s.layer_specs == (
        LayerSpecEntry(kind="full_attention", count=2, block_size=1, num_kv_heads=1, head_size=194),
        LayerSpecEntry(kind="mamba", shapes=((3, 8192), (32, 128, 128)), dtypes=("bfloat16", "float32")),
    )
    assert s.runtime.unify_policy == "lcm"


def test_pipeline_stages_need_a_model(tmp_path):
    """A stage takes the model's layers by their index: a spec-level file has none, read from the
    file or set by ``kvconform plan --set``; a model-level one takes it."""
    data = mutate(SPEC_LEVEL, "runtime", {**SPEC_LEVEL["runtime"], "pipeline_parallel_size": 2})
    with pytest.raises(ScenarioError) as exc:
        scenario_from_dict(data, "spec.toml")
    assert exc.value.key == "runtime.pipeline_parallel_size" and "needs a [model]" in exc.value.problem
    with pytest.raises(ScenarioError, match="needs a \\[model\\]"):
        scenario_from_dict(SPEC_LEVEL, "spec.toml").with_runtime(pipeline_parallel_size=2)
    assert (
        scenario_from_dict(BASE, "base.toml")
        .with_runtime(pipeline_parallel_size=2)
        .runtime.pipeline_parallel_size
        == 2
    )


def test_spec_level_optional_fields(tmp_path):
    data = mutate(SPEC_LEVEL, "layer_specs", [
        {"kind": "sliding_window", "head_size": 64, "sliding_window": 128, "head_size_v": 0,
         "state_content_bytes": 196, "dtype": "uint8"},
        {"kind": "chunked_local", "head_size": 128, "attention_chunk_size": 8192},
        {"kind": "mamba", "shapes": [[4]], "dtypes": ["float32"], "num_speculative_blocks": 2},
    ])  # fmt: skip
    s = load_scenario(write(tmp_path, data))
    sw, chunk, state = s.layer_specs
    assert (sw.sliding_window, sw.head_size_v, sw.state_content_bytes, sw.dtype) == (128, 0, 196, "uint8")
    assert chunk.attention_chunk_size == 8192
    assert state.num_speculative_blocks == 2


SPEC_BAD_CASES = [
    (
        "shapes-dtypes-mismatch",
        "layer_specs.1.dtypes",
        ["bfloat16"],
        "layer_specs[1].dtypes",
        "expected 2 dtype names from",
    ),
    (
        "unknown-spec-dtype",
        "layer_specs.1.dtypes",
        ["bfloat16", "fp8"],
        "layer_specs[1].dtypes",
        "expected 2 dtype",
    ),
    (
        "missing-shapes",
        "layer_specs.1.shapes",
        ...,
        "layer_specs[1].shapes",
        "expected a non-empty list of lists",
    ),
    ("empty-shape", "layer_specs.1.shapes", [[], [4]], "layer_specs[1].shapes", "positive integers"),
    ("negative-dim", "layer_specs.1.shapes", [[3, -1], [4]], "layer_specs[1].shapes", "positive integers"),
    ("bool-dim", "layer_specs.1.shapes", [[3, True], [4]], "layer_specs[1].shapes", "positive integers"),
    ("flat-shapes", "layer_specs.1.shapes", [3, 8192], "layer_specs[1].shapes", "lists of positive integers"),
    (
        "unknown-spec-kind",
        "layer_specs.0.kind",
        "hidden_state",
        "layer_specs[0].kind",
        "expected one of full_attention",
    ),
    (
        "missing-head-size",
        "layer_specs.0.head_size",
        ...,
        "layer_specs[0].head_size",
        "missing; expected an integer",
    ),
    ("attention-dtype", "layer_specs.0.dtype", "fp8", "layer_specs[0].dtype", "expected one of float32"),
    (
        "spec-block-zero",
        "layer_specs.0.block_size",
        0,
        "layer_specs[0].block_size",
        "expected an integer >= 1, got 0",
    ),
    ("spec-count-zero", "layer_specs.0.count", 0, "layer_specs[0].count", "expected an integer >= 1"),
    ("spec-negative-heads", "layer_specs.0.num_kv_heads", -1, "layer_specs[0].num_kv_heads", ">= 1"),
    ("spec-negative-v", "layer_specs.0.head_size_v", -1, "layer_specs[0].head_size_v", ">= 0"),
    ("mamba-key-on-attention", "layer_specs.0.shapes", [[1]], "layer_specs[0].shapes", "unknown key"),
    ("attention-key-on-mamba", "layer_specs.1.head_size", 128, "layer_specs[1].head_size", "unknown key"),
    ("sw-without-window", "layer_specs.0.kind", "sliding_window", "layer_specs[0].sliding_window", "missing"),
    (
        "chunk-without-size",
        "layer_specs.0.kind",
        "chunked_local",
        "layer_specs[0].attention_chunk_size",
        "missing",
    ),
    ("empty-layer-specs", "layer_specs", [], "layer_specs", "expected a non-empty array of tables"),
    ("layer-spec-not-table", "layer_specs", [1], "layer_specs[0]", "expected a table"),
]


@pytest.mark.parametrize(
    ("path", "value", "key", "words"), [c[1:] for c in SPEC_BAD_CASES], ids=[c[0] for c in SPEC_BAD_CASES]
)
def test_bad_spec_level(path, value, key, words):
    data = mutate(SPEC_LEVEL, path, value)
    with pytest.raises(ScenarioError) as exc:
        scenario_from_dict(data, "spec.toml")
    assert (exc.value.source, exc.value.key) == ("spec.toml", key)
    assert words in exc.value.problem


def test_spec_level_bad_file_on_disk(tmp_path):
    err = load_error(tmp_path, mutate(SPEC_LEVEL, "layer_specs.1.dtypes", ["float32"]))
    assert err.key == "layer_specs[1].dtypes"


def test_both_model_and_layer_specs(tmp_path):
    data = {**BASE, "layer_specs": SPEC_LEVEL["layer_specs"]}
    err = load_error(tmp_path, data)
    assert (err.key, err.problem) == ("model", "expected exactly one of [model] or [[layer_specs]]")


def test_neither_model_nor_layer_specs(tmp_path):
    err = load_error(tmp_path, mutate(BASE, "model"))
    assert (err.key, err.problem) == ("model", "expected exactly one of [model] or [[layer_specs]]")


# --------------------------------------------------------------------------- with_runtime()


def test_with_runtime_changes_and_drops_expectations():
    s = scenario_from_dict(BASE, "base.toml")
    t = s.with_runtime(block_size=32, user_specified_block_size=True, num_gpu_blocks_override=100)
    assert (t.runtime.block_size, t.runtime.user_specified_block_size) == (32, True)
    assert t.runtime.num_gpu_blocks_override == 100
    assert (t.expect, t.expect_external) == ({}, {})
    assert s.runtime.block_size == 16  # the original is unchanged
    assert t.with_runtime(num_gpu_blocks_override=None).runtime.num_gpu_blocks_override is None
    assert t.with_runtime(num_speculative_tokens=0).runtime.num_speculative_tokens == 0


@pytest.mark.parametrize(
    ("changes", "key", "words"),
    [
        ({"block_size": 0}, "runtime.block_size", "expected an integer >= 1, got 0"),
        ({"block_size": "32"}, "runtime.block_size", "expected an integer >= 1, got '32'"),
        ({"block_size": 16.0}, "runtime.block_size", "expected an integer"),
        ({"max_model_len": True}, "runtime.max_model_len", "expected an integer"),
        ({"num_speculative_tokens": -1}, "runtime.num_speculative_tokens", "expected an integer >= 0"),
        ({"num_gpu_blocks_override": 0}, "runtime.num_gpu_blocks_override", "expected an integer >= 1"),
        ({"kv_cache_dtype": "fp9"}, "runtime.kv_cache_dtype", "expected one of auto"),
        ({"mamba_cache_mode": "every"}, "runtime.mamba_cache_mode", "expected one of none, align, all"),
        # "all" aligns the block to the Mamba chunk, which the file must state
        ({"mamba_cache_mode": "all"}, "model.state.chunk_size", "needed by mamba_cache_mode = 'all'"),
        ({"unify_policy": "lcm-ish"}, "runtime.unify_policy", "expected one of"),
        ({"user_specified_block_size": 1}, "runtime.user_specified_block_size", "expected true or false"),
    ],
)
def test_with_runtime_validates(changes, key, words):
    s = scenario_from_dict(BASE, "base.toml")
    with pytest.raises(ScenarioError) as exc:
        s.with_runtime(**changes)
    assert (exc.value.source, exc.value.key) == ("base.toml", key)
    assert words in exc.value.problem


def test_with_runtime_unknown_setting_is_a_scenario_error():
    # Found by this suite: with_runtime(bogus=1) leaked a TypeError from dataclasses.replace, so
    # `kvconform plan --set bogus=1` crashed (fixed in 0c277de).
    s = scenario_from_dict(BASE, "base.toml")
    with pytest.raises(ScenarioError) as exc:
        s.with_runtime(gpu_memory_utilization=0.9)
    assert (exc.value.source, exc.value.key) == ("base.toml", "runtime.gpu_memory_utilization")
    assert exc.value.problem.startswith("unknown key; expected one of ")
    assert "max_model_len" in exc.value.problem


def test_runtime_defaults():
    s = scenario_from_dict(mutate(BASE, "runtime"), "base.toml")
    # the keys whose default is the engine's are unset (the plan gives them it: reference.defaults)
    assert s.runtime == RuntimeSettings(unset=DEFAULTED)
