"""The conformance matrix: rule family x outcome, for the terminal, JSON and Markdown."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
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


def write_report(
    path: Path, backend: Any, matrix: Mapping[str, Counter[str]], exercised: Mapping[str, Counter[str]] = {}
) -> None:
    """``.json``: one object; anything else: a Markdown table."""
    rows = _rows(matrix)
    if path.suffix == ".json":
        data = {
            "backend": backend.name,
            "version": backend.version,
            "rules": {rule: dict(zip(OUTCOMES, counts, strict=True)) for rule, counts in rows},
            "generated_reached": {family: dict(counts) for family, counts in exercised.items()},
        }
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return
    lines = [
        f"# kvconform: {backend.name} ({backend.version})",
        "",
        "| rule family | " + " | ".join(OUTCOMES) + " |",
    ]
    lines.append("|---" * (len(OUTCOMES) + 1) + "|")
    lines += [f"| {rule} | " + " | ".join(str(n) for n in counts) + " |" for rule, counts in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
