"""The report's figures, matplotlib only: one figure per question, each drawn only when the results hold its data.

- ``al-by-dataset.png``: acceptance length per drafter per evaluation set (grouped bars, each drafter's best setting,
  95% Student-t interval over prompt turns where per-prompt rows exist);
- ``speedup-by-k.png``: speedup over plain decoding per drafter at each chain K, with the 95% interval over repeats
  and the break-even line at 1.0 (a ratio above the physical bound, speedup > AL x 1.05, is left out);
- ``learning-curves.png``: validation AL against training tokens, every drafter on one axis;
- ``served-learning-curves.png``: whole-set AL served in vLLM against training tokens;
- ``memory-by-context.png``: peak training memory against context, one panel per drafter, with the budget line.

At most ``MAX_SERIES`` series share an axes and legends sit outside the data; every drafter keeps one colour in every
figure (``colour``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from specframe.report.questions import (
    SPEED_SET,
    acceptance_by_dataset,
    learning_curves,
    memory_by_context,
    speed_dataset,
    speedup_by_k,
)


#: the most series one axes shows (more would be unreadable; the tables keep every run)
MAX_SERIES = 8


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
        dataset = speed_dataset(documents) if engine == "reference" else None
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


def save_figure(fig, path: Path) -> Path:
    fig.savefig(path, dpi=120, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
