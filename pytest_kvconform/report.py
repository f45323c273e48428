"""The conformance matrix: rule family x outcome, for the terminal, JSON and Markdown."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: test outcomes, then the generated (hypothesis) inputs compared and discarded
OUTCOMES = ("passed", "inherited", "failed", "skipped", "xfailed", "generated", "discarded")


def _rows(matrix: Mapping[str, Counter[str]]) -> list[tuple[str, list[int]]]:
    from .backends.base import RULE_FAMILIES

    order = [r for r in RULE_FAMILIES if r in matrix] + sorted(set(matrix) - set(RULE_FAMILIES))
    return [(rule, [matrix[rule][o] for o in OUTCOMES]) for rule in order]


def format_matrix(matrix: Mapping[str, Counter[str]]) -> list[str]:
    rows = _rows(matrix)
    width = max([len("rule family"), *(len(r) for r, _ in rows)])
    lines = [f"{'rule family':<{width}} " + " ".join(f"{o:>8}" for o in OUTCOMES)]
    lines += [f"{rule:<{width}} " + " ".join(f"{n:>8}" for n in counts) for rule, counts in rows]
    totals = [sum(c[i] for _, c in rows) for i in range(len(OUTCOMES))]
    lines.append(f"{'total':<{width}} " + " ".join(f"{n:>8}" for n in totals))
    return lines


def format_exercised(exercised: Mapping[str, Counter[str]]) -> list[str]:
    """One line per rule a generated input can reach: how many compared inputs of each
    property test (rule family) reached it; 0 shows a strategy that stopped reaching it."""
    from .strategies import EXERCISABLE_RULES

    families = [f for f in _rows(exercised) if any(exercised[f[0]].values())]
    names = [rule for rule, _ in families]
    width = max(len(r) for r in EXERCISABLE_RULES)
    lines = [f"{'':<{width}} " + " ".join(f"{n:>{max(len(n), 5)}}" for n in names)]
    for reached in EXERCISABLE_RULES:
        cells = (f"{exercised[name][reached]:>{max(len(name), 5)}}" for name in names)
        lines.append(f"{reached:<{width}} " + " ".join(cells))
    return lines


#: the JSON report's schema id (docs/reports.md); bumped when a key changes meaning or goes away
SCHEMA = "kvconform-report/1"


#: who gave a backend's answers (:mod:`pytest_kvconform.provenance`), as the report names them
ANSWERED_BY = {"backend": "own", "inherited": "inherited", "reference": "declined"}


def _by_name(counts: Counter[str]) -> dict[str, int]:
    return {name: int(counts[by]) for by, name in ANSWERED_BY.items()}


def answers_of(records: Iterable[Mapping[str, Any]]) -> dict[str, Counter[str]]:
    """Rule family -> who answered -> backend answers, from result records."""
    answers: dict[str, Counter[str]] = defaultdict(Counter)
    for record in records:
        answers[str(record["rule"])].update(record.get("answers") or {})
    return answers


def format_steps(steps: Mapping[str, Counter[str]]) -> list[str]:
    """One line per plan step (``family.method``): its answers by who gave them."""
    width = max((len(step) for step in steps), default=0)
    return [f"{step:<{width}}  " + ", ".join(f"{n} {name}" for name, n in _by_name(counts).items())
            for step, counts in steps.items()]  # fmt: skip


def format_answers(answers: Mapping[str, Counter[str]]) -> list[str]:
    """One line per rule family: the backend's answers compared, by who gave them: its own code,
    the reference's code running for it (inherited), the reference because it declined."""
    return format_steps({rule: counts for rule, counts in answers.items() if sum(counts.values())})


def matrix_of(records: Iterable[Mapping[str, Any]]) -> dict[str, Counter[str]]:
    """Rule family -> outcome -> tests, from result records (``kvconform check``)."""
    matrix: dict[str, Counter[str]] = defaultdict(Counter)
    for record in records:
        matrix[str(record["rule"])][str(record["outcome"])] += 1
    return matrix


