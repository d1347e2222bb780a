"""The data each question of the report needs, shared by its sentences (``answers``) and its figures (``figures``):
acceptance length per evaluation set, speedup by K, learning curves and rates, memory by context, and the training
tokens a drafter would need to beat plain decoding."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from specframe.report.runs import (
    all_runs,
    dataset_of,
    drafter_name,
    false_tree,
    is_finite_number,
    is_tree,
    on_reference_engine,
)
from specframe.results import is_baseline
from specframe.stats import PHYSICAL_SLACK, t975


def ranked_acceptance(documents: list[tuple[str, dict[str, Any]]]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
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
                if is_finite_number(m.get("tokens_per_second")) and m["tokens_per_second"] > 0:
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


def _prompt_interval(document: dict[str, Any], method: str) -> tuple[float | None, float | None]:
    """95% Student-t interval of the per-prompt-turn AL of ``method`` (None without two prompt turns)."""
    import statistics

    values = [r["acceptance_length"] for r in document.get("per_prompt") or []
              if isinstance(r, dict) and r.get("method") == method and is_finite_number(r.get("acceptance_length"))]
    if len(values) < 2:
        return None, None
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    centre = statistics.fmean(values)
    return max(1.0, centre - half), centre + half  # AL is at least 1 (the target's own token)


def acceptance_by_dataset(documents: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """drafter -> dataset -> its best AL there (``al``, ``low`` / ``high`` interval, ``setting``); reference engine,
    plain decoding and chain-only drafters' "tree" rows left out. A per-drafter job's reference-engine subset (a
    drafter vLLM serves at no K) is left out too: the others of its run are measured in vLLM, so it would rank alone;
    the job's own ranking shows it beside them with its engine (``jobs._ranking``)."""
    best: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for document, key, m in all_runs(documents):
        al, dataset = m.get("acceptance_length", m.get("al")), dataset_of(document)
        if not dataset or not is_finite_number(al) or not on_reference_engine(document) or key == "plain":
            continue
        if document.get("kind") == "bench.acceptance.subset":
            continue
        if false_tree(key, m):
            continue
        name = drafter_name(key, m)
        if name in ("plain", "None") or al <= best[name].get(dataset, {}).get("al", 0.0):
            continue
        low, high = _prompt_interval(document, key)
        best[name][dataset] = {"al": float(al), "low": low, "high": high, "setting": key.rsplit("/", 1)[-1],
                               "baseline": is_baseline(m)}
    return dict(best)


def speed_dataset(documents: list[tuple[str, dict[str, Any]]]) -> str | None:
    """The evaluation set of the speed measurement with the most repeats (speedups of different sets differ)."""
    best, repeats = None, 0
    for document, _, m in all_runs(documents):
        n = int((m.get("speedup_interval") or {}).get("repeats") or (1 if is_finite_number(m.get("speedup")) else 0))
        if on_reference_engine(document) and n > repeats:
            best, repeats = dataset_of(document), n
    return best


