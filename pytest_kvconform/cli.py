"""``kvconform``: plan a scenario from the command line.

kvconform plan granite-4.0-h-tiny --set max_model_len=2048 [--vllm 0.29] --json
kvconform plan path/to/config.json --block-size 400 [vllm serve's sizing options]
kvconform scenario path/to/model-dir [vllm serve's sizing options] > model.toml
kvconform check --backend metal [SCENARIO|FILE|DIR ...] [--vllm RELEASE] [--json] [--report PATH]
kvconform explain granite-4.0-h-tiny [--backend X] [--vllm RELEASE] [--svg block.svg]
kvconform diff granite-4.0-h-tiny --vllm 0.27 --vllm 0.33 [--set KEY=VALUE] [--json]
kvconform list

Wherever a scenario is taken, a model's config.json (or the directory holding it) is too, read
offline (:mod:`.hf_config`); ``vllm serve``'s sizing options (``--block-size``, ``--kv-cache-dtype``,
``--max-model-len``, ...) set the runtime of either, ``--set KEY=VALUE`` any ``[runtime]`` key.

``--vllm RELEASE``: the vLLM release whose rules the reference (and a backend built on it)
applies; default: the installed vLLM's release, else the newest. ``diff`` plans with the
reference's rules of both releases and names, per changed field, the sizing changes of
``reference.releases.CHANGES`` between them that move it.

Exit status: 0 done (``check``: no departure; ``diff``: whatever changed); 1 the rules reject the
scenario (as the engine would refuse to start), or ``check``/``explain --backend`` found a
departure; 2 an error, printed on one line: a bad scenario, file, ``--set`` or ``--vllm``, a
backend that cannot be resolved, cannot answer this input or raised.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .backends.registry import with_release
from .hf_config import add_serve_args, parsed_serve_settings
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

    def lines(k: str, v: object) -> list[str]:
        if k == "engine_defaults":  # one line per default applied, the key on the first
            assert isinstance(v, list)
            return [f"{k if i == 0 else '':<{width}}  {item}" for i, item in enumerate(v)] or [
                f"{k:<{width}}  none: the scenario states every such setting"
            ]
        return [f"{k:<{width}}  {v}"]

    return "\n".join(line for k, v in plan.items() for line in lines(k, v))


def _serve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The values of the ``vllm serve`` options given (:func:`~.hf_config.add_serve_args`)."""
    return parsed_serve_settings(args)


def _load(item: str, args: argparse.Namespace) -> Any:
    """A packaged name, a scenario TOML, or a config.json (or its model directory), with the
    ``vllm serve`` options given."""
    from .hf_config import is_config_path, load_config_scenario

    runtime = _serve_settings(args)
    if is_config_path(item):
        return load_config_scenario(item, runtime)
    scenario = load_scenario(item)
    if runtime.pop("dtype", None) is not None:
        raise CliError(f"{item}: --dtype applies to a config.json; a scenario states its [model] dtype")
    if "max_concurrent_batches" in runtime and "pipeline_parallel_size" not in runtime:  # the file's stages
        pp = scenario.runtime.pipeline_parallel_size
        runtime["max_concurrent_batches"] = pp + 1 if args.serve_async_scheduling else pp
    return scenario.with_runtime(**runtime) if runtime else scenario


def _scenario(args: argparse.Namespace) -> Any:
    scenario = _load(args.scenario, args)
    if args.settings:
        scenario = scenario.with_runtime(**dict(_parse_set(s) for s in args.settings))
    return scenario


def _backend(args: argparse.Namespace) -> Any:
    from .backends.registry import BackendError, parse_options, resolve_backend

    try:
        return resolve_backend(args.backend, parse_options(args.backend_options))
    except BackendError as exc:
        raise CliError(str(exc)) from None


def _plan(backend: Any, scenario: Any, method: str = "plan") -> Any:
    """``backend.plan`` (or ``method``) under the exception contract: a rejection (a refusal of a
    :data:`~pytest_kvconform.rejections.KINDS` kind) propagates (exit 1); an offline gap or
    anything else raised is a one-line :class:`CliError` (exit 2)."""
    from .gaps import OfflineGap
    from .rejections import rejection_kind
    from .verdict import summary

    try:
        return getattr(backend, method)(scenario=scenario)
    except OfflineGap as exc:
        raise CliError(f"backend {backend.name!r} cannot run {scenario.name!r} here: {exc}") from None
    except Exception as exc:
        if rejection_kind(exc) is not None:
            raise
        raise CliError(f"backend {backend.name!r} raised on {scenario.name!r}: {summary(exc)}") from None


