"""The report's sentences: the questions answered with their intervals (``answers``), and the headline tables of each
results kind (acceptance, speed, training, memory, vLLM), each only from what was measured."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from specframe.report.markdown import banded, format_cell, table
from specframe.report.questions import (
    SPEED_SET,
    al_at_equal_time,
    learning_rates,
    one_is_faster,
    plausible,
    ranked_acceptance,
    round_cost_ratio,
    speedup_by_k,
    tokens_to_beat_plain,
)
from specframe.report.runs import all_runs, drafter_of, false_tree, is_finite_number, token_budgets
from specframe.stats import mean_text, t975


#: a training throughput measured while other processes kept more than this many cores busy, on average, is flagged
BUSY_CORES = 0.25


#: the speedup over plain decoding the comparison aims for (issue 29's goal for the best drafter at batch 1)
GOAL_SPEEDUP = 1.3


def answers(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The comparison's questions answered in sentences, each with its interval and only from what was measured:
    the highest AL at the full budget per evaluation set, which drafter learns fastest per training token and per
    CPU-second, which is fastest in vLLM and by how much over plain vLLM, and P-EAGLE against EAGLE-3 there."""
    lines = []
    for dataset, ranked in sorted(ranked_acceptance(documents).items()):
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
                         f"{name} {banded(v['slope'], v['low'], v['high'], '+.3f')}" for name, v in ranked))
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
        lines.append(f"- **Fastest in vLLM:** {name} at K = {k}, {banded(v['mean'], v['low'], v['high'], '.2f')}x "
                     f"plain vLLM's tokens/s (AL {v['al']:.2f}): {verdict} plain decoding")
    lines += _beat_plain_line(documents)
    versus = _first_vs_second(documents)
    if versus:
        lines.append("- **Fastest drafter against the runner-up in vLLM** (ratio of their speedups over plain vLLM "
                     "at each K, 95% Welch interval on the log ratios): " + ", ".join(versus))
    return (["## Answers", ""] + lines + [""]) if lines else []


def _al_band(v: dict[str, Any]) -> str:
    return "AL " + banded(v["al"], v["low"], v["high"], ".2f")


def _first_vs_second(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """At each K two or more trained drafters were served at in vLLM: the fastest one's speedup over the runner-up's
    (by mean log speedup over the repeats), with a Welch interval: whether the winner is separable from second place."""
    import re
    import statistics

    values: dict[str, dict[int, list[float]]] = defaultdict(dict)
    for document, key, m in all_runs(documents):
        match = re.fullmatch(r"vllm/k(\d+)", key) if document.get("kind") == "bench.vllm" else None
        reps = (m.get("speedup_interval") or {}).get("values")
        if match and isinstance(reps, list) and reps and all(is_finite_number(r) and r > 0 for r in reps):
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


def _best_acceptance(sweeps: list[dict[str, Any]]) -> list[str]:
    sets = sorted({d["config"]["dataset"] for d in sweeps})
    best: dict[str, dict[str, tuple[float, str]]] = defaultdict(dict)
    for d in sweeps:
        for label, m in d["metrics"]["methods"].items():
            al = m.get("acceptance_length")
            if label == "plain" or not isinstance(al, int | float) or false_tree(label, m):
                continue
            name, dataset = drafter_of(label), d["config"]["dataset"]
            if al > best[name].get(dataset, (0.0, ""))[0]:
                best[name][dataset] = (al, label.split("/")[-1])
    budgets = token_budgets(sweeps)
    rows = [[name] + [f"{best[name][s][0]:.2f} ({best[name][s][1]})" if s in best[name] else "" for s in sets]
            + [budgets.get(name, "n/a")] for name in sorted(best, key=lambda n: -max(v[0] for v in best[n].values()))]
    return ["## Headline", "", "Best acceptance length (tokens per target forward) per evaluation set, and the "
            "setting that reached it:", ""] + table(["drafter", *sets, "training tokens"], rows) + [""]


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
                                    format_cell(m.get("draft_seconds_per_round")), token_budgets([d]).get(drafter_of(label), "n/a")]))
    rows = [row for _, row in sorted(ranked, key=lambda r: -r[0])]
    return [f"Speedup over plain decoding ({d['config'].get('dataset')}, {d['metrics']['repeats']} interleaved "
            "repeats, geometric mean and 95% interval; R = a speculative round's time over a plain step's, the AL "
            "a drafter must exceed to win):", ""] + table(
        ["method", "AL", "speedup", "R (break-even AL)", "drafter s/round", "training tokens"], rows) + [""]


