"""``specframe report``: turn a directory of results files into a markdown page with tables and PNG plots.

Only files in the results format (``specframe.results``) are read, and each must carry its provenance; a file that
claims the format but lacks provenance stops the report (figures nobody can trace do not get published).

One figure per question, each drawn only when the results hold its data (``figures``):

- ``al-by-dataset.png``: acceptance length per drafter per evaluation set (grouped bars, each drafter's best setting,
  95% Student-t interval over prompt turns where per-prompt rows exist);
- ``speedup-by-k.png``: speedup over plain decoding per drafter at each chain K, with the 95% interval over repeats
  and the break-even line at 1.0 (a ratio above the physical bound, speedup > AL x 1.05, is left out);
- ``learning-curves.png``: validation AL against training tokens, every drafter on one axis;
- ``memory-by-context.png``: peak training memory against context, one panel per drafter, with the budget line.

At most ``MAX_SERIES`` series share an axes and legends sit outside the data. Tree rows appear only for drafters that
build trees (``Drafter.builds_trees``): another drafter's "tree" is its chain, listed as such in the tables.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from specframe.errors import SpecframeError, read_json
from specframe.results import SCHEMA, check_results, is_baseline
from specframe.stats import PHYSICAL_SLACK, t975

LABEL_KEYS = ("drafter", "mask_builder", "partitioner", "engine", "verifier", "dataset", "k")
#: the most series one axes shows (more would be unreadable; the tables keep every run)
MAX_SERIES = 8
#: a training throughput measured while other processes kept more than this many cores busy, on average, is flagged
BUSY_CORES = 0.25


def load_results(directory: Path) -> list[tuple[str, dict[str, Any]]]:
    """Every results file under ``directory`` (sorted by relative path), each checked for provenance."""
    if not directory.is_dir():
        raise SpecframeError(f"results directory {directory} does not exist")
    found = []
    for path in sorted(directory.rglob("*.json")):
        document = read_json(path, "a results file", expect=None)
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
    from specframe.report_ablations import ablations_section
    from specframe.report_jobs import jobs_section
    from specframe.report_peer import peer_section

    lines = [f"# specframe results: {directory.name}", ""]
    lines += jobs_section(documents)
    lines += ablations_section(documents)
    lines += peer_section(documents)
    lines += headline(documents)
    made = figures(documents)
    if made:
        lines += ["## Figures", ""]
        for name, question, fig in made:
            _save(fig, output.parent / name)
            lines += [f"**{question}**", "", f"![{Path(name).stem}]({name})", ""]
    lines += _provenance_section(documents)
    by_kind: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for name, document in documents:
        by_kind[document["kind"]].append((name, document))
    for kind, members in sorted(by_kind.items()):
        lines += [f"## {kind}", ""]
        measured = [(_chain_label(run, metrics), metrics) for name, document in members
                    for run, metrics in runs(name, document)]
        keys = sorted({key for _, metrics in measured for key in scalars(metrics)})
        rows = [[run] + [scalars(metrics).get(key, "") for key in keys] for run, metrics in measured]
        lines += _table(["run"] + keys, rows) + [""]
    output.write_text("\n".join(lines))
    return output


#: the speedup over plain decoding the comparison aims for (issue 29's goal for the best drafter at batch 1)
GOAL_SPEEDUP = 1.3


def summary(directory: Path) -> list[str]:
    """The answer ``render`` puts first (per-drafter jobs, then the answers in sentences), for a terminal."""
    from specframe.report_ablations import ablations_section
    from specframe.report_jobs import jobs_section

    documents = load_results(directory)
    lines = jobs_section(documents) + ablations_section(documents) + answers(documents)
    return lines or [f"{directory}: no answer yet (no acceptance, speed or training results to rank)"]


def builds_trees(drafter: str | None, figures: dict[str, Any] | None = None) -> bool:
    """Whether ``drafter`` builds real trees: recorded in newer results (``builds_trees``), else the installed
    drafter plugin's ``builds_trees`` (False for a drafter that is not installed)."""
    if figures is not None and isinstance(figures.get("builds_trees"), bool):
        return figures["builds_trees"]
    if not drafter:
        return False
    try:
        from specframe import plugins

        return bool(getattr(plugins.get("drafter", drafter), "builds_trees", False))
    except Exception:  # noqa: BLE001 - an unknown drafter in old results is not a tree builder
        return False


def _is_tree(label: str, figures: dict[str, Any]) -> bool:
    return bool(figures.get("tree")) or label.rsplit("/", 1)[-1] == "tree"


def _false_tree(label: str, figures: dict[str, Any]) -> bool:
    """A "tree" row of a drafter whose propose_tree is its chain (older results measured those)."""
    return _is_tree(label, figures) and not builds_trees(_drafter_name(label, figures), figures)