def refusal(exc: BaseException) -> str:
    """``Type: message`` of an engine's refusal on one line (pydantic's validation errors, which
    vLLM's configs raise, span several)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def cmd_plan(args: argparse.Namespace) -> int:
    from .errors import REJECTIONS

    scenario = _scenario(args)
    release = _release(args)[0]
    backend = with_release(_backend(args), release)
    try:
        result = _plan_with_settings(backend, scenario, release)
    except REJECTIONS as exc:  # a valid scenario that vLLM's own rules reject (e.g. a TP split)
        print(f"kvconform: {scenario.name}: rejected: {refusal(exc)}", file=sys.stderr)
        return 1
    print(json.dumps(result, sort_keys=True) if args.json else _format_text(result))
    return 0


def _plan_with_settings(backend: Any, scenario: Any, release: Any) -> dict[str, Any]:
    """The plan's fields, then the settings the engine's defaults decide as the plan used them
    (after the platform's hook) and the defaults applied to what the file leaves unset, each
    naming its vLLM function (``reference.defaults``; docs/engine-defaults.md). A backend that
    composes its plan reports its own trace; another is shown the reference's defaults."""
    from .provenance import composes_plan
    from .reference.defaults import engine_defaults

    if composes_plan(backend) and callable(getattr(backend, "trace", None)):
        trace = _plan(backend, scenario, "trace")
        plan, planned = trace.plan, trace.scenario
        configured = trace.step("platform config")
        if configured is not None and configured.value is not None:
            planned = dataclasses.replace(configured.value, defaults_applied=planned.defaults_applied)
    else:
        plan, planned = _plan(backend, scenario), engine_defaults(scenario, release)[0]
    rt = planned.runtime
    return {**plan.to_dict(), "mamba_cache_mode": rt.mamba_cache_mode,
            "max_concurrent_batches": rt.max_concurrent_batches,
            "engine_defaults": list(planned.defaults_applied)}  # fmt: skip


def _release(args: argparse.Namespace) -> tuple[Any, str]:
    """``--vllm``'s rule set (default: the installed vLLM's release, else the newest) and why."""
    from .session import selected_release

    try:
        return selected_release(args.vllm or "")
    except ValueError as exc:
        raise _bad_release(exc) from None


def _bad_release(exc: ValueError) -> CliError:
    """``--vllm``'s one-line error, naming the releases that have a rule set."""
    from .reference.releases import RELEASES

    known = "" if "known releases" in str(exc) else f"; known releases {', '.join(RELEASES)}"
    return CliError(f"--vllm: {exc}{known}")


def _judged(args: argparse.Namespace) -> tuple[Any, Any, tuple[Any, str]]:
    """The backend under check and the reference, both with the selected release's rules."""
    from .backends.base import ReferenceBackend

    release = _release(args)
    backend = with_release(_backend(args), release[0])
    return backend, with_release(ReferenceBackend(), release[0]), release


def _scenarios(items: Sequence[str], args: argparse.Namespace) -> list[Any]:
    """Packaged scenarios when ``items`` is empty; else each name, file or model directory, and
    every ``*.toml`` and model directory of another folder (:func:`~.hf_config.scenario_files`);
    each with the ``vllm serve`` options given."""
    from .hf_config import scenario_files

    if not items:
        return [_load(n, args) for n in packaged_scenario_names()]
    found = []
    for item in items:
        files = scenario_files(item)  # a packaged name too: not a folder, so itself
        if not files:
            raise CliError(f"{item}: no *.toml scenario files nor a config.json in this folder")
        found += [_load(str(f), args) for f in files]
    return found


def _departure_line(record: dict[str, Any]) -> str:
    """One line per record that did not agree: its verdict, scenario, rule, then the first
    differing field with both values, or the message (the reason, the crash)."""
    diff = record["difference"]
    what = (f"{diff['field']}: reference {diff['reference']}, backend {diff['backend']}"
            if diff and record["outcome"] == "failed" else record["message"])  # fmt: skip
    verdict = record["verdict"] + (" (failed)" if record["outcome"] == "failed" and record["verdict"] not in (
        "departed", "crashed") else "")  # fmt: skip
    return f"{verdict.upper():<9} {record['scenario']} [{record['rule']}] {what}"


def cmd_check(args: argparse.Namespace) -> int:
    from .backends.registry import BackendError, parse_options
    from .checks import run_checks
    from .conformance import load_xfails
    from .provenance import is_oracle
    from .report import format_matrix, matrix_of, report_document, write_report

    scenarios = _scenarios(args.scenarios, args)
    backend, reference, (release, selected_by) = _judged(args)
    xfails: list[Any] = []
    if args.xfails:
        try:
            xfails = load_xfails(Path(args.xfails), backend.name)
        except ValueError as exc:
            raise CliError(f"--xfails: {exc}") from None
    records = run_checks(backend, reference, scenarios, xfails, strict=args.strict)
    try:
        options = parse_options(args.backend_options)
    except BackendError as exc:  # already resolved above; kept for the type checker
        raise CliError(str(exc)) from None
    document = report_document(
        backend, records, options=options, producer="kvconform check",
        reference={"vllm_release": release.release, "selected_by": selected_by},
        mode="self-check" if is_oracle(backend) else "conformance",
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
            if record["verdict"] != "agreed":
                print(_departure_line(record))
        print("\n".join(format_matrix(matrix_of(records))))
        print(f"kvconform check: backend {backend.name} ({backend.version}), {len(scenarios)} scenarios, "
              f"reference vLLM {release.release} rules: {len(failed)} failed")  # fmt: skip
    return 1 if failed else 0


def _trace(rules: Any, scenario: Any) -> Any:
    """The trace of ``rules``'s plan of ``scenario``; a rejection propagates (exit 1), anything else
    is a one-line :class:`CliError`."""
    from .errors import RuleError
    from .gaps import OfflineGap
    from .rejections import rejection_kind
    from .verdict import summary

    try:
        return rules.trace(scenario)
    except (RuleError, OfflineGap) as exc:
        raise CliError(str(exc)) from None
    except Exception as exc:
        if rejection_kind(exc) is not None:
            raise
        raise CliError(f"{summary(exc)}") from None


def cmd_explain(args: argparse.Namespace) -> int:
    from .errors import REJECTIONS
    from .explain import block_svg, compare_traces, format_trace

    scenario = _load(args.scenario, args)
    backend, reference, _ = _judged(args)
    try:
        trace = _trace(reference, scenario)
    except REJECTIONS as exc:
        print(f"kvconform: {scenario.name}: rejected: {refusal(exc)}", file=sys.stderr)
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


def _plan_values(rules: Any, scenario: Any) -> dict[str, Any]:
    """The plan's fields as ``kvconform plan --json`` prints them, after ``"plan": "accepted"``;
    a rejection (the engine would refuse to start) is ``{"plan": "rejected: Type: message"}``."""
    from .errors import REJECTIONS

    try:
        return {"plan": "accepted", **_plan(rules, scenario).to_dict()}
    except REJECTIONS as exc:
        return {"plan": f"rejected: {refusal(exc)}"}


def _changed(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The fields that differ: ``plan`` alone when either side is rejected."""
    if a["plan"] != "accepted" or b["plan"] != "accepted":
        return ["plan"] if a["plan"] != b["plan"] else []
    return [k for k in a if a[k] != b.get(k)]


def _diff_document(scenario: Any, old: Any, new: Any) -> dict[str, Any]:
    """The plans of ``scenario`` under rule sets ``old`` and ``new`` and, per changed field, the
    changes between them that move it: those that move it alone, added to ``old`` or left out of
    ``new`` (the second catches a field only a combination moves: each change of it is named)."""
    from .backends.base import ReferenceBackend
    from .checks import scenario_id
    from .reference.releases import CHANGES

    def values(rules: Any) -> dict[str, Any]:
        return _plan_values(with_release(ReferenceBackend(), rules), scenario)

    between = sorted((c for c in CHANGES if old.has(c.name) != new.has(c.name)),
                     key=lambda c: tuple(int(x) for x in c.since.split(".")))  # fmt: skip
    a, b = values(old), values(new)
    fields = _changed(a, b)
    # accepted at one release, rejected at the other: what moves "plan" is what flips that (a
    # rejection's text may name values other changes move)
    flips = (a["plan"] == "accepted") != (b["plan"] == "accepted")

    def seen(plan: dict[str, Any], field: str) -> Any:
        return plan["plan"] == "accepted" if flips else plan.get(field)

    moves: dict[str, set[str]] = {}
    for change in between if fields else ():
        moved = set()
        for base, plan in ((old, a), (new, b)):
            toggled = values(base.toggled(change.name))
            moved |= {f for f in fields if f in toggled and seen(toggled, f) != seen(plan, f)}
        moves[change.name] = moved
    changes = [
        {"field": f, "from": a[f], "to": b[f],
         "causes": [{"name": c.name, "since": c.since, "where": c.where} for c in between
                    if f in moves[c.name]]}
        for f in fields
    ]  # fmt: skip
    return {"scenario": scenario_id(scenario), "from": old.release, "to": new.release, "changes": changes,
            "considered": [c.name for c in between]}  # fmt: skip


def _cell(value: Any) -> str:
    """A value on one line: the first line of a many-line rejection, then ``...``."""
    lines = str(value).splitlines() or [""]
    return lines[0] + (" ..." if len(lines) > 1 else "")


def _diff_text(doc: dict[str, Any]) -> list[str]:
    """The aligned table of :func:`_diff_document`, then each cause named once with its rule."""
    from .reference.releases import CHANGES

    head = f"{doc['scenario']}: reference plan, vLLM {doc['from']} -> {doc['to']} rules"
    considered = ", ".join(doc["considered"]) or "none"
    if not doc["changes"]:
        return [f"{head}: no change (sizing changes between them: {considered})"]
    rows = [("field", f"vLLM {doc['from']}", f"vLLM {doc['to']}", "moved by")] + [
        (c["field"], _cell(c["from"]), _cell(c["to"]),
         ", ".join(x["name"] for x in c["causes"])
         or f"no single change explains it (sizing changes between them: {considered})")
        for c in doc["changes"]
    ]  # fmt: skip
    widths = [min(max(len(r[i]) for r in rows), 40) for i in range(3)]
    count = len(doc["changes"])
    lines = [f"{head}: {count} field{'s' if count > 1 else ''} changed"]
    lines += ["  ".join(f"{cell:<{w}}" for cell, w in zip(r[:3], widths, strict=True)) + f"  {r[3]}"
              for r in rows]  # fmt: skip
    by_name = {c.name: c for c in CHANGES}
    named = {x["name"] for c in doc["changes"] for x in c["causes"]}
    for change in (by_name[name] for name in doc["considered"] if name in named):
        lines += [f"{change.name} (vLLM {change.since}): {change.where}", f"  {change.rule}"]
    return lines


def _rule_sets(args: argparse.Namespace) -> tuple[Any, Any]:
    """``diff``'s two ``--vllm`` rule sets: the release moved from, the one moved to."""
    from .reference.releases import RELEASES, rule_set

    if len(args.vllm) != 2:
        raise CliError(
            f"--vllm: give it twice, the release to move from and the one to move to (known releases "
            f"{', '.join(RELEASES)})"
        )
    try:
        old, new = (rule_set(v) for v in args.vllm)
    except ValueError as exc:
        raise _bad_release(exc) from None
    return old, new


def cmd_diff(args: argparse.Namespace) -> int:
    """The scenario's plan under two releases' rules; exit 0 whatever changed."""
    old, new = _rule_sets(args)
    document = _diff_document(_scenario(args), old, new)
    print(json.dumps(document, indent=2) if args.json else "\n".join(_diff_text(document)))
    return 0


def cmd_scenario(args: argparse.Namespace) -> int:
    """Print the ``kv-scenario/1`` TOML of a config.json (or model directory)."""
    from .hf_config import scenario_toml

    print(scenario_toml(args.path, _serve_settings(args), args.name), end="")
    return 0


def _add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="reference", help="backend to plan with (default: reference)")
    p.add_argument("--backend-option", dest="backend_options", action="append", default=[],
                   metavar="KEY=VALUE",
                   help="keyword argument for the backend's constructor; repeatable")  # fmt: skip
    p.add_argument("--vllm", metavar="RELEASE", default=None,
                   help="the vLLM release whose rules the reference (and a backend built on it) "
                        "applies (default: the installed vLLM's, else the newest)")  # fmt: skip


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvconform", description="KV-cache sizing reference for vLLM backends"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan one scenario (a packaged name, a TOML path or a config.json)")
    p.add_argument("scenario")
    add_serve_args(p)
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
        help="packaged scenario names, TOML files, config.json files, model directories or folders of "
        "*.toml (default: all packaged)",
    )
    add_serve_args(p)
    p.add_argument("--json", action="store_true", help="print the report document (kvconform-report/2)")
    p.add_argument("--report", metavar="PATH", help="also write the report: PATH.json, else Markdown")
    p.add_argument("--xfails", metavar="PATH", help="TOML file of known departures, as --kvconform-xfails")
    p.add_argument(
        "--strict",
        action="store_true",
        help="fail an inherited check of a family the backend does not declare, as --kvconform-strict",
    )
    _add_backend_args(p)
    p.set_defaults(run=cmd_check)
    p = sub.add_parser("explain", help="the derivation of one scenario, step by step")
    p.add_argument("scenario")
    add_serve_args(p)
    p.add_argument("--svg", metavar="FILE", help="draw one pool block (pages and padding) of a hybrid")
    _add_backend_args(p)
    p.set_defaults(run=cmd_explain)
    p = sub.add_parser("diff", help="a scenario's plan under one vLLM release's rules and another's")
    p.add_argument("scenario")
    add_serve_args(p)
    p.add_argument("--vllm", metavar="RELEASE", action="append", default=[],
                   help="give it twice: the release to move from, then the one to move to")  # fmt: skip
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="override a [runtime] setting; repeatable")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(run=cmd_diff)
    p = sub.add_parser("scenario", help="print the kv-scenario/1 TOML of a model's config.json (offline)")
    p.add_argument("path", help="a config.json, or the model directory holding it")
    p.add_argument("--name", help="the scenario's name (default: the directory's name)")
    add_serve_args(p)
    p.set_defaults(run=cmd_scenario)
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
    except BrokenPipeError:  # the reader stopped early (``kvconform plan ... | head``)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
