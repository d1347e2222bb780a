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


def runs(name: str, document: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The measured runs in a results file as (label, figures): one per method where the file compares several
    side by side (``metrics.methods``, as ``bench acceptance`` writes), else the file itself."""
    return [(run_label, figures) for _, run_label, figures in _keyed_runs(name, document)]


def _keyed_runs(name: str, document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    # (key, label, figures); the key (method name, or "" for a single-run file) pairs runs across directories
    metrics = document.get("metrics", {})
    config = document.get("config", {})
    methods = metrics.get("methods")
    if isinstance(methods, dict) and methods:
        base = label(name, {"config": config, "metrics": {}})
        return [(method, f"{base}: {method}", figures) for method, figures in methods.items() if isinstance(figures, dict)]
    extra = {key: config[key] for key in ("k", "drafter") if key in config and key not in metrics}
    return [("", label(name, document), {**metrics, **extra})]


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
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
    lines += headline(documents)
    lines += _provenance_section(documents)
    by_kind: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for name, document in documents:
        by_kind[document["kind"]].append((name, document))
    for kind, members in sorted(by_kind.items()):
        lines += [f"## {kind}", ""]
        measured = [run for name, document in members for run in runs(name, document)]
        keys = sorted({key for _, metrics in measured for key in scalars(metrics)})
        rows = [[run] + [scalars(metrics).get(key, "") for key in keys] for run, metrics in measured]
        lines += _table(["run"] + keys, rows) + [""]
        for plot in _plots(kind, measured, output.parent):
            lines += [f"![{plot.stem}]({plot.name})", ""]
    output.write_text("\n".join(lines))
    return output


def headline(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The answers the comparison suites exist for, drafter by drafter: best acceptance length per evaluation set,
    speedup over plain decoding, expected AL and throughput from training, longest context under the budget, and
    vLLM beside the reference engine. Only kinds present in ``documents`` appear."""
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for _, document in documents:
        by_kind[document["kind"]].append(document)
    acceptance = by_kind.get("bench.acceptance", [])
    sweeps = [d for d in acceptance if d.get("config", {}).get("ks")]
    speed = [d for d in acceptance if d.get("config", {}).get("k") and d.get("metrics", {}).get("repeats", 1) > 1]
    out = _best_acceptance(sweeps) if sweeps else []
    for d in speed:
        out += _speedups(d)
    for d in by_kind.get("bench.training", []):
        out += _training(d)
    for d in by_kind.get("bench.memory", []):
        out += _longest_context(d)
    if by_kind.get("bench.vllm"):
        out += _vllm_beside_reference(by_kind["bench.vllm"])
    return out


def _drafter_of(label: str) -> str:
    return label.split("/")[0]


def _best_acceptance(sweeps: list[dict[str, Any]]) -> list[str]:
    sets = sorted({d["config"]["dataset"] for d in sweeps})
    best: dict[str, dict[str, tuple[float, str]]] = defaultdict(dict)
    for d in sweeps:
        for label, m in d["metrics"]["methods"].items():
            al = m.get("acceptance_length")
            if label == "plain" or not isinstance(al, int | float):
                continue
            name, dataset = _drafter_of(label), d["config"]["dataset"]
            if al > best[name].get(dataset, (0.0, ""))[0]:
                best[name][dataset] = (al, label.split("/")[-1])
    budgets = _budgets(sweeps)
    rows = [[name] + [f"{best[name][s][0]:.2f} ({best[name][s][1]})" if s in best[name] else "" for s in sets]
            + [budgets.get(name, "n/a")] for name in sorted(best, key=lambda n: -max(v[0] for v in best[n].values()))]
    return ["## Headline", "", "Best acceptance length (tokens per target forward) per evaluation set, and the "
            "setting that reached it:", ""] + _table(["drafter", *sets, "training tokens"], rows) + [""]


def _speedups(d: dict[str, Any]) -> list[str]:
    ranked = []
    for label, m in d["metrics"]["methods"].items():
        iv = m.get("speedup_interval") or {}
        if label == "plain" or iv.get("mean") is None:
            continue
        ci = f" [{iv['low']:.2f}, {iv['high']:.2f}]" if iv.get("low") is not None else ""
        ranked.append((iv["mean"], [label, f"{m['acceptance_length']:.2f}", f"{iv['mean']:.2f}x{ci}",
                                    _fmt(m.get("draft_seconds_per_round")), _budgets([d]).get(_drafter_of(label), "n/a")]))
    rows = [row for _, row in sorted(ranked, key=lambda r: -r[0])]
    return [f"Speedup over plain decoding ({d['config'].get('dataset')}, {d['metrics']['repeats']} interleaved "
            "repeats, geometric mean and 95% interval):", ""] + _table(
        ["method", "AL", "speedup", "drafter s/round", "training tokens"], rows) + [""]


def _training(d: dict[str, Any]) -> list[str]:
    rows = [[name, _fmt(m.get("val_expected_al")), _fmt(m.get("tokens_per_second")),
             _fmt((m.get("peak_rss_bytes") or 0) / 2**20), _fmt(m.get("train_tokens"))] if "refused" not in m
            else [name, "does not fit", "", "", ""] for name, m in d["metrics"]["methods"].items()]
    return [f"Training under one budget ({d['metrics'].get('memory_budget')}):", ""] + _table(
        ["drafter", "expected AL (validation)", "train tokens/s", "peak RSS MiB", "train tokens"], rows) + [""]


def _longest_context(d: dict[str, Any]) -> list[str]:
    by_drafter: dict[str, list[dict[str, Any]]] = {}
    for m in d["metrics"]["methods"].values():
        by_drafter.setdefault(m["drafter"], []).append(m)
    rows = []
    for name, methods in by_drafter.items():
        # the longest context; among ties (several at the search cap) the one needing the least memory there
        m = max(methods, key=lambda m: (m.get("longest_seq_len") or 0, -(m.get("peak_bytes") or 0)))
        n = m.get("longest_seq_len") or 0
        rows.append([name, (f">= {n} (search cap)" if m.get("at_cap") else str(n)) if n else "none",
                     f"{m['mask_builder']} + {m['partitioner']}",
                     _fmt(m["peak_bytes"] / 2**20) if n and m.get("peak_bytes") else ""])
    return [f"Longest trainable context under {d['metrics'].get('memory_budget')} (measured):", ""] + _table(
        ["drafter", "tokens", "mask builder + partitioner", "peak MiB there"], rows) + [""]


def _vllm_beside_reference(documents: list[dict[str, Any]]) -> list[str]:
    rows = []
    for d in documents:
        m = d["metrics"]["methods"]
        budget = d["provenance"].get("token_budget")
        rows.append([d["config"].get("drafter"), f"{m['vllm']['acceptance_length']:.2f}",
                     f"{m['vllm']['speedup_interval']['mean']:.2f}x", f"{m['reference']['acceptance_length']:.2f}",
                     f"{m['reference']['speedup_interval']['mean']:.2f}x", budget if budget is not None else "n/a"])
    return ["vLLM against the reference engine (same checkpoint, prompts and K):", ""] + _table(
        ["drafter", "vLLM AL", "vLLM speedup", "reference AL", "reference speedup", "training tokens"], rows) + [""]


def _budgets(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """Training tokens per drafter name, from the provenance of ``documents``."""
    out: dict[str, Any] = {}
    for d in documents:
        budget = d["provenance"].get("token_budget")
        if isinstance(budget, dict):
            out.update({str(k).split("/")[0]: v for k, v in budget.items()})
    return out


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


def _plots(kind: str, measured: list[tuple[str, dict[str, Any]]], where: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    memory = [(run, m) for run, m in measured if m.get("points")]
    if memory:
        fig, ax = plt.subplots(figsize=(6, 4))
        for run, metrics in memory:
            points = sorted(metrics["points"], key=lambda p: p["seq_len"])
            ax.plot([p["seq_len"] for p in points], [p["peak_bytes"] / 2**30 for p in points], "o-", label=run)
        ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="peak memory (GiB)",
               title="Peak training memory against context")
        ax.legend(fontsize=7)
        made.append(_save(fig, where / f"{kind}-memory.png"))
    acceptance = [(run, _conditional(m)) for run, m in measured if _conditional(m)]
    if acceptance:
        fig, ax = plt.subplots(figsize=(6, 4))
        for run, rates in acceptance:
            ax.plot(range(1, len(rates) + 1), [r if r is not None else float("nan") for r in rates], "o-", label=run)
        ax.set(xlabel="draft position", ylabel="acceptance rate (conditional)", ylim=(0, 1),
               title="Acceptance by position")
        ax.legend(fontsize=7)
        made.append(_save(fig, where / f"{kind}-acceptance.png"))
    speed = [(run, m) for run, m in measured if m.get("speedup") is not None and m.get("k")]
    if speed:
        series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for run, metrics in speed:
            key = metrics.get("drafter") or run.split(":")[-1].split("/")[0].strip()
            series[key].append((metrics["k"], metrics["speedup"]))
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, values in sorted(series.items()):
            values.sort()
            ax.plot([k for k, _ in values], [s for _, s in values], "o-", label=key)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xlabel="K (draft tokens per round)", ylabel="speedup over plain decoding", title="Speedup by K")
        ax.legend(fontsize=7)
        made.append(_save(fig, where / f"{kind}-speedup.png"))
    return made


def _conditional(metrics: dict[str, Any]) -> list[float | None]:
    return metrics.get("per_position_conditional") or metrics.get("conditional") or []


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
        runs_b = {key: figures for key, _, figures in _keyed_runs(name, b[name])}
        for key, run, figures in _keyed_runs(name, a[name]):
            if key not in runs_b:
                continue
            sa, sb = scalars(figures), scalars(runs_b[key])
            for metric in sorted(set(sa) & set(sb)):
                ratio = sb[metric] / sa[metric] if sa[metric] else ""
                rows.append([run, metric, sa[metric], sb[metric], sb[metric] - sa[metric], ratio])
    lines += _table(["run", "metric", base.name, other.name, "difference", "ratio"], rows) + [""]
    only = sorted(set(a) ^ set(b))
    if only:
        lines += ["Only in one directory: " + ", ".join(only), ""]
    output = output or other / f"compare-{base.name}.md"
    output.write_text("\n".join(lines))
    return output
