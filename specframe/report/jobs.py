"""The answer of a per-drafter run (``benchmarks/test_jobs.py``): what ``specframe report`` says first when a results
folder holds per-drafter jobs, merging whatever drafters have finished and naming those still missing.

- which drafters are done (their checkpoint hash and training tokens), which are waiting (and why), which the run
  expects and has not reached;
- per evaluation set, the ranking by acceptance length (each method's best K, with the bootstrap interval over
  prompt turns), n-gram among them: whole sets in vLLM, and for a drafter vLLM serves at no K (DSpark on vLLM's CPU
  build) a subset on the reference engine, each row naming its engine and prompt turns;
- per drafter, speed in vLLM at batch 1 and at 4 concurrent requests, at each K, over plain vLLM and over n-gram
  (95% intervals over interleaved repeats), from quiet measurements only; the fastest method at each; speed on the
  reference engine in its own table, for the drafters measured there;
- the learning curves as (training tokens, validation AL) points on the shared token axis.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from specframe.results import is_baseline


def _band(value: float | None, low: float | None, high: float | None, fmt: str = ".2f") -> str:
    if value is None:
        return "n/a"
    if low is None or high is None:
        return format(value, fmt)
    return f"{value:{fmt}} [{low:{fmt}}, {high:{fmt}}]"


def _drafter_folder(name: str) -> str | None:
    parts = name.replace("\\", "/").split("/")
    return parts[0] if len(parts) > 1 else None


def jobs_section(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Markdown lines for the per-drafter jobs in ``documents`` (relative name, document); [] when there are none."""
    jobs = {d["metrics"]["drafter"]: d for _, d in documents if d["kind"] == "bench.job"}
    whole = [(n, d) for n, d in documents if d["kind"] == "bench.acceptance.whole-set"]
    subset = [(n, d) for n, d in documents if d["kind"] == "bench.acceptance.subset"]
    if not jobs and not whole:
        return []
    expected: list[str] = []
    for _, d in whole:
        for name in d.get("config", {}).get("drafters", []):
            if name not in expected:
                expected.append(name)
    done = sorted(n for n, d in jobs.items() if d["metrics"].get("complete"))
    waiting = sorted(n for n, d in jobs.items() if not d["metrics"].get("complete"))
    missing = [n for n in expected if n not in jobs]
    lines = ["## The answer (one job per drafter)", ""]
    lines.append("- **Done:** " + (", ".join(
        f"{n} ({_tokens(jobs[n])} training tokens, checkpoint `{str(jobs[n]['metrics']['checkpoint_hash'])[:19]}`)"
        for n in done) or "none yet"))
    for n in sorted(jobs):
        refused = jobs[n]["metrics"].get("vllm_refused") or {}
        if refused:  # e.g. DFlash below its block: measured at its own K instead
            # the reasons differ only in K: the first says why and which K is served
            first = refused[sorted(refused)[0]]
            lines.append(f"- **Not served by vLLM:** {', '.join(sorted(refused))} ({first})")
    if waiting:
        lines.append("- **Waiting:** " + ", ".join(f"{n} ({jobs[n]['metrics'].get('waiting')})" for n in waiting))
    if missing:
        preset = next((d["config"]["preset"] for _, d in whole if d.get("config", {}).get("preset")), "<preset>")
        lines.append("- **Not yet run:** " + ", ".join(missing) + f" (`make bench PRESET={preset}` continues)")
    lines.append("")
    lines += _ranking(whole + subset)
    lines += _speed(documents, done)
    lines += _served_curves(documents)
    lines += _curves(documents)
    return lines


