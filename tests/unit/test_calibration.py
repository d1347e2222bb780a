"""Confidence calibration (``specframe.drafting.calibration``, API 8): the prefix ECE a scheduler's estimates are judged by,
and sequential temperature scaling, checked on synthetic chains whose true per-position temperatures are known."""

from __future__ import annotations

import math

import pytest
import torch

from specframe import api
from specframe.drafting.calibration import (
    apply_temperatures,
    fit_temperatures,
    prefix_acceptance,
    prefix_ece,
)


def chains(n: int, temperatures: list[float], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw logits z and verdicts drawn independently per position with P(accept_j) = sigmoid(z_j / T_j): the chance
    of token j given the earlier ones accepted, as a confidence head estimates it."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, len(temperatures), generator=g, dtype=torch.float64) * 2.0 + 0.5
    p = torch.sigmoid(z / torch.tensor(temperatures, dtype=torch.float64))
    return z, torch.rand(p.shape, generator=g, dtype=torch.float64) < p


def test_prefix_ece_is_the_binned_gap_of_the_product():
    probs = torch.tensor([[0.9, 0.5], [0.3, 1.0]], dtype=torch.float64)
    accepted = torch.tensor([[True, False], [True, True]])
    # position 0: predictions 0.9 and 0.3 in their own bins, both accepted: (0.1 + 0.7) / 2;
    # position 1: products 0.45 (prefix rejected) and 0.3 (accepted): (0.45 + 0.7) / 2
    ece = prefix_ece(probs, accepted)
    assert ece["per_position"] == pytest.approx([0.4, 0.575])
    assert ece["mean"] == pytest.approx((0.4 + 0.575) / 2) and ece["anchors"] == 2
    assert prefix_acceptance(accepted).tolist() == [[1.0, 0.0], [1.0, 1.0]]


def test_a_calibrated_estimate_has_a_small_ece_and_a_wrong_one_does_not():
    z, accepted = chains(20000, [1.0, 1.0, 1.0])
    assert prefix_ece(torch.sigmoid(z), accepted)["mean"] < 0.02
    assert prefix_ece(torch.sigmoid(z / 3.0), accepted)["mean"] > 0.05


def test_sequential_scaling_recovers_each_positions_temperature():
    """Position j's temperature is fitted with the earlier ones fixed, against the prefix acceptance: fitting each
    position alone against its prefix (the earlier positions' product left out) would pick other temperatures."""
    truth = [0.5, 2.0, 1.0, 3.0]
    z, accepted = chains(40000, truth, seed=1)
    fitted = fit_temperatures(z, accepted)
    assert fitted.tolist() == pytest.approx(truth, rel=0.1)


def test_fitting_lowers_the_held_out_ece():
    truth = [0.4, 2.5, 1.5]
    z, accepted = chains(30000, truth, seed=2)
    fit, held = slice(0, 15000), slice(15000, None)
    temperatures = fit_temperatures(z[fit], accepted[fit])
    raw = prefix_ece(torch.sigmoid(z[held]), accepted[held])["mean"]
    calibrated = prefix_ece(apply_temperatures(z[held], temperatures), accepted[held])["mean"]
    assert calibrated < 0.5 * raw, (raw, calibrated)


def test_a_position_with_nothing_to_learn_keeps_temperature_one():
    z, accepted = chains(500, [1.0, 1.0, 1.0], seed=3)
    accepted[:, 1] = False  # no prefix of length 2 or 3 is ever accepted
    fitted = fit_temperatures(z, accepted)
    assert fitted[1] == 1.0 and fitted[2] == 1.0 and fitted[0] != 1.0
    assert fit_temperatures(torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.bool)).tolist() == [1.0, 1.0]


def test_apply_temperatures_divides_each_column():
    z = torch.tensor([[2.0, -1.0]])
    out = apply_temperatures(z, torch.tensor([2.0, 0.5, 9.0]))
    assert out[0].tolist() == pytest.approx([1 / (1 + math.exp(-1.0)), 1 / (1 + math.exp(2.0))])


@pytest.mark.parametrize("values, accepted, says", [
    (torch.zeros(3), torch.zeros(3, dtype=torch.bool), "matrices"),
    (torch.zeros(2, 3), torch.zeros(3, 2, dtype=torch.bool), "one shape"),
    (torch.tensor([[math.nan]]), torch.tensor([[True]]), "finite"),
])
def test_bad_inputs_are_refused(values, accepted, says):
    with pytest.raises(ValueError, match=says):
        fit_temperatures(values, accepted)


def test_the_api_exposes_it_and_a_drafter_defaults_to_the_sigmoid():
    assert api.calibration.fit_temperatures is fit_temperatures
    assert int(api.API_VERSION) >= 8  # calibration arrived in API 8; later versions are additive
    logits = torch.tensor([[0.0, 2.0]])
    assert api.Drafter.calibrated_confidence(None, logits)[0].tolist() == pytest.approx([0.5, 1 / (1 + math.exp(-2))])
    assert api.Drafter.calibrate(None, logits, logits > 0) is False  # an API-7 drafter fits nothing


def test_a_drafter_without_confidence_trains_as_before(tmp_path):
    """An API-7 drafter (no ``LossTerms.confidence``): no confidence figures, nothing calibrated, nothing saved again."""
    import json

    from specframe.engine import TrainConfig, train
    from tests.train_fixtures import build, small_options

    target, chat = build(tmp_path / "assets")
    out = tmp_path / "run"
    train(TrainConfig(drafter="peagle", output=str(out), target=str(target), data=str(chat), seq_len=48, max_steps=2,
                      batch_size=2, val_examples=2, mask_builder="dense", drafter_options=small_options(k_train=3)),
          progress=False)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in m for m in metrics)
    assert not any("val_confidence_ece" in m or m.get("calibrated") for m in metrics)
