"""Intervals and plausibility checks over speed and acceptance measurements, shared by the benchmark harness
(``specframe.bench``) and the reports (``specframe.report``).

A leaf module (numpy and attrs only):

- ``t975``: the two-sided 95% Student-t critical value (no scipy);
- ``Interval``: a ratio over repeats (geometric mean, 95% Student-t interval on the log ratios);
- ``speed_flags``: the repeats whose speedup cannot be trusted (above the physical bound ``PHYSICAL_SLACK`` or more
  than ``OUTLIER_FACTOR`` off the median);
- ``two_way_ratio``: a pooled ratio with an interval over prompt turns and repeats together.

A speedup measured on a fixed set of prompt turns, repeated a few times, holds two kinds of variation: the turns
themselves (another sample of prompts accepts more or less, and costs more or less per token) and the timing of each
repeat (the machine's noise). An interval over the repeats alone (``Interval``) holds only the second.
``two_way_ratio`` resamples both at once (a two-way, or "pigeonhole", bootstrap: prompt turns and repeats drawn with
replacement independently, every cell of the chosen rows and columns kept), so its interval covers a new draw of
prompts on a new run of the same machine.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np


# two-sided 95% Student-t critical values by degrees of freedom (no scipy here); beyond 30, the normal's 1.96 is
# within 2% of the true value
_T975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
    11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
    21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042,
}


def t975(df: int) -> float:
    """The two-sided 95% Student-t critical value for ``df`` degrees of freedom."""
    return _T975.get(df, 1.96)


#: a speculative round costs at least one target forward, so speedup <= AL; measured ratios above AL x this are noise
PHYSICAL_SLACK = 1.05
#: a repeat whose ratio is more than this factor off the median of the repeats is an outlier
OUTLIER_FACTOR = 2.0


def speed_flags(ratios: Sequence[float], acceptance_lengths: Sequence[float], *, slack: float = PHYSICAL_SLACK,
                outlier: float = OUTLIER_FACTOR) -> list[dict[str, Any]]:
    """The repeats whose speedup cannot be trusted: above the physical bound (ratio > AL x ``slack``, AL of that
    repeat) or more than ``outlier`` x off the median ratio. One entry per flagged repeat: repeat, ratio, reasons."""
    finite = [r for r in ratios if isinstance(r, int | float) and math.isfinite(r) and r > 0]
    median = statistics.median(finite) if finite else float("nan")
    flags = []
    for i, (ratio, al) in enumerate(zip(ratios, acceptance_lengths, strict=True)):
        reasons = []
        if not (isinstance(ratio, int | float) and math.isfinite(ratio) and ratio > 0):
            reasons.append("not a positive finite ratio")
        else:
            if isinstance(al, int | float) and math.isfinite(al) and ratio > al * slack:
                reasons.append(f"above the physical bound (speedup {ratio:.3f} > AL {al:.3f} x {slack})")
            if median > 0 and not 1 / outlier <= ratio / median <= outlier:
                reasons.append(f"more than {outlier:g}x off the median ({ratio:.3f} against {median:.3f})")
        if reasons:
            flags.append({"repeat": i, "ratio": ratio, "reasons": reasons})
    return flags


@attrs.frozen
class Interval:
    """A ratio over repeats: geometric mean, median, 95% Student-t interval on the log ratios (None with one repeat)."""

    mean: float
    median: float
    low: float | None
    high: float | None
    repeats: int
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Interval:
        values = tuple(float(v) for v in values)
        if not values or any(not v > 0 or not math.isfinite(v) for v in values):
            nan = float("nan")
            return cls(nan, nan, None, None, len(values), values)
        logs = [math.log(v) for v in values]
        centre = statistics.fmean(logs)
        low = high = None
        if len(logs) > 1:
            half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
            low, high = math.exp(centre - half), math.exp(centre + half)
        return cls(math.exp(centre), statistics.median(values), low, high, len(values), values)

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def __str__(self) -> str:
        # no repeat left (every one flagged as implausible; a saved file holds NaN as null): say so, never a number
        if self.mean is None or not math.isfinite(self.mean):
            return f"n/a (none of {self.repeats} repeats plausible)" if self.repeats else "n/a (no repeat kept)"
        if self.low is None:
            return f"{self.mean:.3f}"
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def mean_text(interval: Mapping[str, Any] | None, digits: int = 2, unit: str = "x") -> str:
    """A saved interval's mean as a progress line or report cell shows it, or "n/a" where no repeat was kept (every
    one flagged as implausible on a noisy machine; the file holds that mean as null)."""
    mean = (interval or {}).get("mean")
    if mean is None or not math.isfinite(mean):
        return "n/a"
    return f"{mean:.{digits}f}{unit}"


@attrs.frozen
class TwoWayInterval:
    """A percentile interval of a pooled ratio under the two-way bootstrap, and what it was drawn over."""

    estimate: float
    low: float
    high: float
    level: float
    resamples: int
    prompt_turns: int
    repeats: int
    method: str = "two-way bootstrap over prompt turns and repeats"

    def as_dict(self) -> dict:
        return attrs.asdict(self)


def two_way_ratio(num_tokens: Sequence[Sequence[float]], num_seconds: Sequence[Sequence[float]],
                  den_tokens: Sequence[Sequence[float]], den_seconds: Sequence[Sequence[float]], *,
                  resamples: int = 2000, seed: int = 0, level: float = 0.95) -> TwoWayInterval:
    """The ratio of two pooled rates, (sum num_tokens / sum num_seconds) / (sum den_tokens / sum den_seconds), over
    cells [prompt turn, repeat] (each array shaped [turns, repeats], the same cells for both methods: they decoded the
    same turns in the same repeats), with a percentile interval from resampling turns and repeats with replacement.
    Deterministic for a given ``seed``."""
    arrays = [np.asarray(a, dtype=np.float64) for a in (num_tokens, num_seconds, den_tokens, den_seconds)]
    shape = arrays[0].shape
    if len(shape) != 2 or any(a.shape != shape for a in arrays):
        raise ValueError(f"every array must be [prompt turns, repeats] of one shape, got {[a.shape for a in arrays]}")
    turns, repeats = shape
    if turns == 0 or repeats == 0:
        raise ValueError("no cells to resample")
    nt, ns, dt, ds = arrays

    def ratio(rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        # sums over the chosen cells, for a batch of resamples at once: weights[b, i] counts how often turn i (or
        # repeat j) was drawn in resample b, so a cell's weight is the product of its row's and its column's counts
        def pooled(a: np.ndarray) -> np.ndarray:
            return np.einsum("bi,ij,bj->b", rows, a, cols)

        with np.errstate(divide="ignore", invalid="ignore"):
            return (pooled(nt) / pooled(ns)) / (pooled(dt) / pooled(ds))

    rng = np.random.default_rng(seed)
    rows = np.stack([np.bincount(rng.integers(0, turns, turns), minlength=turns) for _ in range(resamples)])
    cols = np.stack([np.bincount(rng.integers(0, repeats, repeats), minlength=repeats) for _ in range(resamples)])
    draws = np.sort(ratio(rows.astype(np.float64), cols.astype(np.float64)))
    estimate = float(ratio(np.ones((1, turns)), np.ones((1, repeats)))[0])
    tail = (1 - level) / 2
    low, high = np.quantile(draws, [tail, 1 - tail], method="lower")
    return TwoWayInterval(estimate, float(low), float(high), level, resamples, turns, repeats)
