"""Calibration of a drafter's per-token confidence (API 8), for any drafter that estimates, for each draft token,
the chance that the target accepts it (DSpark's confidence head; ``LossTerms.confidence``).

What a scheduler needs is the chance that a whole prefix is accepted: a chain is cut at its first rejection, so the
prefix of length j + 1 is accepted with probability c_0 * c_1 * ... * c_j when c_i is the chance of token i given
that the tokens before it were accepted. Calibration is measured and fitted on that product:

- ``prefix_ece``: the expected calibration error of the predicted prefix acceptance, per prefix length and their
  mean (equal-width bins; as DeepSpec's evaluator reports it), against the observed prefix acceptance (all of the
  first j + 1 tokens accepted).
- ``fit_temperatures``: sequential temperature scaling. Position j's temperature T_j is chosen, with T_0 .. T_{j-1}
  already fixed, to minimise the binary cross-entropy of the calibrated product prefix_{j-1} * sigmoid(z_j / T_j)
  against the observed prefix acceptance of length j + 1. One scalar per position keeps the order of the head's
  estimates (a temperature cannot reorder them), so it corrects over- and under-confidence and nothing else.

Inputs are matrices [anchors, K] of held-out elements with a full chain (every depth supervised), as the training
engine's validation collects them: ``logits`` the head's raw logits, ``accepted`` each element's acceptance under
teacher forcing, in [0, 1]: a verdict (bool, or 0 / 1) or, where the verifying rule accepts with a probability
(speculative sampling: 1 - TV of the two distributions), that probability (``LossTerms.acceptance``, API 12), whose
product along the chain is the expected prefix acceptance. By default the engine hands the top-1 verdicts against
the data token (``LossTerms.hit``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: the temperature search range (log-spaced): wide enough for any head that is not degenerate
T_MIN, T_MAX = 0.05, 20.0
_EPS = 1e-7


def _check(values: torch.Tensor, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, accepted = torch.as_tensor(values), torch.as_tensor(accepted)
    if values.dim() != 2 or values.shape != accepted.shape:
        raise ValueError(f"need matrices [anchors, K] of one shape, got {tuple(values.shape)} and "
                         f"{tuple(accepted.shape)}")
    if not torch.isfinite(values).all():
        raise ValueError("confidence values must be finite")
    accepted = accepted.double()
    if not bool(((accepted >= 0) & (accepted <= 1)).all()):  # also refuses NaN
        raise ValueError("acceptance values must lie in [0, 1]")
    return values.double(), accepted


def prefix_acceptance(accepted: torch.Tensor) -> torch.Tensor:
    """[anchors, K] float: the (expected) acceptance of the first j + 1 tokens, the product of theirs; with
    verdicts, 1 where they were all accepted."""
    return torch.as_tensor(accepted).double().cumprod(1)


def prefix_ece(probs: torch.Tensor, accepted: torch.Tensor, bins: int = 10) -> dict[str, Any]:
    """ECE of the predicted prefix acceptance cumprod(probs) against the observed one: ``per_position`` (one per
    prefix length) and ``mean`` (their mean), with ``anchors`` the rows it was measured on."""
    probs, accepted = _check(probs, accepted)
    if (probs < 0).any() or (probs > 1).any():
        raise ValueError("probabilities must lie in [0, 1]")
    predicted = probs.cumprod(1)
    observed = prefix_acceptance(accepted)
    n, k = probs.shape
    per = []
    for j in range(k):
        p, y = predicted[:, j], observed[:, j]
        index = (p * bins).long().clamp(0, bins - 1)
        gap = (torch.bincount(index, p, minlength=bins) - torch.bincount(index, y, minlength=bins)).abs()
        # sum over bins of (n_b / n) |mean p_b - mean y_b| = sum over bins of |sum p_b - sum y_b| / n
        per.append(float(gap.sum() / n) if n else math.nan)
    return {"mean": float(sum(per) / k) if k and n else math.nan, "per_position": per, "anchors": int(n)}


def apply_temperatures(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """sigmoid(logits[:, j] / T_j) for the first ``logits.shape[1]`` temperatures."""
    logits = torch.as_tensor(logits).double()
    t = torch.as_tensor(temperatures).double()[: logits.shape[-1]]
    return torch.sigmoid(logits / t)


def _bce(prior: torch.Tensor, z: torch.Tensor, y: torch.Tensor, t: float) -> float:
    q = (prior * torch.sigmoid(z / t)).clamp(_EPS, 1 - _EPS)
    return float(-(y * q.log() + (1 - y) * (1 - q).log()).mean())


def _minimise(f, lo: float, hi: float) -> float:
    """The minimum of ``f`` over log T in [lo, hi]: a grid, then golden-section search around its best point
    (deterministic; BCE in log T has no narrow minimum a 1/40 grid step would miss)."""
    grid = [lo + (hi - lo) * i / 40 for i in range(41)]
    values = [f(x) for x in grid]
    best = min(range(len(grid)), key=lambda i: (values[i], abs(grid[i])))
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(40):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    x = (a + b) / 2
    return x if f(x) <= values[best] else grid[best]


def fit_temperatures(logits: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """Sequential temperature scaling: one temperature per position (float64 [K]), each fitted with the earlier
    ones fixed. A position no anchor reaches, or whose verdicts are all one way, keeps T = 1 (nothing to learn)."""
    logits, accepted = _check(logits, accepted)
    n, k = logits.shape
    observed = prefix_acceptance(accepted)
    temperatures = torch.ones(k, dtype=torch.float64)
    prior = torch.ones(n, dtype=torch.float64)
    for j in range(k):
        y = observed[:, j]
        if n and 0 < float(y.sum()) < n:
            z = logits[:, j]
            log_t = _minimise(lambda x, z=z, y=y, prior=prior: _bce(prior, z, y, math.exp(x)),
                              math.log(T_MIN), math.log(T_MAX))
            temperatures[j] = math.exp(log_t)
        prior = prior * torch.sigmoid(logits[:, j] / temperatures[j])
    return temperatures
