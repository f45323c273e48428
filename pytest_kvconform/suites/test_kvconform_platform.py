"""Checks every vLLM platform must pass, whoever wrote it (backends that drive one: the ``platform``
family, which the reference and backends without a vLLM platform decline).

The vllm backend drives a platform class end to end (vLLM core's neutral ``Platform`` by
default; a plugin's own through ``VllmBackend(platform=...)``). On each packaged scenario:

* its config hooks are idempotent: running ``check_and_update_config`` or
  ``update_block_size_for_backend`` a second time changes nothing (vllm-gaudi#1708: a second
  ``check_and_update_config`` rescaled Granite-4.0-H-small's padded Mamba page from 2,162,688 B
  to 2,621,440 B);
* the block size it settles on is one every attention backend of the model supports
  (``AttentionBackend.supports_block_size``, vllm/v1/attention/backend.py), unless it is the
  user's ``--block-size`` left as given, which the engine refuses later (the plan's kernel block
  sizes step);
* a padded state page equals the attention page (``_align_hybrid_block_size`` pads the Mamba
  page to exactly the attention page; unification has nothing left to pad).
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvconform.checks import reference_choice
from pytest_kvconform.conformance import Departure, NotApplicable, call_rule
from pytest_kvconform.scenario import Scenario

pytestmark = pytest.mark.kvconform_rule("platform")


def _fail(backend: Any, scenario: Scenario, field: str, expected: Any, got: Any, what: str) -> None:
    message = f"[platform] backend {backend.name!r} on scenario {scenario.name!r}: {what}"
    raise Departure(message, "platform", field, expected, got, pytrace=False)


@pytest.mark.parametrize("hook", ["check_and_update_config", "update_block_size_for_backend"])
def test_config_hook_is_idempotent(
    kv_backend: Any, kv_reference: Any, kv_scenario: Scenario, hook: str
) -> None:
    """The whole ``VllmConfig`` after a second run of the hook equals the config after the first."""
    reference_choice(kv_reference, kv_scenario)  # no config when the engine refuses first
    changes = call_rule(kv_backend, "rerun_hooks", scenario=kv_scenario)[hook]
    if changes:
        first = changes[0]
        _fail(kv_backend, kv_scenario, first.setting, first.before, first.after, "; ".join(map(str, changes)))


def test_block_size_is_supported_by_every_attention_backend(
    kv_backend: Any, kv_reference: Any, kv_scenario: Scenario
) -> None:
    reference_choice(kv_reference, kv_scenario)  # no config when the engine refuses first
    engine = call_rule(kv_backend, "engine", scenario=kv_scenario)
    block = engine.config.cache_config.block_size
    rt = kv_scenario.runtime
    if rt.user_specified_block_size and block == rt.block_size:
        raise NotApplicable(
            "the user's --block-size, as given: the runner serves or refuses it (kernel block sizes)"
        )
    rejecting = [b.get_name() for b in engine.backends if not b.supports_block_size(block)]
    if rejecting:
        _fail(kv_backend, kv_scenario, "cache_config.block_size", "a block every attention backend supports",
              block, f"block_size {block} is not supported by {', '.join(rejecting)}")  # fmt: skip


def test_padded_state_page_equals_the_attention_page(
    kv_backend: Any, kv_reference: Any, kv_scenario: Scenario
) -> None:
    reference_choice(kv_reference, kv_scenario)  # no config when the engine refuses first
    engine = call_rule(kv_backend, "engine", scenario=kv_scenario)
    padded = engine.config.cache_config.mamba_page_size_padded
    if padded is None:
        raise NotApplicable("no padded state page")
    # a MambaSpec has state shapes (asked of the object: it may live in the backend's own process)
    pages = sorted({int(s.page_size_bytes) for s in engine.specs.values() if not hasattr(s, "shapes")})
    state = sorted({int(s.page_size_bytes) for s in engine.specs.values() if hasattr(s, "shapes")})
    if state != [padded]:
        _fail(kv_backend, kv_scenario, "state pages", [padded], state,
              f"state pages {state} != mamba_page_size_padded {padded}")  # fmt: skip
    if pages != [padded]:
        _fail(kv_backend, kv_scenario, "attention pages", [padded], pages,
              f"attention pages {pages} != the padded state page {padded}")  # fmt: skip
