"""The ablation table (``benchmarks/test_ablations.py``, results kind ``bench.ablation``): per drafter, each variant's
final validation chain AL with a bootstrap interval over held-out sequences, its difference against the baseline
(paired over the same sequences), whole-set served AL in vLLM where measured (paired over prompt turns), and the
training tokens and throughput.

The differences are computed here, from each file's own per-sequence record, so a variant finished before or after
its baseline is compared with whichever baseline the results folder holds: never with itself.

A paired interval holds which held-out sequences were drawn, not the training's own randomness (the init, the data
order, COD's draws), which a lever moves as well. The ``reseeded`` control (the baseline retrained with another seed)
measures that once: a lever wins when its difference's interval lies above 0 and its difference is larger than the
control's (one replicate: a floor, not an interval).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from specframe.report.markdown import throughput

KIND = "bench.ablation"
#: the control variant (``benchmarks/presets.py``: the baseline retrained with another seed)
CONTROL = "reseeded"
RESAMPLES = 2000
LEVEL = 0.95


def ratio(rows: Mapping[Any, tuple[float, float]], keys: list[Any] | None = None, offset: float = 0.0) -> float:
    """``offset + sum(num) / sum(den)`` over ``keys`` (default all) of ``rows`` (key -> (num, den)): a pooled
    acceptance length (validation: 1 + accepted / anchors; served: emitted / forwards)."""
    keys = list(rows) if keys is None else keys
    den = sum(rows[k][1] for k in keys)
    return offset + sum(rows[k][0] for k in keys) / den if den else float("nan")


def _percentiles(stats: list[float], level: float) -> tuple[float, float]:
    stats = sorted(s for s in stats if s == s)
    if not stats:
        return float("nan"), float("nan")
    n = len(stats)
    return stats[int((1 - level) / 2 * (n - 1))], stats[int((1 + level) / 2 * (n - 1))]


def interval(rows: Mapping[Any, tuple[float, float]], offset: float = 0.0, *, resamples: int = RESAMPLES,
             seed: int = 0, level: float = LEVEL) -> dict[str, Any]:
    """The pooled ratio with a percentile bootstrap interval, resampling the keys (sequences or prompt turns)."""
    keys = sorted(rows)
    rng = random.Random(seed)
    stats = [ratio(rows, [keys[rng.randrange(len(keys))] for _ in keys], offset) for _ in range(resamples)] if keys else []
    low, high = _percentiles(stats, level)
    return {"estimate": ratio(rows, keys, offset) if keys else float("nan"), "low": low, "high": high,
            "level": level, "units": len(keys)}


def paired_difference(variant: Mapping[Any, tuple[float, float]], baseline: Mapping[Any, tuple[float, float]], *,
                      resamples: int = RESAMPLES, seed: int = 0, level: float = LEVEL) -> dict[str, Any] | None:
    """``ratio(variant) - ratio(baseline)`` over the keys both measured, with a paired bootstrap interval (the same
    resampled keys for both: what one held-out sequence makes easy or hard cancels). None with no key in common."""
    keys = sorted(set(variant) & set(baseline))
    if not keys:
        return None
    rng = random.Random(seed)
    stats = []
    for _ in range(resamples):
        pick = [keys[rng.randrange(len(keys))] for _ in keys]
        stats.append(ratio(variant, pick) - ratio(baseline, pick))
    low, high = _percentiles(stats, level)
    return {"estimate": ratio(variant, keys) - ratio(baseline, keys), "low": low, "high": high, "level": level,
            "units": len(keys)}


def wins(difference: Mapping[str, Any] | None, noise: Mapping[str, Any] | None = None) -> bool:
    """Whether a lever beats the baseline: its difference's interval lies wholly above 0 and, where the control was
    measured (``noise``: the reseeded baseline's difference), its difference exceeds the control's in size."""
    if not difference or difference.get("low") is None or not difference["low"] > 0:
        return False
    return noise is None or noise.get("estimate") is None or difference["estimate"] > abs(noise["estimate"])


def validation_rows(metrics: Mapping[str, Any]) -> dict[int, tuple[float, float]]:
    """A results file's held-out sequences: index -> (accepted depths, anchors)."""
    return {int(i): (float(acc), float(anchors)) for i, anchors, acc in metrics.get("val_per_sequence") or []}


def served_rows(metrics: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """A results file's served prompt turns: id#turn -> (emitted, forwards)."""
    served = metrics.get("served") or {}
    return {k: (float(v["emitted"]), float(v["forwards"])) for k, v in (served.get("per_prompt") or {}).items()}


def differences(variant: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> dict[str, Any]:
    """The variant's validation and served differences against ``baseline`` (metrics of both results files)."""
    if baseline is None or variant.get("variant") == "baseline":
        return {"validation": None, "served": None}
    return {"validation": paired_difference(validation_rows(variant), validation_rows(baseline)),
            "served": paired_difference(served_rows(variant), served_rows(baseline))}


def training_noise(variants: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The control's validation difference against the baseline (metrics by variant name), or None until both ran."""
    if CONTROL not in variants or "baseline" not in variants:
        return None
    return differences(variants[CONTROL], variants["baseline"])["validation"]


def _band(figure: Mapping[str, Any] | None, fmt: str = ".3f", sign: bool = False) -> str:
    if not figure or figure.get("estimate") is None:
        return "n/a"
    f = f"+{fmt}" if sign else fmt
    if figure.get("low") is None or figure.get("high") is None:
        return format(figure["estimate"], f)
    return f"{figure['estimate']:{f}} [{figure['low']:{f}}, {figure['high']:{f}}]"


def _with_interval(value: Any, band: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    band = band or {}
    return {"estimate": value, "low": band.get("low"), "high": band.get("high")}


def _changed(metrics: Mapping[str, Any]) -> str:
    parts = [f"{k}={v}" for k, v in sorted((metrics.get("options_changed") or {}).items())]
    parts += [f"--{k.replace('_', '-')} {v}" for k, v in sorted((metrics.get("schedule") or {}).items())]
    return ", ".join(parts) or "(none)"


def ablations_section(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Markdown lines for the ablation results in ``documents`` (relative name, document); [] when there are none."""
    found = [d for _, d in documents if d.get("kind") == KIND]
    if not found:
        return []
    by_drafter: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for d in found:
        by_drafter[d["metrics"]["drafter"]][d["metrics"]["variant"]] = d["metrics"]
    lines = ["## Ablations: each lever alone at one budget", "",
             "The baseline is the drafters' defaults as they were when the suite began (a default changed since is "
             "set back for every variant, so every lever is compared with the same run). "
             "Validation AL: teacher-forced chain acceptance on the held-out sequences at the last step, 95% bootstrap "
             "over sequences; the difference against the baseline is paired over the same sequences (served: over "
             "the same prompt turns). The reseeded control is the baseline retrained with another seed: how far "
             "training noise alone moves the AL, which these intervals do not hold. A lever wins when its difference's "
             "interval lies above 0 and the difference is larger than the control's (where the control ran). tok/s: "
             "training steps only, with the cores other processes kept busy meanwhile: not a speed comparison "
             "between variants unless that is near 0.", ""]
    header = ["drafter", "variant", "options changed", "validation AL", "vs baseline", "served AL", "served vs baseline",
              "tokens", "tok/s (cores beside)"]
    rows = []
    for drafter in sorted(by_drafter):
        variants = by_drafter[drafter]
        baseline = variants.get("baseline")
        noise = training_noise(variants)
        first = [v for v in ("baseline", CONTROL) if v in variants]
        order = [*first, *sorted(v for v in variants if v not in (*first, "winners")),
                 *(["winners"] if "winners" in variants else [])]
        for name in order:
            m = variants[name]
            diff = differences(m, baseline)
            val = diff["validation"]
            mark = (" (control)" if name == CONTROL else " (wins)" if wins(val, noise) else "")
            served = m.get("served") or {}
            served_al = _with_interval(served.get("acceptance_length"), served.get("acceptance_length_interval"))
            served_label = (f"{_band(served_al, '.2f')} ({served['dataset']}, K={served['k']})"
                            if served else "not measured")
            rows.append([drafter, name, _changed(m), _band(_with_interval(m.get("val_expected_al"), m.get("val_expected_al_interval"))),
                         ("(the baseline)" if name == "baseline" else
                          "no baseline yet" if baseline is None else _band(val, sign=True) + mark),
                         served_label, _band(diff["served"], ".2f", sign=True) if served else "",
                         f"{m.get('train_tokens') or 0:,}", throughput(m)])
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]
