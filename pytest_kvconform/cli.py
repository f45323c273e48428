"""``kvconform``: plan a scenario from the command line.

kvconform plan granite-4.0-h-tiny --set max_model_len=2048 --json
kvconform list

Exit status: 0 done; 1 the rules reject the scenario (as the engine would refuse to start);
2 an error, printed on one line: a bad scenario, file or ``--set``, a backend that cannot be
resolved, cannot answer this input or raised.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .scenario import RuntimeSettings, ScenarioError, load_scenario, packaged_scenario_names

_RUNTIME_KEYS = tuple(f.name for f in dataclasses.fields(RuntimeSettings))


class CliError(Exception):
    """An error the command reports on one line, with exit status 2."""


def suites_path() -> Path:
    """The conformance suites, the package ``pytest_kvconform.suites`` (in the wheel or a checkout)."""
    return Path(__file__).resolve().parent / "suites"


def _parse_set(item: str) -> tuple[str, object]:
    key, sep, raw = item.partition("=")
    if not sep or key not in _RUNTIME_KEYS:
        raise ScenarioError("--set", item, f"expected KEY=VALUE with KEY one of {', '.join(_RUNTIME_KEYS)}")
    value: object = raw
    if raw.lstrip("-").isdigit():
        value = int(raw)
    elif raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    elif raw.lower() == "none" and key == "num_gpu_blocks_override":
        value = None
    return key, value


def _format_text(plan: dict[str, object]) -> str:
    width = max(len(k) for k in plan)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in plan.items())


def _scenario(args: argparse.Namespace) -> Any:
    scenario = load_scenario(args.scenario)
    if args.settings:
        scenario = scenario.with_runtime(**dict(_parse_set(s) for s in args.settings))
    return scenario


def _backend(args: argparse.Namespace) -> Any:
    from .backends.registry import BackendError, parse_options, resolve_backend

    try:
        return resolve_backend(args.backend, parse_options(args.backend_options))
    except BackendError as exc:
        raise CliError(str(exc)) from None


def _plan(backend: Any, scenario: Any) -> Any:
    """``backend.plan`` under the exception contract: a rejection propagates (exit 1), anything
    else becomes a one-line :class:`CliError`."""
    from .errors import REJECTIONS, RuleNotApplicable

    try:
        return backend.plan(scenario=scenario)
    except RuleNotApplicable as exc:
        raise CliError(f"backend {backend.name!r} cannot answer {scenario.name!r}: {exc}") from None
    except REJECTIONS:
        raise
    except Exception as exc:
        raise CliError(
            f"backend {backend.name!r} raised on {scenario.name!r}: {type(exc).__name__}: {exc}"
        ) from None


def cmd_plan(args: argparse.Namespace) -> int:
    from .errors import REJECTIONS

    scenario = _scenario(args)
    backend = _backend(args)
    try:
        result = _plan(backend, scenario).to_dict()
    except REJECTIONS as exc:  # a valid scenario that vLLM's own rules reject (e.g. a TP split)
        print(f"kvconform: {scenario.name}: rejected: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, sort_keys=True) if args.json else _format_text(result))
    return 0


def _add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="reference", help="backend to plan with (default: reference)")
    p.add_argument("--backend-option", dest="backend_options", action="append", default=[],
                   metavar="KEY=VALUE",
                   help="keyword argument for the backend's constructor; repeatable")  # fmt: skip


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvconform", description="KV-cache sizing reference for vLLM backends"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan one scenario (a packaged name or a TOML path)")
    p.add_argument("scenario")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="override a [runtime] setting; repeatable")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_backend_args(p)
    p.set_defaults(run=cmd_plan)
    sub.add_parser("list", help="list the packaged scenarios").set_defaults(
        run=lambda args: print("\n".join(packaged_scenario_names())) or 0
    )
    sub.add_parser(
        "suites", help="print the folder of the shipped conformance suites (for pytest)"
    ).set_defaults(run=lambda args: print(suites_path()) or 0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.run(args))
    except ScenarioError as exc:
        print(f"kvconform: bad scenario: {exc}", file=sys.stderr)
    except CliError as exc:
        print(f"kvconform: {exc}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
