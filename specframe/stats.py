"""Intervals over what varies in a speed measurement: which prompts were asked and which repeat timed them.

A leaf module (numpy only): the benchmark harness (``specframe.bench``) and the reports read it.

A speedup measured on a fixed set of prompt turns, repeated a few times, holds two kinds of variation: the turns
themselves (another sample of prompts accepts more or less, and costs more or less per token) and the timing of each
repeat (the machine's noise). An interval over the repeats alone holds only the second. ``two_way_ratio`` resamples
both at once (a two-way, or "pigeonhole", bootstrap: prompt turns and repeats drawn with replacement independently,
every cell of the chosen rows and columns kept), so its interval covers a new draw of prompts on a new run of the
same machine.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np


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
