"""Markdown helpers of the report: a number as a table cell, a table, a figure with its interval, and the provenance
table every page ends its answers with."""

from __future__ import annotations

from typing import Any


def format_cell(value: Any) -> str:
    """A value as a table cell (floats to 4 significant digits)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table's lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(format_cell(cell) for cell in row) + " |" for row in rows]
    return lines


def banded(value: float, low: float | None, high: float | None, fmt: str) -> str:
    """``value [low, high]`` in ``fmt``, or the value alone without an interval."""
    return f"{value:{fmt}} [{low:{fmt}}, {high:{fmt}}]" if low is not None and high is not None else f"{value:{fmt}}"


def throughput(metrics: Any) -> str:
    """A training run's tokens/s with the cores other processes kept busy meanwhile (``beside_cores``), for a
    ``tok/s (cores beside)`` column: a figure measured beside other work is not a speed comparison, and the cell says
    how much there was."""
    tps, beside = metrics.get("tokens_per_second"), metrics.get("beside_cores")
    if not tps:
        return "n/a"
    return f"{tps:.0f}" + ("" if beside is None else f" ({beside:.1f})")


def provenance_section(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The page's provenance table: per file, its commit, target, training tokens, machine, date and command."""
    rows = []
    for name, document in documents:
        prov = document["provenance"]
        machine = prov["machine"] or {}
        rows.append([
            name, prov["git_commit"], prov["target"]["id"], prov.get("token_budget") or "n/a",
            f"{machine.get('processor', '?')} x{machine.get('cpu_count', '?')}", prov["date"], f"`{prov['command']}`",
        ])
    return ["## Provenance", ""] + table(
        ["file", "commit", "target", "training tokens", "machine", "date", "command"], rows
    ) + [""]
