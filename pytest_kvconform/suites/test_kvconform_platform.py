"""Checks every vLLM platform must pass, whoever wrote it (capability ``vllm_platform``).

The vllm backend drives a platform class end to end (vLLM core's neutral ``Platform`` by
default; a plugin's own through ``VllmBackend(platform=...)``). On each packaged scenario:

* its config hooks are idempotent: running ``check_and_update_config`` or
  ``update_block_size_for_backend`` a second time changes nothing (vllm-gaudi#1708: a second
  ``check_and_update_config`` rescaled Granite-4.0-H-small's padded Mamba page from 2,162,688 B
  to 2,621,440 B);
* the block size it settles on is one every attention backend of the model supports
  (``AttentionBackend.supports_block_size``, vllm/v1/attention/backend.py);
* a padded state page equals the attention page (``_align_hybrid_block_size`` pads the Mamba
  page to exactly the attention page; unification has nothing left to pad).
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvconform.conformance import call_rule
from pytest_kvconform.scenario import Scenario

pytestmark = [pytest.mark.kvconform_rule("platform"), pytest.mark.kvconform_requires("vllm_platform")]


@pytest.mark.parametrize("hook", ["check_and_update_config", "update_block_size_for_backend"])
def test_config_hook_is_idempotent(kv_backend: Any, kv_scenario: Scenario, hook: str) -> None:
    changes = call_rule(kv_backend, "rerun_hooks", scenario=kv_scenario)[hook]
    assert not changes, "; ".join(map(str, changes))


def test_block_size_is_supported_by_every_attention_backend(kv_backend: Any, kv_scenario: Scenario) -> None:
    engine = call_rule(kv_backend, "engine", scenario=kv_scenario)
    block = engine.config.cache_config.block_size
    rejecting = [b.get_name() for b in engine.backends if not b.supports_block_size(block)]
    assert not rejecting, f"block_size {block} is not supported by {', '.join(rejecting)}"


def test_padded_state_page_equals_the_attention_page(kv_backend: Any, kv_scenario: Scenario) -> None:
    engine = call_rule(kv_backend, "engine", scenario=kv_scenario)
    padded = engine.config.cache_config.mamba_page_size_padded
    if padded is None:
        pytest.skip("no padded state page")
    # a MambaSpec has state shapes (asked of the object: it may live in the backend's own process)
    pages = {int(s.page_size_bytes) for s in engine.specs.values() if not hasattr(s, "shapes")}
    state = {int(s.page_size_bytes) for s in engine.specs.values() if hasattr(s, "shapes")}
    assert state == {padded}, f"state pages {sorted(state)} != mamba_page_size_padded {padded}"
    assert pages == {padded}, f"attention pages {sorted(pages)} != the padded state page {padded}"
