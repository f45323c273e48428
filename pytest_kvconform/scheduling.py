"""pytest-xdist scheduling by scenario: under ``-n N`` (``--dist load``, xdist's default), every
test of one ``kv_scenario`` runs in the same worker.

A backend's per-scenario work is cached per process: the ``vllm`` backend builds each scenario's
engine (``VllmConfig``, the platform's hooks, the worker, the model's layers on ``meta``) once
and asks every rule of it. Spread test by test, each worker built every engine again; one work
unit per scenario builds it once per run. Tests without a scenario stay units of their own, so
they still balance one by one (xdist's ``LoadScopeScheduling``, largest units first).

xdist's own ``--dist loadgroup`` cannot do this on pytest 9.2: it appends the group to
``item._nodeid``, which pytest no longer reads for the node id.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from xdist.scheduler import LoadScopeScheduling


def scenario_scope(nodeid: str, scenario_ids: Iterable[str]) -> str:
    """The work unit of ``nodeid``: ``kvconform-scenario:<id>`` when its parameters start with a
    scenario id (``test_plan[gemma-4-31b-it]``, ``test_hook[qwen3.5-4b-check_and_update_config]``;
    the longest id wins, so ``-with-draft`` twins stay apart), else the test's own node id."""
    _, bracket, params = nodeid.partition("[")
    params = params.removesuffix("]")
    starts = [sid for sid in scenario_ids if params == sid or params.startswith(sid + "-")] if bracket else []
    return f"kvconform-scenario:{max(starts, key=len)}" if starts else nodeid


class ScenarioScheduling(LoadScopeScheduling):
    """``LoadScopeScheduling`` with one scope per scenario (:func:`scenario_scope`)."""

    def __init__(self, config: Any, log: Any = None, *, scenario_ids: Iterable[str]) -> None:
        super().__init__(config, log)
        self._scenario_ids = tuple(scenario_ids)

    def _split_scope(self, nodeid: str) -> str:
        return scenario_scope(nodeid, self._scenario_ids)
