"""``kvconform``: plan a scenario from the command line.

kvconform plan granite-4.0-h-tiny --set max_model_len=2048 --json
kvconform check --backend metal [SCENARIO|FILE|DIR ...] [--json] [--report PATH]
kvconform explain granite-4.0-h-tiny [--backend X] [--svg block.svg]
kvconform list

Exit status: 0 done (``check``: no departure); 1 the rules reject the scenario (as the engine
would refuse to start), or ``check``/``explain --backend`` found a departure; 2 an error,
printed on one line: a bad scenario, file or ``--set``, a backend that cannot be resolved,
cannot answer this input or raised.
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


def _release(args: argparse.Namespace) -> tuple[Any, str]:
    from .session import selected_release

    try:
        return selected_release(args.vllm or "")
    except ValueError as exc:
        raise CliError(f"--vllm: {exc}") from None


def _judged(args: argparse.Namespace) -> tuple[Any, Any, tuple[Any, str]]:
    """The backend under check and the reference, both with the selected release's rules."""
    from .backends.base import ReferenceBackend
    from .reference.rules import ReferenceRules

    release = _release(args)
    backend, reference = _backend(args), ReferenceBackend()
    for rules in (backend, reference):
        if isinstance(rules, ReferenceRules):
            rules.release = release[0]
    return backend, reference, release


def _scenarios(items: Sequence[str]) -> list[Any]:
    """Packaged scenarios when ``items`` is empty; else each name or file, and every ``*.toml`` of
    each folder."""
    if not items:
        return [load_scenario(n) for n in packaged_scenario_names()]
    found = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            files = sorted(path.glob("*.toml"))
            if not files:
                raise CliError(f"{item}: no *.toml scenario files in this folder")
            found += [load_scenario(f) for f in files]
        else:
            found.append(load_scenario(item))
    return found


def _departure_line(record: dict[str, Any]) -> str:
    """One line per non-passing record: outcome, scenario, rule, then the first differing field
    with both values, or the message (skip or xfail reason, failure)."""
    diff = record["difference"]
    what = (f"{diff['field']}: reference {diff['reference']}, backend {diff['backend']}"
            if diff and record["outcome"] == "failed" else record["message"])  # fmt: skip
    return f"{record['outcome'].upper():<9} {record['scenario']} [{record['rule']}] {what}"


def cmd_check(args: argparse.Namespace) -> int:
    from .backends.registry import BackendError, parse_options
    from .checks import run_checks
    from .conformance import load_xfails
    from .report import format_matrix, matrix_of, report_document, write_report

    scenarios = _scenarios(args.scenarios)
    backend, reference, (release, selected_by) = _judged(args)
    xfails: dict[str, str] = {}
    if args.xfails:
        try:
            xfails = load_xfails(Path(args.xfails), backend.name)
        except ValueError as exc:
            raise CliError(f"--xfails: {exc}") from None
    records = run_checks(backend, reference, scenarios, xfails)
    try:
        options = parse_options(args.backend_options)
    except BackendError as exc:  # already resolved above; kept for the type checker
        raise CliError(str(exc)) from None
    document = report_document(
        backend, matrix_of(records), records=records, options=options, producer="kvconform check",
        reference={"vllm_release": release.release, "selected_by": selected_by},
    )  # fmt: skip
    if args.report:
        try:
            write_report(Path(args.report), document)
        except OSError as exc:
            raise CliError(f"--report: {args.report}: {exc.strerror or exc}") from None
    failed = [r for r in records if r["outcome"] == "failed"]
    if args.json:
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        for record in records:
            if record["outcome"] != "passed":
                print(_departure_line(record))
        print("\n".join(format_matrix(matrix_of(records))))
        print(f"kvconform check: backend {backend.name} ({backend.version}), {len(scenarios)} scenarios, "
              f"reference vLLM {release.release} rules: {len(failed)} failed")  # fmt: skip
    return 1 if failed else 0


def _trace(rules: Any, scenario: Any) -> Any:
    """The trace of ``rules``'s plan of ``scenario``; a rejection propagates (exit 1), anything else
    is a one-line :class:`CliError`."""
    from .errors import REJECTIONS, RuleError, RuleNotApplicable

    try:
        return rules.trace(scenario)
    except REJECTIONS:
        raise
    except (RuleError, RuleNotApplicable) as exc:
        raise CliError(str(exc)) from None


def cmd_explain(args: argparse.Namespace) -> int:
    from .errors import REJECTIONS
    from .explain import block_svg, compare_traces, format_trace

    scenario = load_scenario(args.scenario)
    backend, reference, _ = _judged(args)
    try:
        trace = _trace(reference, scenario)
    except REJECTIONS as exc:
        print(f"kvconform: {scenario.name}: rejected: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.svg:
        try:
            svg = block_svg(trace)
        except ValueError as exc:
            raise CliError(f"--svg: {exc}") from None
        try:
            Path(args.svg).write_text(svg, encoding="utf-8")
        except OSError as exc:
            raise CliError(f"--svg: {args.svg}: {exc.strerror or exc}") from None
    print(f"{scenario.name} ({scenario.source}), reference vLLM {reference.release.release} rules")
    print(format_trace(trace))
    if args.backend == "reference" and not args.backend_options:
        return 0
    if not callable(getattr(backend, "trace", None)):
        raise CliError(f"backend {backend.name!r} plans on its own (no trace of steps to compare)")
    try:
        theirs = _trace(backend, scenario)
    except REJECTIONS as exc:
        print(
            f"backend {backend.name} ({backend.version}) rejects {scenario.name}: {type(exc).__name__}: {exc}"
        )
        return 1
    lines, first = compare_traces(trace, theirs)
    print(f"\nbackend {backend.name} ({backend.version}), step by step:")
    print("\n".join(lines))
    if first is None:
        print(f"backend {backend.name}: no departure")
        return 0
    print(f"backend {backend.name} departs first at step {first} ({trace.steps[first - 1].title})")
    return 1


def _add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="reference", help="backend to plan with (default: reference)")
    p.add_argument("--backend-option", dest="backend_options", action="append", default=[],
                   metavar="KEY=VALUE",
                   help="keyword argument for the backend's constructor; repeatable")  # fmt: skip
    p.add_argument("--vllm", metavar="RELEASE", default=None,
                   help="judge by this vLLM release's rules (default: the installed vLLM's, else "
                        "the newest)")  # fmt: skip


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
    p = sub.add_parser("check", help="compare a backend with the reference, per scenario and rule family")
    p.add_argument(
        "scenarios",
        nargs="*",
        metavar="SCENARIO",
        help="packaged scenario names, TOML files or folders of *.toml (default: all packaged)",
    )
    p.add_argument("--json", action="store_true", help="print the report document (kvconform-report/1)")
    p.add_argument("--report", metavar="PATH", help="also write the report: PATH.json, else Markdown")
    p.add_argument("--xfails", metavar="PATH", help="TOML file of known failures, as --kvconform-xfails")
    _add_backend_args(p)
    p.set_defaults(run=cmd_check)
    p = sub.add_parser("explain", help="the derivation of one scenario, step by step")
    p.add_argument("scenario")
    p.add_argument("--svg", metavar="FILE", help="draw one pool block (pages and padding) of a hybrid")
    _add_backend_args(p)
    p.set_defaults(run=cmd_explain)
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
