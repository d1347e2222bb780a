"""Sequential temperature scaling by expected calibration error, as the DSpark paper fits it (section 3.2.1: "at each
position j ... a simple 1D grid search to find the optimal temperature scalar that minimizes the Expected Calibration
Error (ECE) of the cumulative product, keeping the already-calibrated scores of all preceding positions fixed").

- The ECE is ``api.calibration.prefix_ece``'s, the figure the engine reports: 10 equal-width bins of the predicted
  prefix acceptance (the cumulative product), sum over bins of |sum predicted - sum observed| / anchors, against the
  observed prefix acceptance (the product of the elements' acceptances: verdicts, or 1 - TV for sampling).
- The grid: 97 log-spaced temperatures over ``api.calibration``'s range [1/20, 20] (1 on it, 6.4% apart). vLLM's
  online STS (``dspark/online_sts.py``) searches 49 over [1/8, 8]; a head trained toward 1 - TV on little data can
  need more than 8. Ties go to the temperature nearest 1, so the fit is deterministic and a head already
  calibrated keeps T = 1.
- A position whose observed prefix acceptance is the same for every anchor (all accepted, all rejected, or no
  anchor) keeps T = 1: the ECE there rewards pushing every estimate to one end, which says nothing of the head.

Cross-entropy (``api.calibration.fit_temperatures``) is the other defensible objective; its optimum differs from the
ECE's whenever the head is miscalibrated unevenly across its range (a test shows such a case).
"""

from __future__ import annotations

import math

import torch

from specframe import api

GRID = torch.logspace(math.log10(api.calibration.T_MIN), math.log10(api.calibration.T_MAX), 97,
                      dtype=torch.float64)
BINS = 10


def position_ece(prior: torch.Tensor, logits: torch.Tensor, observed: torch.Tensor, temperature: float) -> float:
    """ECE of the prefix estimate prior * sigmoid(logits / T) against the observed prefix acceptance (one position)."""
    predicted = (prior * torch.sigmoid(logits / temperature))[:, None]
    # prefix_ece of a one-column matrix is exactly this position's binned gap; its observed column is the product
    return api.calibration.prefix_ece(predicted, observed[:, None], bins=BINS)["per_position"][0]


def fit_temperatures(logits: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """One temperature per position (float64 [K]) for matrices [anchors, K] of raw logits and acceptances in [0, 1],
    position j fitted with positions 0..j-1's already fixed."""
    logits = torch.as_tensor(logits).double()
    accepted = torch.as_tensor(accepted).double()
    # the core's checks (shapes, finite logits, acceptances in [0, 1]) with its message
    api.calibration.prefix_ece(torch.sigmoid(logits), accepted)
    n, k = logits.shape
    observed = api.calibration.prefix_acceptance(accepted)
    temperatures = torch.ones(k, dtype=torch.float64)
    prior = torch.ones(n, dtype=torch.float64)
    for j in range(k):
        y = observed[:, j]
        if n and float(y.max()) > float(y.min()):
            errors = [position_ece(prior, logits[:, j], y, float(t)) for t in GRID]
            best = min(range(len(GRID)), key=lambda i: (errors[i], abs(math.log(float(GRID[i])))))
            temperatures[j] = GRID[best]
        prior = prior * torch.sigmoid(logits[:, j] / temperatures[j])
    return temperatures
