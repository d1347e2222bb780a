"""``specframe report``: turn a directory of results files into a markdown page with tables and PNG plots
(``render``), its answers for a terminal (``summary``), or a page comparing two directories (``render_comparison``).

Only files in the results format (``specframe.results``) are read, and each must carry its provenance; a file that
claims the format but lacks provenance stops the report (figures nobody can trace do not get published). The page:
the sections placed before the answers (``kinds.KINDS``), the answers and the headline tables of each kind, the
figures (``figures``), the provenance, and one table of scalar figures per results kind. Tree rows appear only for
drafters that build trees (``Drafter.builds_trees``): another drafter's "tree" is its chain, listed as such.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from specframe.errors import SpecframeError
from specframe.report.answers import answers
from specframe.report.figures import figures, save_figure
from specframe.report.kinds import sections
from specframe.report.markdown import provenance_section, table
from specframe.report.runs import chain_label, keyed_runs, load_results, runs, scalars


def render(directory: Path, output: Path | None = None) -> Path:
    """Write ``report.md`` (and its PNG plots beside it) for the results in ``directory``; return its path."""
    documents = load_results(directory)
    output = output or directory / "report.md"
    output.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# specframe results: {directory.name}", ""]
    for section in sections("before"):
        lines += section(documents)
    lines += headline(documents)
    made = figures(documents)
    if made:
        lines += ["## Figures", ""]
        for name, question, fig in made:
            save_figure(fig, output.parent / name)
            lines += [f"**{question}**", "", f"![{Path(name).stem}]({name})", ""]
    lines += provenance_section(documents)
    by_kind: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for name, document in documents:
        by_kind[document["kind"]].append((name, document))
    for kind, members in sorted(by_kind.items()):
        lines += [f"## {kind}", ""]
        measured = [(chain_label(run, metrics), metrics) for name, document in members
                    for run, metrics in runs(name, document)]
        keys = sorted({key for _, metrics in measured for key in scalars(metrics)})
        rows = [[run] + [scalars(metrics).get(key, "") for key in keys] for run, metrics in measured]
        lines += table(["run"] + keys, rows) + [""]
    output.write_text("\n".join(lines))
    return output


def headline(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The answers the comparison suites exist for (``answers``), then the headline tables of each results kind
    present, drafter by drafter (``kinds.KINDS``, the sections placed after the answers): best acceptance length per
    evaluation set, speedup over plain decoding, expected AL and throughput from training, longest context under the
    budget, and vLLM beside the reference engine."""
    out = answers(documents)
    for section in sections("after"):
        out += section(documents)
    return out


def summary(directory: Path) -> list[str]:
    """The answer ``render`` puts first (per-drafter jobs, then the answers in sentences), for a terminal."""
    documents = load_results(directory)
    lines = [line for section in sections("before", summary=True) for line in section(documents)]
    lines += answers(documents)
    return lines or [f"{directory}: no answer yet (no acceptance, speed or training results to rank)"]


def render_comparison(base: Path, other: Path, output: Path | None = None) -> Path:
    """A markdown page comparing every scalar figure of the results the two directories have in common."""
    a = dict(load_results(base))
    b = dict(load_results(other))
    common = sorted(set(a) & set(b))
    if not common:
        raise SpecframeError(f"{base} and {other} have no results files in common")
    lines = [f"# specframe results: {base.name} vs {other.name}", ""]
    rows = []
    for name in common:
        runs_b = {key: metrics for key, _, metrics in keyed_runs(name, b[name])}
        for key, run, metrics in keyed_runs(name, a[name]):
            if key not in runs_b:
                continue
            sa, sb = scalars(metrics), scalars(runs_b[key])
            for metric in sorted(set(sa) & set(sb)):
                ratio = sb[metric] / sa[metric] if sa[metric] else ""
                rows.append([run, metric, sa[metric], sb[metric], sb[metric] - sa[metric], ratio])
    lines += table(["run", "metric", base.name, other.name, "difference", "ratio"], rows) + [""]
    only = sorted(set(a) ^ set(b))
    if only:
        lines += ["Only in one directory: " + ", ".join(only), ""]
    output = output or other / f"compare-{base.name}.md"
    output.write_text("\n".join(lines))
    return output