def _chain_label(label: str, figures: dict[str, Any]) -> str:
    if not _false_tree(label, figures):
        return label
    depth = (figures.get("tree") or {}).get("depth")
    return f"{label} (chain{f' k{depth}' if depth else ''}: no tree)"


def _drafter_name(label: str, figures: dict[str, Any]) -> str:
    return str(figures.get("drafter") or label.split(":")[-1].strip().split("/")[0])


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
    out = answers(documents)
    out += _best_acceptance(sweeps) if sweeps else []
    for d in speed:
        out += _speedups(d)
    for d in by_kind.get("bench.training", []):
        out += _training(d)
    for d in by_kind.get("bench.memory", []):
        out += _longest_context(d)
    if by_kind.get("bench.vllm"):
        out += _vllm_beside_reference(by_kind["bench.vllm"])
        out += _vllm_by_k(documents)
    return out


def answers(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The comparison's questions answered in sentences, each with its interval and only from what was measured:
    the highest AL at the full budget per evaluation set, which drafter learns fastest per training token and per
    CPU-second, which is fastest in vLLM and by how much over plain vLLM, and P-EAGLE against EAGLE-3 there."""
    lines = []
    for dataset, ranked in sorted(_ranked_acceptance(documents).items()):
        (name, top), rest = ranked[0], ranked[1:]
        text = f"- **Highest AL on {dataset}:** {name} {_al_band(top)} ({top['setting']})"
        if rest:
            other, second = rest[0]
            separable = top["low"] is not None and second["high"] is not None and top["low"] > second["high"]
            text += f"; next {other} {_al_band(second)}" + ("" if separable else " (the intervals overlap)")
        lines.append(text)
    slopes = learning_rates(documents)
    if slopes:
        ranked = sorted(slopes.items(), key=lambda item: -item[1]["slope"])
        lines.append("- **Learns fastest per training token** (validation AL gained per doubling of training tokens, "
                     "least squares over the learning curve, 95% interval): " + ", ".join(
                         f"{name} {_band(v['slope'], v['low'], v['high'], '+.3f')}" for name, v in ranked))
    timed = al_at_equal_time(documents)
    if timed:
        seconds, values = timed
        ranked = sorted(values.items(), key=lambda item: -item[1])
        lines.append(f"- **Learns fastest per CPU-second** (validation AL after {seconds:.0f} s of training steps, "
                     "the shortest run's, read off each learning curve): " + ", ".join(
                         f"{name} {al:.3f}" for name, al in ranked))
    speed = speedup_by_k(documents, "vllm")
    best = max(((name, k, v) for name, points in speed.items() for k, v in points.items()),
               key=lambda item: item[2]["mean"], default=None)
    if best is not None:
        name, k, v = best
        verdict = "faster than" if v["low"] is not None and v["low"] > 1 else (
            "slower than" if v["high"] is not None and v["high"] < 1 else "not separable from")
        lines.append(f"- **Fastest in vLLM:** {name} at K = {k}, {_band(v['mean'], v['low'], v['high'], '.2f')}x "
                     f"plain vLLM's tokens/s (AL {v['al']:.2f}): {verdict} plain decoding")
    lines += _beat_plain_line(documents)
    versus = _first_vs_second(documents)
    if versus:
        lines.append("- **Fastest drafter against the runner-up in vLLM** (ratio of their speedups over plain vLLM "
                     "at each K, 95% Welch interval on the log ratios): " + ", ".join(versus))
    return (["## Answers", ""] + lines + [""]) if lines else []


def _band(value: float, low: float | None, high: float | None, fmt: str) -> str:
    return f"{value:{fmt}} [{low:{fmt}}, {high:{fmt}}]" if low is not None and high is not None else f"{value:{fmt}}"


def _al_band(v: dict[str, Any]) -> str:
    return "AL " + _band(v["al"], v["low"], v["high"], ".2f")


def _ranked_acceptance(documents: list[tuple[str, dict[str, Any]]]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """dataset -> [(drafter, its best AL there)] from the highest; a baseline (``is_baseline``) is not a trained
    drafter."""
    by_set: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for name, sets in acceptance_by_dataset(documents).items():
        for dataset, v in sets.items():
            if not v["baseline"]:
                by_set[dataset].append((name, v))
    return {dataset: sorted(rows, key=lambda row: -row[1]["al"]) for dataset, rows in by_set.items()}


def learning_rates(documents: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """drafter -> validation AL gained per doubling of training tokens (``slope``, 95% ``low`` / ``high``), the
    least-squares line of AL on log2(tokens) through its learning curve (at least 3 points)."""
    import statistics

    out = {}
    for name, curve in learning_curves(documents).items():
        points = [(math.log2(tokens), al) for tokens, al in curve if tokens > 0]
        if len(points) < 3:
            continue
        xs, ys = [x for x, _ in points], [y for _, y in points]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx == 0:
            continue
        slope = sum((x - mx) * (y - my) for x, y in points) / sxx
        residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in points)
        half = t975(len(points) - 2) * math.sqrt(residual / (len(points) - 2) / sxx)
        out[name] = {"slope": slope, "low": slope - half, "high": slope + half, "points": len(points)}
    return out


def al_at_equal_time(documents: list[tuple[str, dict[str, Any]]]) -> tuple[float, dict[str, float]] | None:
    """(T, drafter -> validation AL after T seconds of training steps), T the shortest run's training time: each
    curve's tokens become seconds through its drafter's measured training tokens/s, then AL is interpolated
    linearly at T (None without two drafters that have both a curve and a throughput)."""
    throughput = {}
    for _, document in documents:
        if document.get("kind") == "bench.training":
            for name, m in document["metrics"].get("methods", {}).items():
                if _number(m.get("tokens_per_second")) and m["tokens_per_second"] > 0:
                    throughput[name] = float(m["tokens_per_second"])
    curves = {name: [(tokens / throughput[name], al) for tokens, al in curve]
              for name, curve in learning_curves(documents).items() if name in throughput and curve}
    if len(curves) < 2:
        return None
    horizon = min(curve[-1][0] for curve in curves.values())
    values = {}
    for name, curve in curves.items():
        previous = (0.0, None)
        for seconds, al in curve:
            if seconds >= horizon:
                t0, a0 = previous
                values[name] = al if a0 is None or seconds == t0 else a0 + (al - a0) * (horizon - t0) / (seconds - t0)
                break
            previous = (seconds, al)
    return horizon, values


def _first_vs_second(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """At each K two or more trained drafters were served at in vLLM: the fastest one's speedup over the runner-up's
    (by mean log speedup over the repeats), with a Welch interval: whether the winner is separable from second place."""
    import re
    import statistics

    values: dict[str, dict[int, list[float]]] = defaultdict(dict)
    for document, key, m in _all_runs(documents):
        match = re.fullmatch(r"vllm/k(\d+)", key) if document.get("kind") == "bench.vllm" else None
        reps = (m.get("speedup_interval") or {}).get("values")
        if match and isinstance(reps, list) and reps and all(_number(r) and r > 0 for r in reps):
            values[str(document.get("config", {}).get("drafter"))][int(match.group(1))] = [float(r) for r in reps]
    out = []
    for k in sorted({k for runs in values.values() for k in runs}):
        logs = sorted(((statistics.fmean(a), name, a) for name, runs in values.items() if k in runs
                       for a in [[math.log(r) for r in runs[k]]]), reverse=True)
        if len(logs) < 2:
            continue
        (mean_a, first, a), (mean_b, second, b) = logs[0], logs[1]
        diff = mean_a - mean_b
        text = f"K = {k} {first} / {second} {math.exp(diff):.2f}x"
        if len(a) > 1 and len(b) > 1:
            va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
            if va + vb > 0:
                df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
                half = t975(max(1, int(df))) * math.sqrt(va + vb)
                text += f" [{math.exp(diff - half):.2f}, {math.exp(diff + half):.2f}]"
        out.append(text)
    return out


def _drafter_of(label: str) -> str:
    return label.split("/")[0]


def _best_acceptance(sweeps: list[dict[str, Any]]) -> list[str]:
    sets = sorted({d["config"]["dataset"] for d in sweeps})
    best: dict[str, dict[str, tuple[float, str]]] = defaultdict(dict)
    for d in sweeps:
        for label, m in d["metrics"]["methods"].items():
            al = m.get("acceptance_length")
            if label == "plain" or not isinstance(al, int | float) or _false_tree(label, m):
                continue
            name, dataset = _drafter_of(label), d["config"]["dataset"]
            if al > best[name].get(dataset, (0.0, ""))[0]:
                best[name][dataset] = (al, label.split("/")[-1])
    budgets = _budgets(sweeps)
    rows = [[name] + [f"{best[name][s][0]:.2f} ({best[name][s][1]})" if s in best[name] else "" for s in sets]
            + [budgets.get(name, "n/a")] for name in sorted(best, key=lambda n: -max(v[0] for v in best[n].values()))]
    return ["## Headline", "", "Best acceptance length (tokens per target forward) per evaluation set, and the "
            "setting that reached it:", ""] + _table(["drafter", *sets, "training tokens"], rows) + [""]


def round_cost_ratio(m: dict[str, Any], plain: dict[str, Any] | None) -> float | None:
    """R: a speculative round's decode time over a plain step's (recorded, or from both runs' seconds / forwards)."""
    if isinstance(m.get("round_cost_ratio"), int | float):
        return float(m["round_cost_ratio"])
    try:
        r = (m["decode_seconds"] / m["forwards"]) / (plain["decode_seconds"] / plain["forwards"])
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return r if math.isfinite(r) and r > 0 else None


def plausible(speedup: float | None, al: float | None) -> bool:
    """False for a speedup above the physical bound (AL x 1.05): such a ratio is noise, never a result."""
    return speedup is None or al is None or speedup <= al * PHYSICAL_SLACK


def _speedups(d: dict[str, Any]) -> list[str]:
    ranked = []
    plain = d["metrics"]["methods"].get("plain")
    for label, m in d["metrics"]["methods"].items():
        iv = m.get("speedup_interval") or {}
        if label == "plain" or iv.get("mean") is None:
            continue
        ci = f" [{iv['low']:.2f}, {iv['high']:.2f}]" if iv.get("low") is not None else ""
        shown = f"{iv['mean']:.2f}x{ci}" if plausible(iv["mean"], m.get("acceptance_length")) else "flagged (> AL)"
        if m.get("speedup_excluded_repeats"):
            shown += f" ({len(m['speedup_excluded_repeats'])} flagged repeat(s) left out)"
        r = round_cost_ratio(m, plain)
        ranked.append((iv["mean"], [label, f"{m['acceptance_length']:.2f}", shown, f"{r:.2f}" if r else "n/a",
                                    _fmt(m.get("draft_seconds_per_round")), _budgets([d]).get(_drafter_of(label), "n/a")]))
    rows = [row for _, row in sorted(ranked, key=lambda r: -r[0])]
    return [f"Speedup over plain decoding ({d['config'].get('dataset')}, {d['metrics']['repeats']} interleaved "
            "repeats, geometric mean and 95% interval; R = a speculative round's time over a plain step's, the AL "
            "a drafter must exceed to win):", ""] + _table(
        ["method", "AL", "speedup", "R (break-even AL)", "drafter s/round", "training tokens"], rows) + [""]


def _training(d: dict[str, Any]) -> list[str]:
    methods = d["metrics"]["methods"]
    # results written before the chain measurement hold the per-depth product estimate; say which one a row is
    header = ["drafter", "expected AL (validation)", "measured as", "train tokens/s", "peak RSS MiB", "train tokens"]
    # the cores other processes kept busy during each run (results from before this was measured have none)
    loaded = any(_number(m.get("beside_cores")) for m in methods.values())
    rows = []
    for name, m in methods.items():
        if "refused" in m:
            rows.append([name, "does not fit", "", "", "", ""] + ([""] if loaded else []))
            continue
        row = [name, _fmt(m.get("val_expected_al")), m.get("val_expected_al_method", "per-depth product"),
               _fmt(m.get("tokens_per_second")), _fmt((m.get("peak_rss_bytes") or 0) / 2**20),
               _fmt(m.get("train_tokens"))]
        if loaded:
            row.append(_fmt(m.get("beside_cores")) if _number(m.get("beside_cores")) else "not measured")
        rows.append(row)
    out = [f"Training under one budget ({d['metrics'].get('memory_budget')}):", ""]
    out += _table(header + (["other load (cores)"] if loaded else []), rows) + [""]
    busy = [name for name, m in methods.items() if _number(m.get("beside_cores")) and m["beside_cores"] > BUSY_CORES]
    if busy:
        out += [f"Throughput shared the machine for {', '.join(busy)} (other processes kept more than "
                f"{BUSY_CORES} of a core busy on average): compare their tokens/s with care.", ""]
    return out


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
        r_v = round_cost_ratio(m["vllm"], m.get("vllm/plain"))
        r_r = round_cost_ratio(m["reference"], m.get("reference/plain"))
        rows.append([d["config"].get("drafter"), f"{m['vllm']['acceptance_length']:.2f}",
                     f"{m['vllm']['speedup_interval']['mean']:.2f}x", f"{r_v:.2f}" if r_v else "n/a",
                     f"{m['reference']['acceptance_length']:.2f}", f"{m['reference']['speedup_interval']['mean']:.2f}x",
                     f"{r_r:.2f}" if r_r else "n/a", budget if budget is not None else "n/a"])
    return ["vLLM against the reference engine (same checkpoint, prompts and K; R = round time over a plain step):",
            ""] + _table(["drafter", "vLLM AL", "vLLM speedup", "vLLM R", "reference AL", "reference speedup",
                          "reference R", "training tokens"], rows) + [""]


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


# --------------------------------------------------------------------------------------------------------- figures


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _all_runs(documents: list[tuple[str, dict[str, Any]]]):
    for name, document in documents:
        for key, run_label, figures in _keyed_runs(name, document):
            yield document, key or run_label, figures


def _dataset(document: dict[str, Any]) -> str | None:
    return document.get("config", {}).get("dataset") or document.get("metrics", {}).get("dataset")


def _reference_engine(document: dict[str, Any]) -> bool:
    engine = document.get("config", {}).get("engine") or document.get("metrics", {}).get("engine") or "reference"
    return document.get("kind") != "bench.vllm" and engine == "reference"


def _prompt_interval(document: dict[str, Any], method: str) -> tuple[float | None, float | None]:
    """95% Student-t interval of the per-prompt-turn AL of ``method`` (None without two prompt turns)."""
    import statistics

    values = [r["acceptance_length"] for r in document.get("per_prompt") or []
              if isinstance(r, dict) and r.get("method") == method and _number(r.get("acceptance_length"))]
    if len(values) < 2:
        return None, None
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    centre = statistics.fmean(values)
    return max(1.0, centre - half), centre + half  # AL is at least 1 (the target's own token)


def acceptance_by_dataset(documents: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """drafter -> dataset -> its best AL there (``al``, ``low`` / ``high`` interval, ``setting``); reference engine,
    plain decoding and chain-only drafters' "tree" rows left out."""
    best: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for document, key, m in _all_runs(documents):
        al, dataset = m.get("acceptance_length", m.get("al")), _dataset(document)
        if not dataset or not _number(al) or not _reference_engine(document) or key == "plain":
            continue
        if _false_tree(key, m):
            continue
        name = _drafter_name(key, m)
        if name in ("plain", "None") or al <= best[name].get(dataset, {}).get("al", 0.0):
            continue
        low, high = _prompt_interval(document, key)
        best[name][dataset] = {"al": float(al), "low": low, "high": high, "setting": key.rsplit("/", 1)[-1],
                               "baseline": is_baseline(m)}
    return dict(best)


def _speed_dataset(documents: list[tuple[str, dict[str, Any]]]) -> str | None:
    """The evaluation set of the speed measurement with the most repeats (speedups of different sets differ)."""
    best, repeats = None, 0
    for document, _, m in _all_runs(documents):
        n = int((m.get("speedup_interval") or {}).get("repeats") or (1 if _number(m.get("speedup")) else 0))
        if _reference_engine(document) and n > repeats:
            best, repeats = _dataset(document), n
    return best


def speedup_by_k(documents: list[tuple[str, dict[str, Any]]],
                 engine: str = "reference") -> dict[str, dict[int, dict[str, Any]]]:
    """drafter -> chain K -> speedup over plain decoding (``mean``, ``low`` / ``high``, ``repeats``, ``al``).

    ``engine`` reference: on one evaluation set (``_speed_dataset``), from the run with the most repeats; trees and
    other engines left out. ``engine`` vllm: the vLLM suite's per-K rows (``vllm/kK`` of its ``bench.vllm`` files).
    Either way implausible ratios (above AL x 1.05) are left out."""
    import re

    out: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    dataset = _speed_dataset(documents) if engine == "reference" else None
    for document, key, m in _all_runs(documents):
        if engine == "vllm":
            kind, drafter = document.get("kind"), document.get("config", {}).get("drafter")
            if kind == "bench.vllm":
                match = re.fullmatch(r"vllm/k(\d+)", key)
            elif kind == "bench.speed" and _quiet_batch1(document) and drafter:
                # a per-drafter job's speed file: its own rows are "<drafter>/k<K>" (n-gram is the baseline)
                match = re.fullmatch(re.escape(str(drafter)) + r"/k(\d+)", key)
            elif (kind == "bench.acceptance" and not _reference_engine(document) and not is_baseline(m)
                  and int(document.get("metrics", {}).get("concurrency") or 1) == 1 and m.get("drafter")):
                # `specframe bench acceptance --engine vllm` (make demo's run): "<drafter>/k<K>" rows at batch 1
                match = re.fullmatch(r".+/k(\d+)", key)
                drafter = m["drafter"]
            else:
                match = None
            if match is None:
                continue
            k, name = int(match.group(1)), str(drafter)
        else:
            k = m.get("k")
            if not _reference_engine(document) or key == "plain" or not _number(k) or k < 1 or _is_tree(key, m):
                continue
            if _dataset(document) != dataset:
                continue
            name = _drafter_name(key, m)
        iv = m.get("speedup_interval") or {}
        mean = iv.get("mean") if _number(iv.get("mean")) else m.get("speedup")
        al = m.get("acceptance_length", m.get("al"))
        if not _number(mean) or not plausible(mean, al):
            continue
        repeats = int(iv.get("repeats") or 1)
        if repeats > out[name].get(int(k), {}).get("repeats", 0):
            low, high = iv.get("low"), iv.get("high")
            both = m.get("speedup_interval_prompts") or {}
            if _number(both.get("low")) and _number(both.get("high")):  # prompt turns and repeats together
                mean, low, high = both["estimate"], both["low"], both["high"]
            r = m.get("round_cost_ratio")
            out[name][int(k)] = {"mean": float(mean), "low": low if _number(low) else None,
                                 "high": high if _number(high) else None, "repeats": repeats,
                                 "al": al if _number(al) else None, "round_cost_ratio": r if _number(r) else None}
    return {name: points for name, points in out.items() if points}


def _quiet_batch1(document: dict[str, Any]) -> bool:
    metrics = document.get("metrics", {})
    return bool(metrics.get("quiet")) and int(metrics.get("concurrency") or 1) == 1


def tokens_to_beat_plain(documents: list[tuple[str, dict[str, Any]]], goal: float = 1.0) -> dict[str, dict[str, Any]]:
    """Where no drafter is faster than plain vLLM at batch 1: per drafter with a served learning curve on the set its
    speed was timed on (``SPEED_SET``) and a measured R at that curve's K, the training tokens at which the curve
    reaches AL = ``goal`` x R (``specframe.projection.project``: the fit of served AL on log2 tokens, with an
    interval carrying the AL's bootstrap, R's interval and the fit's error). {} when a drafter is already faster
    than plain or no drafter has such a curve."""
    from specframe.projection import project, served_curves

    speed = speedup_by_k(documents, "vllm")
    if _one_is_faster(speed):
        return {}
    out = {}
    for (name, dataset), (k, points) in sorted(served_curves(documents).items()):
        v = speed.get(name, {}).get(k)
        if dataset != SPEED_SET or v is None or v["round_cost_ratio"] is None or not v["al"]:
            continue
        # R = AL / speedup on the timed turns, so the speedup's interval is R's
        r_low = v["al"] / v["high"] if v["high"] else None
        r_high = v["al"] / v["low"] if v["low"] else None
        found = project(points, v["round_cost_ratio"], r_low, r_high, goal=goal, k=k)
        if found is not None:
            out[name] = found.as_dict()
    return out


def _one_is_faster(speed: dict[str, dict[int, dict[str, Any]]]) -> bool:
    """Whether some drafter at some K is faster than plain decoding beyond its interval (then nothing is projected)."""
    return any(v["low"] is not None and v["low"] > 1 for points in speed.values() for v in points.values())


#: the set a per-drafter job times speed on, so the set whose served curve a projection reads
SPEED_SET = "mt-bench"


def _count(tokens: float) -> str:
    if not math.isfinite(tokens):
        return "unbounded"
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if tokens >= size:
            return f"{tokens / size:.3g}{unit}"
    return f"{tokens:.0f}"


def _projection_cell(name: str, e: dict[str, Any]) -> str:
    from specframe.projection import order_of_magnitude

    head = f"{name} (K = {e['k']}, AL {e['al_now']:.2f} now, {e['needed_al']:.2f} needed)"
    if e["al_now"] >= e["needed_al"]:
        return f"{head}: there already at {_count(e['tokens_now'])} (more repeats, not more training, would separate it)"
    if e["tokens"] is None:
        return f"{head}: its served curve does not rise, no estimate"
    if e["within_reach"]:
        return f"{head}: about {_count(e['tokens'])} [{_count(e['low'])}, {_count(e['high'])}]"
    return (f"{head}: not within reach of this budget ({_count(e['tokens_now'])} tokens): of order "
            f"{order_of_magnitude(e['tokens'])} tokens (95% interval {order_of_magnitude(e['low'])} to "
            f"{order_of_magnitude(e['high'])})")


def _beat_plain_line(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    speed = speedup_by_k(documents, "vllm")
    if not speed or _one_is_faster(speed):
        return []
    lines = []
    for goal, what in ((1.0, "to break even with"), (GOAL_SPEEDUP, f"for {GOAL_SPEEDUP}x")):
        needs = tokens_to_beat_plain(documents, goal)
        cells = [_projection_cell(name, e) for name, e in
                 sorted(needs.items(), key=lambda item: item[1]["tokens"] or math.inf)]
        if cells:
            lines.append(f"- **Training tokens {what} plain vLLM at batch 1** (no drafter is faster yet; whole-set "
                         f"{SPEED_SET} AL served in vLLM at the run's kept checkpoints, fitted on log2 tokens, must "
                         "reach the goal x R measured at the K timed; 95% interval carrying the AL's bootstrap, R's "
                         "interval and the fit's error; R is this machine's; a projection): " + "; ".join(cells))
    if not lines:
        lines.append(f"- **Training tokens for {GOAL_SPEEDUP}x plain vLLM at batch 1:** no projection: it needs "
                     f"whole-set {SPEED_SET} AL served in vLLM at three or more checkpoints of a run (a per-drafter "
                     f"job's `curve-{SPEED_SET}.json`); the validation curve is not used (teacher-forced on the "
                     "training distribution, it grows faster than served acceptance)")
    return lines


def _vllm_by_k(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    speed = speedup_by_k(documents, "vllm")
    if not speed:
        return []
    ks = sorted({k for points in speed.values() for k in points})
    rows = []
    for name in sorted(speed):
        cells = []
        for k in ks:
            v = speed[name].get(k)
            if v is None:
                cells.append("")
                continue
            band = f" [{v['low']:.2f}, {v['high']:.2f}]" if v["low"] is not None else ""
            cells.append(f"{v['mean']:.2f}x{band}, AL {v['al']:.2f}" if v["al"] is not None else
                         f"{v['mean']:.2f}x{band}")
        rows.append([name, *cells])
    return ["Speedup over plain vLLM by K, in vLLM (95% interval over interleaved repeats; AL beside it):", ""] + \
        _table(["drafter", *[f"K = {k}" for k in ks]], rows) + [""]


def learning_curves(documents: list[tuple[str, dict[str, Any]]]) -> dict[str, list[tuple[float, float]]]:
    """drafter -> [(training tokens, validation AL)] from the results that recorded a learning curve."""
    out: dict[str, list[tuple[float, float]]] = {}
    for _, key, m in _all_runs(documents):
        curve = [(p["train_tokens"], p["val_expected_al"]) for p in m.get("learning_curve") or []
                 if isinstance(p, dict) and _number(p.get("train_tokens")) and _number(p.get("val_expected_al"))]
        if curve:
            out[_drafter_name(key, m)] = sorted(curve)
    return out


def memory_by_context(documents: list[tuple[str, dict[str, Any]]]) -> tuple[dict[str, dict[str, list]], float | None]:
    """(drafter -> series label -> [(tokens, peak GiB)], the memory budget in GiB or None) from runs with points."""
    from specframe.memory import parse_size

    out: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(dict)
    budget = None
    for document, key, m in _all_runs(documents):
        points = [(p["seq_len"], p["peak_bytes"] / 2**30) for p in m.get("points") or []
                  if isinstance(p, dict) and _number(p.get("seq_len")) and _number(p.get("peak_bytes"))]
        if not points:
            continue
        series = f"{m['mask_builder']} + {m['partitioner']}" if m.get("mask_builder") and m.get("partitioner") \
            else (m.get("mask_builder") or key)
        out[_drafter_name(key, m)][series] = sorted(points)
        text = document.get("metrics", {}).get("memory_budget") or document.get("config", {}).get("memory_budget")
        if text and budget is None:
            try:
                budget = parse_size(text) / 2**30
            except Exception:  # noqa: BLE001 - an unreadable budget only loses its line
                budget = None
    return dict(out), budget


def _outside_legend(ax) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8)


def _capped(items: list, note: list[str], what: str) -> list:
    if len(items) > MAX_SERIES:
        note.append(f"{len(items) - MAX_SERIES} more {what} in the tables")
    return items[:MAX_SERIES]


def _memory_figure(plt: Any, memory: dict[str, dict[str, list]], budget: float | None) -> Any:
    """One axes with every (drafter, combination) when they fit MAX_SERIES, else one panel per drafter; the budget
    as a dashed line, context lengths on a log axis labelled with the measured lengths, legend outside."""
    from matplotlib.ticker import NullFormatter

    label = f"memory budget ({budget:g} GiB)" if budget is not None else None
    total = sum(len(v) for v in memory.values())
    panels = [(None, [(f"{name} ({series})", pts) for name in sorted(memory) for series, pts in memory[name].items()])] \
        if total <= MAX_SERIES else [(name, sorted(memory[name].items(), key=lambda kv: -max(t for t, _ in kv[1])))
                                     for name in sorted(memory)]
    cols = min(2, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 if len(panels) == 1 else 4.5 * cols, 4 if len(panels) == 1
                                                  else 3.4 * rows), squeeze=False, sharey=True)
    handles: dict[str, Any] = {}
    for ax, (title, series) in zip(axes.flat, panels):
        lengths = set()
        for name, pts in series[:MAX_SERIES]:
            (line,) = ax.plot([t for t, _ in pts], [g for _, g in pts], "o-", label=name, color=colour(name))
            handles.setdefault(name, line)
            lengths |= {t for t, _ in pts}
        if budget is not None:
            handles.setdefault(label, ax.axhline(budget, color="red", lw=1.0, ls="--", label=label))
        ax.set(xscale="log", xlabel="context length (tokens)", ylabel="peak memory (GiB)")
        ax.set_xticks(sorted(lengths), [str(int(t)) for t in sorted(lengths)])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(bottom=0)
        if title:
            ax.set_title(title)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle("Peak training memory against context")
    fig.tight_layout()
    if len(panels) == 1:
        _outside_legend(axes.flat[0])
    else:
        fig.legend(list(handles.values()), list(handles), loc="upper left", bbox_to_anchor=(1.0, 0.95), fontsize=8)
    return fig


#: one colour per drafter in every figure (matplotlib's tab10, in the order the drafters shipped); any other name gets
#: a colour of its own from the rest of the palette, fixed by the name, never by its position in a figure
COLOURS = {"peagle": "tab:blue", "eagle3": "tab:orange", "pard": "tab:green", "parallelspec": "tab:red",
           "dflash": "tab:purple", "ngram": "tab:gray", "plain": "black"}
_SPARE = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def colour(name: str) -> str:
    """The colour of a drafter (or of a method label such as ``peagle/k3``) in every figure."""
    import zlib

    drafter = name.split("/")[0].split(":")[0].strip()
    return COLOURS.get(drafter) or _SPARE[zlib.crc32(drafter.encode()) % len(_SPARE)]


def figures(documents: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, str, Any]]:
    """The report's figures as (file name, the question it answers, matplotlib Figure); only those whose data the
    results hold. Nothing is written: ``render`` saves them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    acceptance = acceptance_by_dataset(documents)
    if acceptance:
        note: list[str] = []
        names = _capped(sorted(acceptance, key=lambda n: -max(v["al"] for v in acceptance[n].values())), note,
                        "drafters")
        sets = sorted({s for n in names for s in acceptance[n]})
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            xs, heights, err = [], [], [[], []]
            for j, dataset in enumerate(sets):
                v = acceptance[name].get(dataset)
                if v is None:
                    continue
                xs.append(j - 0.4 + width * (i + 0.5))
                heights.append(v["al"])
                err[0].append(max(0.0, v["al"] - v["low"]) if v["low"] is not None else 0.0)
                err[1].append(max(0.0, v["high"] - v["al"]) if v["high"] is not None else 0.0)
            ax.bar(xs, heights, width, yerr=err, capsize=2, label=name, color=colour(name))
        ax.set_xticks(range(len(sets)), sets)
        ax.set(xlabel="evaluation set", ylabel="acceptance length (tokens per target forward)",
               title="Acceptance length per drafter (best setting, 95% interval over prompt turns)")
        ax.title.set_fontsize(9)
        _outside_legend(ax)
        made.append(("al-by-dataset.png", "Which drafter accepts the most tokens on each evaluation set?", fig))
    engine = "vllm" if speedup_by_k(documents, "vllm") else "reference"
    speed = speedup_by_k(documents, engine)
    if speed:
        note = []
        names = _capped(sorted(speed, key=lambda n: -max(v["mean"] for v in speed[n].values())), note, "methods")
        fig, ax = plt.subplots(figsize=(7, 4))
        for name in names:
            ks = sorted(speed[name])
            means = [speed[name][k]["mean"] for k in ks]
            low = [m - (speed[name][k]["low"] if speed[name][k]["low"] is not None else m) for k, m in zip(ks, means)]
            high = [(speed[name][k]["high"] if speed[name][k]["high"] is not None else m) - m for k, m in zip(ks, means)]
            ax.errorbar(ks, means, yerr=[low, high], marker="o", capsize=3, label=name, color=colour(name))
        ax.axhline(1.0, color="grey", lw=1.0, ls="--", label="break-even: plain decoding (1.0)")
        ax.set_xticks(sorted({k for n in names for k in speed[n]}))
        dataset = _speed_dataset(documents) if engine == "reference" else None
        where = " in vLLM" if engine == "vllm" else (f" on {dataset}" if dataset else "")
        ax.set(xlabel="K (draft tokens per round)", ylabel="speedup over plain decoding",
               title=f"Speedup by K{where} (95% interval where repeated)")
        ax.title.set_fontsize(9)
        _outside_legend(ax)
        made.append(("speedup-by-k.png", "Is any drafter faster than plain decoding, and at which K?", fig))
    curves = learning_curves(documents)
    if curves:
        note = []
        fig, ax = plt.subplots(figsize=(7, 4))
        for name in _capped(sorted(curves), note, "drafters"):
            ax.plot([t for t, _ in curves[name]], [a for _, a in curves[name]], "o-", label=name, color=colour(name))
        # a log token axis: AL grows about linearly per doubling of training tokens (``learning_rates``)
        ax.set(xscale="log", xlabel="training tokens (log scale)", ylabel="validation AL (mean accepted chain + 1)",
               title="Learning curves")
        _outside_legend(ax)
        made.append(("learning-curves.png", "How fast does each drafter learn per training token?", fig))
    from specframe.projection import served_curves

    served = served_curves(documents)
    if served:
        fig, ax = plt.subplots(figsize=(7, 4))
        for (name, dataset), (k, points) in sorted(served.items()):
            al = [p.al for p in points]
            err = [[p.al - p.low if p.low is not None else 0.0 for p in points],
                   [p.high - p.al if p.high is not None else 0.0 for p in points]]
            ax.errorbar([p.tokens for p in points], al, yerr=err, marker="o", capsize=3, color=colour(name),
                        ls="-" if dataset == SPEED_SET else "--", label=f"{name} {dataset} (K = {k})")
        # the axis a projection fits on: served AL against log2 training tokens (specframe.projection)
        ax.set(xscale="log", xlabel="training tokens (log scale)", ylabel="whole-set AL served in vLLM",
               title="Served learning curves (95% interval over prompt turns)")
        ax.title.set_fontsize(9)
        _outside_legend(ax)
        made.append(("served-learning-curves.png", "How fast does served acceptance grow with training tokens?", fig))
    memory, budget = memory_by_context(documents)
    if memory:
        made.append(("memory-by-context.png", "How much memory does training need as the context grows?",
                     _memory_figure(plt, memory, budget)))
    return made


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=120, bbox_inches="tight")
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