def report_document(
    backend: Any,
    matrix: Mapping[str, Counter[str]],
    exercised: Mapping[str, Counter[str]] | None = None,
    records: Sequence[Mapping[str, Any]] = (),
    options: Mapping[str, str] | None = None,
    reference: Mapping[str, str] | None = None,
    producer: str = "pytest",
    plan_steps: Mapping[str, Counter[str]] | None = None,
    process: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON report (schema :data:`SCHEMA`, every key in docs/reports.md)."""
    rows = _rows(matrix)
    return {
        "schema": SCHEMA,
        "producer": producer,
        "backend": backend.name,
        "version": backend.version,
        "backend_options": dict(options or {}),
        "process": dict(process or {}),
        "reference": dict(reference or {}),
        "rules": {rule: dict(zip(OUTCOMES, counts, strict=True)) for rule, counts in rows},
        "totals": {o: sum(c[i] for _, c in rows) for i, o in enumerate(OUTCOMES)},
        "generated_reached": {family: dict(counts) for family, counts in (exercised or {}).items()},
        "plan_steps": {step: _by_name(counts) for step, counts in (plan_steps or {}).items()},
        "answers": {rule: _by_name(counts) for rule, counts in answers_of(records).items()},
        "results": [
            {
                "test": str(r.get("test", "")),
                "rule": str(r["rule"]),
                "scenario": str(r.get("scenario", "")),
                "outcome": str(r["outcome"]),
                "message": str(r.get("message", "")),
                "difference": dict(r["difference"]) if r.get("difference") else None,
                "answers": _by_name(Counter(r.get("answers") or {})),
                "processes": list(r.get("processes") or []),
            }
            for r in records
        ],
    }


def _cell(value: Any) -> str:
    """A Markdown table cell: one line, pipes escaped, long values cut."""
    text = " ".join(str(value).split()).replace("|", "\\|")
    return text if len(text) <= 200 else text[:197] + "..."


def format_markdown(document: Mapping[str, Any]) -> str:
    """The report as Markdown for a CI step summary (``$GITHUB_STEP_SUMMARY``): rule x outcome,
    the departures (scenario, rule, field, reference, backend), then the other failures and the
    skip and xfail reasons."""
    options = " ".join(f"{k}={v}" for k, v in document["backend_options"].items())
    ref = document["reference"]
    lines = [f"# kvconform: {document['backend']} ({document['version']})", ""]
    about = [f"reference: vLLM {ref['vllm_release']} rules ({ref.get('selected_by', '')})"] if ref else []
    about += [f"options: {options}"] if options else []
    lines += [f"{_cell('; '.join(about))}", ""] if about else []
    lines += ["| rule family | " + " | ".join(OUTCOMES) + " |", "|---" * (len(OUTCOMES) + 1) + "|"]
    lines += [f"| {rule} | " + " | ".join(str(counts[o]) for o in OUTCOMES) + " |"
              for rule, counts in document["rules"].items()]  # fmt: skip
    lines.append("| **total** | " + " | ".join(str(document["totals"][o]) for o in OUTCOMES) + " |")
    results = document["results"]
    departures = [r for r in results if r["outcome"] == "failed" and r["difference"]]
    if departures:
        lines += ["", "## Departures", "", "| scenario | rule | field | reference | backend |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for r in departures:
            diff = r["difference"]
            cells = (r["scenario"] or r["test"], r["rule"], diff["field"], diff["reference"], diff["backend"])
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    others = [r for r in results if r["outcome"] == "failed" and not r["difference"]]
    if others:
        lines += ["", "## Other failures", "", "| test | rule | message |", "|---|---|---|"]
        lines += [f"| {_cell(r['test'])} | {r['rule']} | {_cell(r['message'])} |" for r in others]
    reasons = Counter((r["outcome"], r["rule"], r["message"]) for r in results
                      if r["outcome"] in ("skipped", "xfailed"))  # fmt: skip
    if reasons:
        lines += ["", "## Skipped and expected failures", "", "| outcome | rule | reason | tests |",
                  "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {o} | {rule} | {_cell(why)} | {n} |" for (o, rule, why), n in sorted(reasons.items())]
    return "\n".join(lines) + "\n"


def write_report(path: Path, document: Mapping[str, Any]) -> None:
    """``.json``: the document; anything else (``.md``, ``$GITHUB_STEP_SUMMARY``): Markdown."""
    if path.suffix == ".json":
        path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    else:
        path.write_text(format_markdown(document), encoding="utf-8")
