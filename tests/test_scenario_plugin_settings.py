"""The scenario keys plugins read: ``[runtime] max_num_seqs``, ``[runtime.additional_config]`` and
``[runtime.env]`` load, validate with one-line errors, and leave old files unchanged."""

from __future__ import annotations

import os
from typing import Any

import pytest

from pytest_kvconform.scenario import RuntimeSettings, ScenarioError, load_scenario, scenario_from_dict

BASE: dict[str, Any] = {
    "schema": "kv-scenario/1", "name": "llama-3-8b",
    "model": {"architecture": "LlamaForCausalLM", "dtype": "bfloat16", "num_hidden_layers": 2, "layers": "AA",
              "attention": {"kind": "gqa", "num_kv_heads": 8, "head_dim": 128}},
}  # fmt: skip


def _with_runtime(**runtime: Any) -> Any:
    return scenario_from_dict({**BASE, "runtime": runtime}, "<test>")


def test_the_plugin_keys_load() -> None:
    rt = _with_runtime(
        max_num_seqs=64,
        additional_config={
            "turboquant": True,
            "sharding": {"sharding_strategy": {"enable_dp_attention": True}},
        },
        env={"NEW_MODEL_DESIGN": "1", "TPU_NAME": "local"},
    ).runtime
    assert rt.max_num_seqs == 64
    assert rt.additional_config_dict == {
        "turboquant": True, "sharding": {"sharding_strategy": {"enable_dp_attention": True}}
    }  # fmt: skip
    assert rt.env == (("NEW_MODEL_DESIGN", "1"), ("TPU_NAME", "local"))
    hash(rt)  # engines are cached per runtime


def test_old_files_load_unchanged() -> None:
    rt = load_scenario("granite-4.0-h-tiny").runtime
    assert (rt.max_num_seqs, rt.additional_config_dict, rt.env) == (None, {}, ())
    assert rt == RuntimeSettings(**{**vars(rt)})


@pytest.mark.parametrize(
    ("runtime", "message"),
    [
        ({"max_num_seqs": 0}, "<test>: runtime.max_num_seqs: expected an integer >= 1, got 0"),
        ({"additional_config": 3}, "<test>: runtime.additional_config: expected a table"),
        ({"env": {"X": 1}}, "<test>: runtime.env.X: expected a string"),
    ],
)
def test_bad_values_are_one_line_errors(runtime: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError) as info:
        _with_runtime(**runtime)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


def test_set_changes_them_from_the_command_line() -> None:
    s = _with_runtime().with_runtime(max_num_seqs=8, additional_config='{"turboquant": true}')
    assert (s.runtime.max_num_seqs, s.runtime.additional_config_dict) == (8, {"turboquant": True})
    with pytest.raises(ScenarioError, match=r"runtime\.additional_config: expected a JSON object"):
        _with_runtime().with_runtime(additional_config="[1]")
    with pytest.raises(ScenarioError, match=r"runtime.env: expected a \[runtime.env\] table of strings"):
        _with_runtime().with_runtime(env="X=1")


def test_env_is_set_only_while_the_vllm_backend_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_kvconform.backends.vllm.backend import scenario_env

    monkeypatch.setenv("KVCONFORM_TEST_KEPT", "before")
    monkeypatch.delenv("KVCONFORM_TEST_NEW", raising=False)
    env = (("KVCONFORM_TEST_KEPT", "during"), ("KVCONFORM_TEST_NEW", "1"))
    with scenario_env(env):
        assert (os.environ["KVCONFORM_TEST_KEPT"], os.environ["KVCONFORM_TEST_NEW"]) == ("during", "1")
    assert os.environ["KVCONFORM_TEST_KEPT"] == "before" and "KVCONFORM_TEST_NEW" not in os.environ