def _training(d: dict[str, Any]) -> list[str]:
    methods = d["metrics"]["methods"]
    # results written before the chain measurement hold the per-depth product estimate; say which one a row is
    header = ["drafter", "expected AL (validation)", "measured as", "train tokens/s", "peak RSS MiB", "train tokens"]
    # the cores other processes kept busy during each run (results from before this was measured have none)
    loaded = any(is_finite_number(m.get("beside_cores")) for m in methods.values())
    rows = []
    for name, m in methods.items():
        if "refused" in m:
            rows.append([name, "does not fit", "", "", "", ""] + ([""] if loaded else []))
            continue
        row = [name, format_cell(m.get("val_expected_al")), m.get("val_expected_al_method", "per-depth product"),
               format_cell(m.get("tokens_per_second")), format_cell((m.get("peak_rss_bytes") or 0) / 2**20),
               format_cell(m.get("train_tokens"))]
        if loaded:
            row.append(format_cell(m.get("beside_cores")) if is_finite_number(m.get("beside_cores")) else "not measured")
        rows.append(row)
    out = [f"Training under one budget ({d['metrics'].get('memory_budget')}):", ""]
    out += table(header + (["other load (cores)"] if loaded else []), rows) + [""]
    busy = [name for name, m in methods.items() if is_finite_number(m.get("beside_cores")) and m["beside_cores"] > BUSY_CORES]
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
                     format_cell(m["peak_bytes"] / 2**20) if n and m.get("peak_bytes") else ""])
    return [f"Longest trainable context under {d['metrics'].get('memory_budget')} (measured):", ""] + table(
        ["drafter", "tokens", "mask builder + partitioner", "peak MiB there"], rows) + [""]


def _vllm_beside_reference(documents: list[dict[str, Any]]) -> list[str]:
    rows = []
    for d in documents:
        m = d["metrics"]["methods"]
        budget = d["provenance"].get("token_budget")
        r_v = round_cost_ratio(m["vllm"], m.get("vllm/plain"))
        r_r = round_cost_ratio(m["reference"], m.get("reference/plain"))
        rows.append([d["config"].get("drafter"), f"{m['vllm']['acceptance_length']:.2f}",
                     mean_text(m['vllm']['speedup_interval']), f"{r_v:.2f}" if r_v else "n/a",
                     f"{m['reference']['acceptance_length']:.2f}", mean_text(m['reference']['speedup_interval']),
                     f"{r_r:.2f}" if r_r else "n/a", budget if budget is not None else "n/a"])
    return ["vLLM against the reference engine (same checkpoint, prompts and K; R = round time over a plain step):",
            ""] + table(["drafter", "vLLM AL", "vLLM speedup", "vLLM R", "reference AL", "reference speedup",
                          "reference R", "training tokens"], rows) + [""]


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
    if not speed or one_is_faster(speed):
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
        table(["drafter", *[f"K = {k}" for k in ks]], rows) + [""]


# the headline sections, one per results kind (``specframe.report.kinds.KINDS`` names each and the page runs it)


def acceptance_section(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """``bench.acceptance``: the best acceptance length per evaluation set over the K sweeps, then one speedup table
    per repeated speed run."""
    acceptance = [d for _, d in documents if d["kind"] == "bench.acceptance"]
    sweeps = [d for d in acceptance if d.get("config", {}).get("ks")]
    speed = [d for d in acceptance if d.get("config", {}).get("k") and d.get("metrics", {}).get("repeats", 1) > 1]
    out = _best_acceptance(sweeps) if sweeps else []
    for d in speed:
        out += _speedups(d)
    return out


def training_section(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """``bench.training``: expected AL, throughput and memory of each drafter trained under one budget."""
    return [line for _, d in documents if d["kind"] == "bench.training" for line in _training(d)]


def memory_section(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """``bench.memory``: the longest trainable context of each drafter under the memory budget."""
    return [line for _, d in documents if d["kind"] == "bench.memory" for line in _longest_context(d)]


def vllm_section(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """``bench.vllm``: vLLM beside the reference engine per drafter, then the speedup over plain vLLM by K."""
    served = [d for _, d in documents if d["kind"] == "bench.vllm"]
    return _vllm_beside_reference(served) + _vllm_by_k(documents) if served else []
