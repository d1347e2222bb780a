"""``specframe report``: turn a directory of results files into a markdown page with tables and PNG plots.

Only files in the results format (``specframe.results``) are read, and each must carry its provenance; a file that
claims the format but lacks provenance stops the report (figures nobody can trace do not get published). Plots are
drawn for the figures the suites record: peak memory against context (``metrics.points``), acceptance by draft
position (``metrics.per_position_conditional``) and speedup by K (``metrics.speedup`` with ``config.k``).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from specframe.errors import SpecframeError
from specframe.results import SCHEMA, check_results

LABEL_KEYS = ("drafter", "mask_builder", "partitioner", "engine", "verifier", "dataset", "k")


def load_results(directory: Path) -> list[tuple[str, dict[str, Any]]]:
    """Every results file under ``directory`` (sorted by relative path), each checked for provenance."""
    if not directory.is_dir():
        raise SpecframeError(f"results directory {directory} does not exist")
    found = []
    for path in sorted(directory.rglob("*.json")):
        try:
            document = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SpecframeError(f"{path}: cannot read results file: {exc}") from None
        if not (isinstance(document, dict) and str(document.get("schema", "")).startswith("specframe.results")):
            continue  # e.g. pytest-benchmark's own timing files
        if document["schema"] != SCHEMA:
            raise SpecframeError(f"{path}: results schema {document['schema']!r} is not {SCHEMA!r}")
        check_results(document, source=str(path))
        found.append((str(path.relative_to(directory)), document))
    if not found:
        raise SpecframeError(f"no specframe results files in {directory}")
    return found


def label(name: str, document: dict[str, Any]) -> str:
    config = {**document.get("config", {}), **document.get("metrics", {})}
    parts = [f"{key}={config[key]}" for key in LABEL_KEYS if config.get(key) not in (None, "")]
    return ", ".join(parts) or name


def scalars(document: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in document.get("metrics", {}).items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            continue
        out[key] = value
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(cell) for cell in row) + " |" for row in rows]
    return lines


def render(directory: Path, output: Path | None = None) -> Path:
    """Write ``report.md`` (and its PNG plots beside it) for the results in ``directory``; return its path."""
    documents = load_results(directory)
    output = output or directory / "report.md"
    output.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# specframe results: {directory.name}", ""]
    lines += _provenance_section(documents)
    by_kind: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for name, document in documents:
        by_kind[document["kind"]].append((name, document))
    for kind, members in sorted(by_kind.items()):
        lines += [f"## {kind}", ""]
        keys = sorted({key for _, document in members for key in scalars(document)})
        rows = [[label(name, d)] + [scalars(d).get(key, "") for key in keys] for name, d in members]
        lines += _table(["run"] + keys, rows) + [""]
        for plot in _plots(kind, members, output.parent):
            lines += [f"![{plot.stem}]({plot.name})", ""]
    output.write_text("\n".join(lines))
    return output


def _provenance_section(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    rows = []
    for name, document in documents:
        prov = document["provenance"]
        machine = prov["machine"] or {}
        rows.append([
            name, prov["git_commit"], prov["target"]["id"], prov.get("token_budget") or "n/a",
            f"{machine.get('processor', '?')} x{machine.get('cpu_count', '?')}", prov["date"], f"`{prov['command']}`",
        ])
    return ["## Provenance", ""] + _table(
        ["file", "commit", "target", "training tokens", "machine", "date", "command"], rows
    ) + [""]


def _plots(kind: str, members: list[tuple[str, dict[str, Any]]], where: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    memory = [(n, d) for n, d in members if d["metrics"].get("points")]
    if memory:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, document in memory:
            points = sorted(document["metrics"]["points"], key=lambda p: p["seq_len"])
            ax.plot([p["seq_len"] for p in points], [p["peak_bytes"] / 2**30 for p in points], "o-",
                    label=label(name, document))
        ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="peak memory (GiB)",
               title="Peak training memory against context")
        ax.legend(fontsize=7)
        made.append(_save(fig, where / f"{kind}-memory.png"))
    acceptance = [(n, d) for n, d in members if d["metrics"].get("per_position_conditional")]
    if acceptance:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, document in acceptance:
            rates = document["metrics"]["per_position_conditional"]
            ax.plot(range(1, len(rates) + 1), rates, "o-", label=label(name, document))
        ax.set(xlabel="draft position", ylabel="acceptance rate (conditional)", ylim=(0, 1),
               title="Acceptance by position")
        ax.legend(fontsize=7)
        made.append(_save(fig, where / f"{kind}-acceptance.png"))
    speed = [(n, d) for n, d in members if d["metrics"].get("speedup") is not None and d.get("config", {}).get("k")]
    if speed:
        series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for name, document in speed:
            config = document["config"]
            key = ", ".join(str(config.get(k)) for k in ("drafter", "verifier", "engine") if config.get(k))
            series[key or name].append((config["k"], document["metrics"]["speedup"]))
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, values in sorted(series.items()):
            values.sort()
            ax.plot([k for k, _ in values], [s for _, s in values], "o-", label=key)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xlabel="K (draft tokens per round)", ylabel="speedup over plain decoding", title="Speedup by K")
        ax.legend(fontsize=7)
        made.append(_save(fig, where / f"{kind}-speedup.png"))
    return made


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def compare(base: Path, other: Path, output: Path | None = None) -> Path:
    """A markdown page comparing every scalar figure of the results the two directories have in common."""
    a = dict(load_results(base))
    b = dict(load_results(other))
    common = sorted(set(a) & set(b))
    if not common:
        raise SpecframeError(f"{base} and {other} have no results files in common")
    lines = [f"# specframe results: {base.name} vs {other.name}", ""]
    rows = []
    for name in common:
        sa, sb = scalars(a[name]), scalars(b[name])
        for key in sorted(set(sa) & set(sb)):
            ratio = sb[key] / sa[key] if sa[key] else ""
            rows.append([label(name, a[name]), key, sa[key], sb[key], sb[key] - sa[key], ratio])
    lines += _table(["run", "metric", base.name, other.name, "difference", "ratio"], rows) + [""]
    only = sorted(set(a) ^ set(b))
    if only:
        lines += ["Only in one directory: " + ", ".join(only), ""]
    output = output or other / f"compare-{base.name}.md"
    output.write_text("\n".join(lines))
    return output