def speedup_by_k(documents: list[tuple[str, dict[str, Any]]],
                 engine: str = "reference") -> dict[str, dict[int, dict[str, Any]]]:
    """drafter -> chain K -> speedup over plain decoding (``mean``, ``low`` / ``high``, ``repeats``, ``al``).

    ``engine`` reference: on one evaluation set (``speed_dataset``), from the run with the most repeats; trees and
    other engines left out. ``engine`` vllm: the vLLM suite's per-K rows (``vllm/kK`` of its ``bench.vllm`` files).
    Either way implausible ratios (above AL x 1.05) are left out. The per-drafter run's speed table reads each file's
    rows as recorded instead (``jobs._speedup``: no filter, no choice between runs)."""
    import re

    out: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    dataset = speed_dataset(documents) if engine == "reference" else None
    for document, key, m in all_runs(documents):
        if engine == "vllm":
            kind, drafter = document.get("kind"), document.get("config", {}).get("drafter")
            if kind == "bench.vllm":
                match = re.fullmatch(r"vllm/k(\d+)", key)
            elif (kind == "bench.speed" and _quiet_batch1(document) and drafter
                  and document["metrics"].get("engine") != "reference"):  # a job's speed file is vLLM's unless it says
                # a per-drafter job's speed file: its own rows are "<drafter>/k<K>" (n-gram is the baseline)
                match = re.fullmatch(re.escape(str(drafter)) + r"/k(\d+)", key)
            elif (kind == "bench.acceptance" and not on_reference_engine(document) and not is_baseline(m)
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
            if not on_reference_engine(document) or key == "plain" or not is_finite_number(k) or k < 1 or is_tree(key, m):
                continue
            if dataset_of(document) != dataset:
                continue
            name = drafter_name(key, m)
        iv = m.get("speedup_interval") or {}
        mean = iv.get("mean") if is_finite_number(iv.get("mean")) else m.get("speedup")
        al = m.get("acceptance_length", m.get("al"))
        if not is_finite_number(mean) or not plausible(mean, al):
            continue
        repeats = int(iv.get("repeats") or 1)
        if repeats > out[name].get(int(k), {}).get("repeats", 0):
            low, high = iv.get("low"), iv.get("high")
            both = m.get("speedup_interval_prompts") or {}
            if is_finite_number(both.get("low")) and is_finite_number(both.get("high")):  # prompt turns and repeats together
                mean, low, high = both["estimate"], both["low"], both["high"]
            r = m.get("round_cost_ratio")
            out[name][int(k)] = {"mean": float(mean), "low": low if is_finite_number(low) else None,
                                 "high": high if is_finite_number(high) else None, "repeats": repeats,
                                 "al": al if is_finite_number(al) else None, "round_cost_ratio": r if is_finite_number(r) else None}
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
    if one_is_faster(speed):
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


def one_is_faster(speed: dict[str, dict[int, dict[str, Any]]]) -> bool:
    """Whether some drafter at some K is faster than plain decoding beyond its interval (then nothing is projected)."""
    return any(v["low"] is not None and v["low"] > 1 for points in speed.values() for v in points.values())


#: the set a per-drafter job times speed on, so the set whose served curve a projection reads
SPEED_SET = "mt-bench"


def learning_curves(documents: list[tuple[str, dict[str, Any]]]) -> dict[str, list[tuple[float, float]]]:
    """drafter -> [(training tokens, validation AL)] from the results that recorded a learning curve."""
    out: dict[str, list[tuple[float, float]]] = {}
    for _, key, m in all_runs(documents):
        curve = [(p["train_tokens"], p["val_expected_al"]) for p in m.get("learning_curve") or []
                 if isinstance(p, dict) and is_finite_number(p.get("train_tokens")) and is_finite_number(p.get("val_expected_al"))]
        if curve:
            out[drafter_name(key, m)] = sorted(curve)
    return out


def memory_by_context(documents: list[tuple[str, dict[str, Any]]]) -> tuple[dict[str, dict[str, list]], float | None]:
    """(drafter -> series label -> [(tokens, peak GiB)], the memory budget in GiB or None) from runs with points."""
    from specframe.memory import parse_size

    out: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(dict)
    budget = None
    for document, key, m in all_runs(documents):
        points = [(p["seq_len"], p["peak_bytes"] / 2**30) for p in m.get("points") or []
                  if isinstance(p, dict) and is_finite_number(p.get("seq_len")) and is_finite_number(p.get("peak_bytes"))]
        if not points:
            continue
        series = f"{m['mask_builder']} + {m['partitioner']}" if m.get("mask_builder") and m.get("partitioner") \
            else (m.get("mask_builder") or key)
        out[drafter_name(key, m)][series] = sorted(points)
        text = document.get("metrics", {}).get("memory_budget") or document.get("config", {}).get("memory_budget")
        if text and budget is None:
            try:
                budget = parse_size(text) / 2**30
            except Exception:  # noqa: BLE001 - an unreadable budget only loses its line
                budget = None
    return dict(out), budget
