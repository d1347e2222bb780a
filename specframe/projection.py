"""How many training tokens a drafter would need to pay in vLLM: a projection from *served* acceptance.

Speedup at batch 1 is about AL / R (R: a drafting round's cost in plain target steps, measured on the machine), so
``goal`` x plain's speed needs AL = goal x R at the K the speed was timed at. How AL grows with training tokens is
read off the served learning curve: whole-set acceptance in vLLM at several checkpoints of one run (the kept steps'
``curve-<set>.json`` and the final ``acceptance-<set>.json`` of a per-drafter job), fitted as AL = a + b log2(tokens).
Validation AL is not used: it is teacher-forced on held-out examples of the training distribution and grew about
twice as fast per doubling as served MT-Bench AL did between the two finished P-EAGLE runs (issue 57).

The interval is a parametric bootstrap that carries what is known to vary: each point's AL (its bootstrap interval
over prompt turns, read as a normal spread), R (from the speedup's interval: R = AL / speedup), and the fit's own
error (the slope and intercept drawn from their least-squares sampling law, Student-t with n - 2 degrees of freedom
from the draw's residuals). What it cannot carry: whether the curve stays log-linear beyond the run (a learning-rate
schedule that decays to zero flattens a run's last points), and the machine (R differs between machines: a figure
holds for the machine whose speed file it used). Beyond ``REACH`` x the run's own tokens the answer is given as an
order of magnitude only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

#: a projection past this many times the run's own training tokens is stated as an order of magnitude only
REACH = 10.0
Z975 = 1.959963984540054


@attrs.frozen
class Point:
    """One checkpoint of the served learning curve: training tokens seen, whole-set AL and its 95% interval."""

    tokens: float
    al: float
    low: float | None = None
    high: float | None = None


@attrs.frozen
class Projection:
    goal: float
    k: int
    needed_al: float
    al_now: float
    tokens_now: float
    slope: float
    #: None when the curve does not rise (no finite answer)
    tokens: float | None
    low: float | None
    high: float | None
    points: int

    @property
    def within_reach(self) -> bool:
        return self.tokens is not None and self.tokens <= REACH * self.tokens_now

    def as_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "within_reach": self.within_reach}


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least squares of y on x: (intercept, slope, sum of squares of x about its mean)."""
    mx, my = x.mean(), y.mean()
    sxx = float(((x - mx) ** 2).sum())
    slope = float(((x - mx) * (y - my)).sum() / sxx)
    return float(my - slope * mx), slope, sxx


def project(points: Sequence[Point], round_cost: float, round_cost_low: float | None, round_cost_high: float | None,
            *, goal: float, k: int, draws: int = 4000, seed: int = 0, level: float = 0.95) -> Projection | None:
    """The tokens at which the served curve through ``points`` reaches AL = ``goal`` x R (None with fewer than
    three points at distinct token counts)."""
    pts = sorted(points, key=lambda p: p.tokens)
    if len({p.tokens for p in pts}) < 3:
        return None
    x = np.log2([p.tokens for p in pts])
    y = np.array([p.al for p in pts], dtype=np.float64)
    intercept, slope, sxx = _fit(x, y)
    needed = goal * round_cost
    now = pts[-1]

    def tokens_at(a: np.ndarray, b: np.ndarray, r: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            out = np.exp2((goal * r - a) / b)
        return np.where(b > 0, out, np.inf)

    estimate = float(tokens_at(np.array([intercept]), np.array([slope]), np.array([round_cost]))[0])
    if not slope > 0:
        return Projection(goal, k, needed, now.al, now.tokens, slope, None, None, None, len(pts))
    rng = np.random.default_rng(seed)
    spread = np.array([(p.high - p.low) / (2 * Z975) if p.low is not None and p.high is not None else 0.0
                       for p in pts])
    ys = y + rng.standard_normal((draws, len(pts))) * spread
    xm = x.mean()
    centre = ys.mean(axis=1)  # the fitted AL at the curve's mean log-tokens
    b = ((x - xm) * (ys - centre[:, None])).sum(axis=1) / sxx
    dof = len(pts) - 2
    if dof > 0:  # the fit's own error, from each draw's residuals
        sigma = np.sqrt(((ys - centre[:, None] - b[:, None] * (x - xm)) ** 2).sum(axis=1) / dof)
        t = rng.standard_t(dof, size=(2, draws))
        # at the mean of x the fitted value and the slope are uncorrelated: each gets its own error
        b = b + t[0] * sigma / math.sqrt(sxx)
        centre = centre + t[1] * sigma / math.sqrt(len(pts))
    a = centre - b * xm
    if round_cost_low is not None and round_cost_high is not None and round_cost_high > round_cost_low > 0:
        sd = (math.log(round_cost_high) - math.log(round_cost_low)) / (2 * Z975)
        r = np.exp(math.log(round_cost) + rng.standard_normal(draws) * sd)
    else:
        r = np.full(draws, round_cost)
    found = tokens_at(a, b, r)
    tail = (1 - level) / 2
    low, high = (float(v) for v in np.quantile(found, [tail, 1 - tail], method="lower"))
    return Projection(goal, k, needed, now.al, now.tokens, slope, estimate, low, high, len(pts))


def served_curves(documents: Sequence[tuple[str, dict[str, Any]]]) -> dict[tuple[str, str], tuple[int, list[Point]]]:
    """(drafter, set) -> (K, the served curve's points by tokens): a per-drafter job's kept checkpoints
    (``curve-<set>.json``, whose config names each point's label, step and training tokens) and its final checkpoint
    (the same K's row of ``acceptance-<set>.json``, at the job's training tokens)."""
    jobs = {d["metrics"].get("drafter"): d for _, d in documents if d.get("kind") == "bench.job"}
    finals: dict[tuple[str, str], dict[str, Any]] = {}
    curves: dict[tuple[str, str], dict[str, Any]] = {}
    for _, d in documents:
        if d.get("kind") != "bench.acceptance.whole-set":
            continue
        config = d.get("config", {})
        drafter, dataset = config.get("drafter"), config.get("dataset") or d["metrics"].get("dataset")
        if not drafter or not dataset:
            continue
        (curves if "points" in config else finals)[(drafter, dataset)] = d
    out = {}
    for key, curve in curves.items():
        drafter, _ = key
        k = int(curve["config"]["k"])
        methods = curve["metrics"]["methods"]
        points = [_point(p["train_tokens"], methods.get(p["label"])) for p in curve["config"]["points"]
                  if p.get("train_tokens")]
        final, job = finals.get(key), jobs.get(drafter)
        tokens = (job or {}).get("metrics", {}).get("train_tokens")
        if final is not None and tokens:
            points.append(_point(tokens, final["metrics"]["methods"].get(f"{drafter}/k{k}")))
        out[key] = (k, sorted((p for p in points if p is not None), key=lambda p: p.tokens))
    return out


def _point(tokens: float, m: dict[str, Any] | None) -> Point | None:
    if not m or not isinstance(m.get("acceptance_length"), (int, float)):
        return None
    iv = m.get("acceptance_length_interval") or {}
    return Point(float(tokens), float(m["acceptance_length"]), iv.get("low"), iv.get("high"))


def order_of_magnitude(tokens: float) -> str:
    return f"10^{round(math.log10(tokens))}" if tokens > 0 and math.isfinite(tokens) else "unbounded"