def _served_curves(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Per set, each drafter's served learning curve: whole-set AL in vLLM at its kept checkpoints and its last one,
    at one K (``specframe.projection.served_curves``), the points a projection reads."""
    from specframe.projection import served_curves

    curves = served_curves(documents)
    if not curves:
        return []
    lines = ["**Served learning curves** (whole-set AL in vLLM at the checkpoints each run kept and its last one, at "
             "one K; 95% bootstrap interval over prompt turns; one token axis for every drafter)", "",
             "| drafter | set | K | (training tokens, AL [interval]) |", "|---|---|---|---|"]
    for (drafter, dataset), (k, points) in sorted(curves.items()):
        cells = ", ".join(f"({p.tokens:,.0f}, {_band(p.al, p.low, p.high)})" for p in points)
        lines.append(f"| {drafter} | {dataset} | {k} | {cells} |")
    return lines + [""]


def _tokens(job: dict[str, Any]) -> str:
    tokens = job["metrics"].get("train_tokens")
    return f"{tokens:,}" if isinstance(tokens, int) else "?"


def _ranking(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Per set: every method at its best K, highest AL first, each row with its engine (vLLM's whole set, or the
    reference engine's subset for a drafter vLLM serves at no K) and prompt turns."""
    best: dict[str, dict[str, tuple[str, dict[str, Any], str]]] = defaultdict(dict)
    for _, d in documents:
        dataset = d["metrics"].get("dataset") or d.get("config", {}).get("dataset")
        engine = _engine(d)
        for label, m in d["metrics"].get("methods", {}).items():
            if label == "plain":
                continue
            # one row per method: a drafter at its best K, and again under each other verifier ("+scheduled")
            method = label.split("/")[0] + ("+" + label.split("+", 1)[1] if "+" in label else "")
            if method not in best[dataset] or m["acceptance_length"] > best[dataset][method][1]["acceptance_length"]:
                best[dataset][method] = (label, m, engine)
    lines = []
    for dataset in sorted(best):
        ranked = sorted(best[dataset].values(), key=lambda item: -item[1]["acceptance_length"])
        lines += [f"**{dataset}: acceptance length** (each method at its best K; 95% bootstrap interval over prompt "
                  "turns; vLLM: the whole set; reference: a subset on specframe's reference engine, for a drafter vLLM "
                  "serves at no K, its prompt turns not the whole set's)", "",
                  "| rank | method | engine | AL | prompt turns | output equal to plain |", "|---|---|---|---|---|---|"]
        for i, (label, m, engine) in enumerate(ranked, 1):
            iv = m.get("acceptance_length_interval") or {}
            lines.append(f"| {i} | {label} | {engine} | "
                         f"{_band(m['acceptance_length'], iv.get('low'), iv.get('high'))} | "
                         f"{m.get('prompt_turns')} | {_equal(m)} |")
        lines.append("")
    return lines


def _engine(document: dict[str, Any]) -> str:
    if document["metrics"].get("engine") != "reference":
        return "vLLM"
    of = document["metrics"].get("subset_of")
    return f"reference ({len(document.get('config', {}).get('prompts', []))} of {of} prompts)" if of else "reference"


def _equal(m: dict[str, Any]) -> str:
    """The share of prompt turns whose output equals plain decoding's (vLLM's whole sets count it per request;
    the reference engine checks every turn and says whether all were)."""
    if m.get("equal_to_plain") is not None:
        return f"{m['equal_to_plain']:.1%}"
    if m.get("lossless") is not None:
        return "all" if m["lossless"] else "not all"
    return "n/a"


def _speed(documents: list[tuple[str, dict[str, Any]]], done: list[str]) -> list[str]:
    """One table per number of requests at once (batch 1 first), quiet measurements only."""
    by_run: dict[tuple[bool, int], list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for name, d in documents:
        if d["kind"] == "bench.speed" and d["metrics"].get("quiet"):
            # vLLM's tables first; the reference engine's (drafters vLLM serves at no K) after them, never mixed in
            reference = d["metrics"].get("engine") == "reference"
            by_run[(reference, int(d["metrics"].get("concurrency") or 1))].append((name, d))
    lines: list[str] = []
    for reference, concurrency in sorted(by_run):
        lines += _speed_table(by_run[(reference, concurrency)], concurrency,
                              "on the reference engine" if reference else "in vLLM")
    return lines


def _speed_table(documents: list[tuple[str, dict[str, Any]]], concurrency: int, engine: str = "in vLLM") -> list[str]:
    rows, fastest, machines = [], None, {}
    where = "at batch 1" if concurrency == 1 else f"at {concurrency} concurrent requests"
    plain = "plain vLLM" if engine == "in vLLM" else "plain decoding"
    for name, d in documents:
        drafter = d.get("config", {}).get("drafter") or _drafter_folder(name)
        methods = d["metrics"]["methods"]
        ratios = d["metrics"].get("ratios", {})
        machines[drafter] = _machine(d)
        # n-gram may be timed at several K (each K its baseline): the fastest is the one a drafter must beat
        baselines = [label for label, m in methods.items() if is_baseline(m)]
        ngram = max(baselines, key=lambda label: _speedup(methods[label]).get("mean") or 0, default=None)
        for label, m in methods.items():
            if label == "plain" or label in baselines:
                continue
            s = _speedup(m)
            rows.append((drafter, label, m, s, _over(ratios, label, ngram) if ngram else None))
            if fastest is None or (s.get("mean") or 0) > (fastest[3].get("mean") or 0):
                fastest = (drafter, label, m, s)
        rows += [("baseline", label, methods[label], _speedup(methods[label]), None) for label in baselines]
    if not rows:
        return []
    per = "" if concurrency == 1 else " (each request's own tokens/s)"
    lines = [f"**Speed {engine} {where}** (MT-Bench turns, interleaved repeats; speedup = tokens/s{per} over "
             f"{plain}'s, 95% interval over prompt turns and repeats together where the file has it, else over "
             "repeats; over n-gram: against the fastest n-gram K of the same run; quiet measurements only)", "",
             "| drafter | method | AL | R (round / plain step) | speedup over plain | over n-gram |",
             "|---|---|---|---|---|---|"]
    for drafter, label, m, s, vs in rows:
        r = m.get("round_cost_ratio")
        lines.append(f"| {drafter} | {label} | {m['acceptance_length']:.2f} | "
                     f"{'' if not isinstance(r, (int, float)) else format(r, '.2f')} | "
                     f"{_band(s.get('mean'), s.get('low'), s.get('high'))}x | "
                     f"{'' if vs is None else _band(vs.get('mean'), vs.get('low'), vs.get('high')) + 'x'} |")
    lines.append("")
    lines += [f"- {drafter}: measured on {text}" for drafter, text in machines.items() if text] + [""]
    if fastest is not None:
        drafter, label, m, s = fastest
        verdict = "faster than" if (s.get("low") or 0) > 1 else (
            "slower than" if s.get("high") is not None and s["high"] < 1 else "not separable from")
        lines += [f"- **Fastest drafter {engine} {where}:** {label}, "
                  f"{_band(s.get('mean'), s.get('low'), s.get('high'))}x {plain}: {verdict} plain decoding", ""]
    return lines


def _speedup(m: dict[str, Any]) -> dict[str, Any]:
    """A method's speedup over plain with its interval: over prompt turns and repeats together when the file holds
    it (``bench.Comparison.ratio_over_prompts``), else over repeats (older files).

    Not the same reading as ``questions.speedup_by_k`` (the answers' and the figure's), on purpose: this table shows
    each quiet speed file's rows as recorded, where ``speedup_by_k`` keeps one row per drafter and K (the one with the
    most repeats), falls back to the pooled ``speedup`` when the interval has no mean, leaves out ratios above the
    physical bound (``stats.PHYSICAL_SLACK``) and takes the prompt-turn interval only when both its ends are finite."""
    iv = m.get("speedup_interval_prompts")
    if iv:
        return {"mean": iv["estimate"], "low": iv["low"], "high": iv["high"]}
    return m.get("speedup_interval") or {}


def _machine(document: dict[str, Any]) -> str:
    """Which machine a speed file was measured on, and its plain step: the same drafter's speedup differs between
    machines mostly through the target's step time (issue 57)."""
    machine = document.get("provenance", {}).get("machine") or {}
    cpu = machine.get("cpu") or {}
    parts = [machine.get("processor") or "an unrecorded CPU"]
    if cpu.get("family"):
        parts.append(f"family {cpu['family']} model {cpu.get('model')}")
    if machine.get("cpu_count"):
        parts.append(f"{machine['cpu_count']} cores")
    step = document["metrics"].get("target_seconds_per_forward")
    text = ", ".join(parts)
    plain = "plain decoding" if document["metrics"].get("engine") == "reference" else "plain vLLM"
    return text + (f"; {plain} step {step * 1000:.1f} ms" if isinstance(step, (int, float)) else "")


def _over(ratios: dict[str, Any], label: str, ngram: str) -> dict[str, Any] | None:
    """``label``'s tokens/s over n-gram's with its interval, from the comparison's pairwise ratios (stored one way
    round: the earlier method over the later)."""
    pair = (ratios.get(f"{label} / {ngram}") or {}).get("otps")
    if pair and pair.get("mean"):
        return pair
    pair = (ratios.get(f"{ngram} / {label}") or {}).get("otps")
    if not pair or not pair.get("mean"):
        return None
    inv = lambda v: None if not v else 1.0 / v  # noqa: E731
    return {"mean": inv(pair["mean"]), "low": inv(pair.get("high")), "high": inv(pair.get("low"))}


def _curves(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    points = {}
    for name, d in documents:
        if d["kind"] != "bench.training" or _drafter_folder(name) is None:
            continue
        for drafter, row in d["metrics"].get("methods", {}).items():
            if row.get("learning_curve"):
                points[drafter] = row["learning_curve"]
    if not points:
        return []
    lines = ["**Learning curves** (validation AL at each evaluation, against the training tokens seen by then: one "
             "token axis for every drafter)", "", "| drafter | (training tokens, validation AL) |", "|---|---|"]
    for drafter, curve in sorted(points.items()):
        cells = ", ".join(f"({p['train_tokens']:,}, {p['val_expected_al']:.3f})" for p in curve
                          if p.get("val_expected_al") is not None)
        lines.append(f"| {drafter} | {cells} |")
    return lines + [""]
