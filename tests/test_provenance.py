"""Who answered: decided by behaviour (:mod:`pytest_kvconform.provenance`), never by whether a
method is redefined.

A backend whose overrides only return ``super()``'s answer is inherited everywhere; a branch that
hands back the reference's answer is inherited for that input only; code of the backend's own
that builds an equal answer is the backend's. The suite's rule x outcome table, the JSON report
and ``kvconform check`` all say so.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from pytest_kvconform import provenance
from pytest_kvconform.backends.base import RULE_FAMILIES, ReferenceBackend
from pytest_kvconform.checks import run_checks
from pytest_kvconform.cli import main
from pytest_kvconform.scenario import load_scenario, packaged_scenario_names

RULES_SUITE = str(
    Path(__file__).resolve().parents[1] / "pytest_kvconform" / "suites" / "test_kvconform_rules.py"
)
GRANITE, GEMMA = "granite-4.0-h-tiny", "gemma-3-27b-it"
#: rule methods a plan or a per-rule test asks a backend for
ASKED = sorted({m for f, ms in RULE_FAMILIES.items() if f not in ("plan", "platform") for m in ms}
               | {"check_and_update_config"})  # fmt: skip


def _super_only(name: str) -> Any:
    """``def name(self, *a, **k): return super().name(*a, **k)``"""

    def override(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(super(type(self), self), name)(*args, **kwargs)

    override.__name__ = name
    return override


class SuperOnly(ReferenceBackend):
    """Every rule overridden, every override only calls ``super()``."""

    name = "super-only"


for _method in ASKED:
    setattr(SuperOnly, _method, _super_only(_method))

SUPER_ONLY_MODULE = f"""
from pytest_kvconform.backends.base import ReferenceBackend

class SuperOnly(ReferenceBackend):
    name = "super-only"

