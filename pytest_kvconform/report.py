"""The conformance matrix: rule family x verdict, for the terminal, JSON and Markdown.

Everything here is derived from the result records (one per test or check, as
:func:`pytest_kvconform.checks.record` writes them), so the terminal summary, ``kvconform check``
and the report give the same counts.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .verdict import VERDICTS

#: the generated inputs of the property tests: compared, declined by the backend, known departures
GENERATED = ("compared", "declined", "known")
#: the matrix's columns: the verdicts, then the generated inputs (prefixed ``gen.``)
COLUMNS = (*VERDICTS, *(f"gen. {g}" for g in GENERATED))

#: the JSON report's schema id (docs/reports.md); bumped when a key changes meaning or goes away
SCHEMA = "kvconform-report/2"

#: who gave a backend's answers (:mod:`pytest_kvconform.provenance`), as the report names them
ANSWERED_BY = {"backend": "own", "core": "vLLM core", "inherited": "inherited", "reference": "declined"}


def matrix_of(records: Iterable[Mapping[str, Any]]) -> dict[str, Counter[str]]:
    """Rule family -> column (:data:`COLUMNS`) -> count, from result records."""
    matrix: dict[str, Counter[str]] = defaultdict(Counter)
    for record in records:
        row = matrix[str(record["rule"])]
        row[str(record["verdict"])] += 1
        for key, n in (record.get("generated") or {}).items():
            row[f"gen. {key}"] += int(n)
    return matrix


def _rows(matrix: Mapping[str, Counter[str]]) -> list[tuple[str, list[int]]]:
    from .backends.base import RULE_FAMILIES

    order = [r for r in RULE_FAMILIES if r in matrix] + sorted(set(matrix) - set(RULE_FAMILIES))
    return [(rule, [matrix[rule][c] for c in COLUMNS]) for rule in order]


def format_matrix(matrix: Mapping[str, Counter[str]]) -> list[str]:
    rows = _rows(matrix)
    width = max([len("rule family"), *(len(r) for r, _ in rows)])
    cells = [max(len(c), 6) for c in COLUMNS]
    lines = [
        f"{'rule family':<{width}} " + " ".join(f"{c:>{w}}" for c, w in zip(COLUMNS, cells, strict=True))
    ]
    lines += [f"{rule:<{width}} " + " ".join(f"{n:>{w}}" for n, w in zip(counts, cells, strict=True))
              for rule, counts in rows]  # fmt: skip
    totals = [sum(c[i] for _, c in rows) for i in range(len(COLUMNS))]
    lines.append(f"{'total':<{width}} " + " ".join(f"{n:>{w}}" for n, w in zip(totals, cells, strict=True)))
    return lines


def exercised_of(records: Iterable[Mapping[str, Any]]) -> dict[str, Counter[str]]:
    """Property-test family -> rule reached -> generated inputs compared that reached it."""
    out: dict[str, Counter[str]] = defaultdict(Counter)
    for record in records:
        if record.get("exercised"):
            out[str(record["rule"])].update(record["exercised"])
    return out


def format_exercised(exercised: Mapping[str, Counter[str]]) -> list[str]:
    """One line per rule a generated input can reach: how many compared inputs of each
    property test (rule family) reached it; 0 shows a strategy that stopped reaching it."""
    from .strategies import EXERCISABLE_RULES

    names = [rule for rule, _ in _rows(exercised) if any(exercised[rule].values())]
    width = max(len(r) for r in EXERCISABLE_RULES)
    lines = [f"{'':<{width}} " + " ".join(f"{n:>{max(len(n), 5)}}" for n in names)]
    for reached in EXERCISABLE_RULES:
        cells = (f"{exercised[name][reached]:>{max(len(name), 5)}}" for name in names)
        lines.append(f"{reached:<{width}} " + " ".join(cells))
    return lines


def _by_name(counts: Mapping[str, int]) -> dict[str, int]:
    return {name: int(counts.get(by, 0)) for by, name in ANSWERED_BY.items()}


def answers_of(records: Iterable[Mapping[str, Any]]) -> dict[str, Counter[str]]:
    """Rule family -> who answered -> backend answers, from result records."""
    answers: dict[str, Counter[str]] = defaultdict(Counter)
    for record in records:
        answers[str(record["rule"])].update(record.get("answers") or {})
    return answers


def steps_of(records: Iterable[Mapping[str, Any]]) -> dict[str, Counter[str]]:
    """Plan step (``family.method``) -> who answered -> answers, over the plan tests."""
    steps: dict[str, Counter[str]] = defaultdict(Counter)
    for record in records:
        for step, counts in (record.get("steps") or {}).items():
            steps[step].update(counts)
    return steps


def declined_steps_of(records: Iterable[Mapping[str, Any]]) -> Counter[str]:
    """``family.method: reference (why)`` -> plans in which the reference answered that step."""
    return Counter(
        step for record in records if record["rule"] == "plan" for step in record.get("declined") or ()
    )


def format_steps(steps: Mapping[str, Counter[str]]) -> list[str]:
    """One line per plan step (``family.method``): its answers by who gave them."""
    width = max((len(step) for step in steps), default=0)
    return [f"{step:<{width}}  " + ", ".join(f"{n} {name}" for name, n in _by_name(counts).items())
            for step, counts in steps.items()]  # fmt: skip


def format_answers(answers: Mapping[str, Counter[str]]) -> list[str]:
    """One line per rule family: the backend's answers compared, by who gave them: its own code,
    the reference's code running for it (inherited), the reference because it declined."""
    return format_steps({rule: counts for rule, counts in answers.items() if sum(counts.values())})


