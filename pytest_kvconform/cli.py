"""``kvconform``: plan a scenario from the command line.

kvconform plan granite-4.0-h-tiny --set max_model_len=2048 --json
kvconform list
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from .scenario import RuntimeSettings, ScenarioError, load_scenario, packaged_scenario_names

_RUNTIME_KEYS = tuple(f.name for f in dataclasses.fields(RuntimeSettings))


def suites_path() -> Path:
    """The conformance suites: inside the installed wheel, or beside the package in a checkout."""
    packaged = Path(__file__).parent / "suites"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[1] / "suites"


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvconform", description="KV-cache sizing reference for vLLM backends"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan one scenario (a packaged name or a TOML path)")
    p.add_argument("scenario")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="override a [runtime] setting; repeatable")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--backend", default="reference", help="backend to plan with (default: reference)")
    sub.add_parser("list", help="list the packaged scenarios")
    sub.add_parser("suites", help="print the folder of the shipped conformance suites (for pytest)")
    args = parser.parse_args(argv)

    if args.command == "list":
        print("\n".join(packaged_scenario_names()))
        return 0
    if args.command == "suites":
        print(suites_path())
        return 0
    try:
        scenario = load_scenario(args.scenario)
        if args.settings:
            scenario = scenario.with_runtime(**dict(_parse_set(s) for s in args.settings))
        from .backends.registry import BackendError, resolve_backend

        try:
            backend = resolve_backend(args.backend)
        except BackendError as exc:
            print(f"kvconform: {exc}", file=sys.stderr)
            return 2
        result = backend.plan(scenario).to_dict()
    except ScenarioError as exc:
        print(f"kvconform: bad scenario: {exc}", file=sys.stderr)
        return 2
    except (ValueError, NotImplementedError, AssertionError) as exc:
        # A valid scenario that vLLM's own rules reject (e.g. an indivisible TP split).
        print(f"kvconform: {scenario.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, sort_keys=True) if args.json else _format_text(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