{"".join(f"    def {m}(self, *a, **k):{chr(10)}        return super().{m}(*a, **k){chr(10)}" for m in ASKED)}
"""


def _by(backend: Any, method: str, *args: Any, **kwargs: Any) -> str:
    return provenance.ask(backend, method, *args, **kwargs).by


def test_the_reference_itself_answers_as_its_own_code() -> None:
    scenario = load_scenario(GRANITE)
    assert _by(ReferenceBackend(), "layer_specs", scenario=scenario) == "backend"


def test_a_super_only_override_is_inherited() -> None:
    scenario = load_scenario(GRANITE)
    specs = ReferenceBackend().layer_specs(scenario=scenario)
    assert _by(SuperOnly(), "layer_specs", scenario=scenario) == "inherited"
    assert _by(SuperOnly(), "check_memory", specs, scenario=scenario) == "inherited"
    assert _by(SuperOnly(), "kernel_block_size", 400) == "inherited"  # 16: a small int, by equality


def test_an_equal_answer_built_by_the_backend_is_its_own() -> None:
    """A new dict of the same specs, a replaced MemoryCheck, a kernel block of its own table."""

    class Own(ReferenceBackend):
        name = "own"

        def layer_specs(self, scenario: Any) -> Any:
            return dict(super().layer_specs(scenario))

        def check_memory(self, specs: Any, scenario: Any) -> Any:
            return dataclasses.replace(super().check_memory(specs, scenario))

        def kernel_block_size(self, block_size: int, scenario: Any = None) -> int:
            return next(k for k in (32, 16, 8) if block_size % k == 0)

    scenario = load_scenario(GRANITE)
    specs = ReferenceBackend().layer_specs(scenario=scenario)
    assert _by(Own(), "layer_specs", scenario=scenario) == "backend"
    assert _by(Own(), "check_memory", specs, scenario=scenario) == "backend"
    assert _by(Own(), "kernel_block_size", 400) == "backend"


def test_a_branch_that_hands_back_the_references_answer_is_inherited_for_that_input() -> None:
    """vllm-metal's check_memory keeps vLLM's layout for sliding-window models (PR #563) and sizes
    its own pool otherwise: Gemma 3 is inherited, Granite the backend's own."""
    pytest.importorskip("mlx.core")
    from pytest_kvconform.backends.metal import MetalBackend

    for name, by in ((GEMMA, "inherited"), ("qwen2.5-3b-instruct-tp4", "backend")):
        scenario = load_scenario(name)
        specs = ReferenceBackend().layer_specs(scenario=scenario)
        assert _by(MetalBackend(), "check_memory", specs, scenario=scenario) == by, name


def test_a_rejection_is_whoever_raised_it() -> None:
    class Rejects(ReferenceBackend):
        name = "rejects"

        def kernel_block_size(self, block_size: int, scenario: Any = None) -> int:
            if block_size == 7:
                return super().kernel_block_size(block_size)  # the reference raises ValueError
            raise ValueError("the toy kernel takes no such block")

    assert provenance.ask(Rejects(), "kernel_block_size", 7).by == "inherited"
    assert provenance.ask(Rejects(), "kernel_block_size", 400).by == "backend"
    assert isinstance(provenance.ask(Rejects(), "kernel_block_size", 7).error, ValueError)


def test_a_profiler_already_installed_is_put_back() -> None:
    import sys

    def mine(frame: Any, event: str, arg: Any) -> None:
        return None

    sys.setprofile(mine)
    try:
        provenance.ask(SuperOnly(), "kernel_block_size", 400)
        assert sys.getprofile() is mine
    finally:
        sys.setprofile(None)


def test_a_super_only_backend_has_nothing_agreed_in_kvconform_check() -> None:
    scenarios = [load_scenario(n) for n in packaged_scenario_names()]
    records = run_checks(SuperOnly(), ReferenceBackend(), scenarios)
    verdicts = {r["verdict"] for r in records}
    assert "agreed" not in verdicts and "inherited" in verdicts
    assert all(r["answers"].get("own", 0) == 0 for r in records)
    # the reference checked against itself runs only its independent checks ([expect]): agreed
    assert {r["verdict"] for r in run_checks(ReferenceBackend(), ReferenceBackend(), scenarios[:3])} <= {
        "agreed",
        "n/a",
    }


def test_a_super_only_backend_shows_0_agreed_in_the_suite(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(superonly=SUPER_ONLY_MODULE)
    pytester.syspathinsert()
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        RULES_SUITE, "--kvconform-backend=superonly:SuperOnly",
        "-k", "(granite-4.0-h-tiny and not hma-disabled and not mamba-all) or kernel_block",
        f"--kvconform-report={report}", "-p", "no:cacheprovider",
    )  # fmt: skip
    assert result.ret == 0, result.stdout.str()
    document = json.loads(report.read_text())
    assert document["totals"]["agreed"] == 0
    assert document["totals"]["inherited"] > 20
    assert all(a["own"] == 0 for a in document["answers"].values())
    assert document["answers"]["layer_specs"]["inherited"] > 0
    result.stdout.fnmatch_lines(["*the backend's answers, by whose code gave them:*", "*layer_specs*0 own*"])


def test_kvconform_check_reports_inherited(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    module = tmp_path / "superonly_cli.py"
    module.write_text(SUPER_ONLY_MODULE, encoding="utf-8")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        code = main(["check", GRANITE, "--backend", "superonly_cli:SuperOnly", "--json"])
    finally:
        sys.path.remove(str(tmp_path))
    document = json.loads(capsys.readouterr().out)
    assert code == 0
    assert document["totals"]["agreed"] == 0 and document["totals"]["inherited"] > 0


def test_explain_shows_each_steps_provenance(capsys: pytest.CaptureFixture[str]) -> None:
    """Metal: the pool, one-sequence estimate, kernel block and allocation are its own; the specs,
    groups and admission text come from vLLM core (inherited)."""
    pytest.importorskip("mlx.core")
    assert main(["explain", GRANITE, "--backend", "metal"]) == 0
    out = capsys.readouterr().out.split("step by step:")[1]
    lines = {line.split(".", 1)[1].split()[0:2][0]: line for line in out.splitlines() if ". " in line[:5]}
    assert "inherited" in lines["layer"] and "inherited" in lines["groups"]
    assert "own code" in lines["kernel"] and "own code" in lines["one-sequence"]
    assert "own code" in lines["pool"] and "own code" in lines["allocation"]


def test_explain_backend_names_the_first_departing_step(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    module = tmp_path / "wrongstate.py"
    module.write_text(
        "from pytest_kvconform.backends.base import ReferenceBackend\n"
        "class WrongState(ReferenceBackend):\n"
        "    name = 'wrong-state'\n"
        "    def state_page_bytes(self, spec, scenario):\n"
        "        return spec.page_size_bytes + 1\n",
        encoding="utf-8",
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        code = main(["explain", GRANITE, "--backend", "wrongstate:WrongState"])
    finally:
        sys.path.remove(str(tmp_path))
    out = capsys.readouterr().out
    assert code == 1
    assert "departs first at step 7 (state page)" in out
    assert "DEPARTS: value: reference 806400, backend 806401" in out