def report_document(
    backend: Any,
    records: Sequence[Mapping[str, Any]],
    options: Mapping[str, str] | None = None,
    reference: Mapping[str, str] | None = None,
    producer: str = "pytest",
    process: Mapping[str, Any] | None = None,
    mode: str = "conformance",
) -> dict[str, Any]:
    """The JSON report (schema :data:`SCHEMA`, every key in docs/reports.md). Results are sorted
    by test, so the same inputs give the same bytes whatever order the tests ran in; the
    processes that answered appear only for a backend isolated in its own process."""
    records = sorted(records, key=lambda r: (str(r.get("test", "")), str(r["rule"])))
    rows = _rows(matrix_of(records))
    document: dict[str, Any] = {
        "schema": SCHEMA,
        "producer": producer,
        "mode": mode,
        "backend": backend.name,
        "version": backend.version,
        "backend_options": dict(options or {}),
        "reference": dict(reference or {}),
        "rules": {rule: dict(zip(COLUMNS, counts, strict=True)) for rule, counts in rows},
        "totals": {c: sum(counts[i] for _, counts in rows) for i, c in enumerate(COLUMNS)},
        "generated_reached": {family: dict(counts) for family, counts in exercised_of(records).items()},
        "plan_steps": {step: _by_name(counts) for step, counts in steps_of(records).items()},
        "answers": {rule: _by_name(counts) for rule, counts in answers_of(records).items()},
        "results": [
            {
                "test": str(r.get("test", "")),
                "rule": str(r["rule"]),
                "scenario": str(r.get("scenario", "")),
                "verdict": str(r["verdict"]),
                "outcome": str(r["outcome"]),
                "message": str(r.get("message", "")),
                "difference": dict(r["difference"]) if r.get("difference") else None,
                "answers": _by_name(r.get("answers") or {}),
                "declined_steps": list(r.get("declined") or ()),
            }
            for r in records
        ],
    }
    if process and process.get("isolated"):
        document["isolation"] = {
            "why": process.get("why", ""),
            "processes": {str(r.get("test", "")): list(r.get("processes") or []) for r in records},
        }
    return document


def _cell(value: Any) -> str:
    """A Markdown table cell: one line, pipes escaped, long values cut."""
    text = " ".join(str(value).split()).replace("|", "\\|")
    return text if len(text) <= 200 else text[:197] + "..."


def format_markdown(document: Mapping[str, Any]) -> str:
    """The report as Markdown for a CI step summary (``$GITHUB_STEP_SUMMARY``): rule x verdict,
    the departures (scenario, rule, field, reference, backend), the crashes, then the declined,
    inherited and known-departure reasons."""
    options = " ".join(f"{k}={v}" for k, v in document["backend_options"].items())
    ref = document["reference"]
    lines = [f"# kvconform: {document['backend']} ({document['version']})", ""]
    about = [f"reference: vLLM {ref['vllm_release']} rules ({ref.get('selected_by', '')})"] if ref else []
    about += [f"options: {options}"] if options else []
    about += ["self-check of the expectations (the reference against independent numbers)"] if (
        document.get("mode") == "self-check") else []  # fmt: skip
    lines += [f"{_cell('; '.join(about))}", ""] if about else []
    lines += ["| rule family | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    lines += [f"| {rule} | " + " | ".join(str(counts[c]) for c in COLUMNS) + " |"
              for rule, counts in document["rules"].items()]  # fmt: skip
    lines.append("| **total** | " + " | ".join(str(document["totals"][c]) for c in COLUMNS) + " |")
    results = document["results"]
    departures = [r for r in results if r["verdict"] == "departed" and r["difference"]]
    if departures:
        lines += ["", "## Departures", "", "| scenario | rule | field | reference | backend |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for r in departures:
            diff = r["difference"]
            cells = (r["scenario"] or r["test"], r["rule"], diff["field"], diff["reference"], diff["backend"])
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    others = [
        r
        for r in results
        if r["outcome"] == "failed" and not (r["verdict"] == "departed" and r["difference"])
    ]
    if others:
        lines += [
            "",
            "## Crashes and other failures",
            "",
            "| test | rule | verdict | message |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {_cell(r['test'])} | {r['rule']} | {r['verdict']} | {_cell(r['message'])} |" for r in others
        ]
    reasons = Counter(
        (r["verdict"], r["rule"], r["message"])
        for r in results
        if r["verdict"] in ("declined", "inherited", "core", "known", "n/a") and r["outcome"] != "failed"
    )
    if reasons:
        lines += ["", "## Declined, inherited, vLLM core's, known departures, not applicable", "",
                  "| verdict | rule | reason | tests |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {v} | {rule} | {_cell(why)} | {n} |" for (v, rule, why), n in sorted(reasons.items())]
    return "\n".join(lines) + "\n"


def write_report(path: Path, document: Mapping[str, Any]) -> None:
    """``.json``: the document; anything else (``.md``, ``$GITHUB_STEP_SUMMARY``): Markdown."""
    if path.suffix == ".json":
        path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    else:
        path.write_text(format_markdown(document), encoding="utf-8")
