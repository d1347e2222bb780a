"""The loss normaliser of a drafter that weighs its elements (``Drafter.element_weights``, API 14; issue 54, D5): the
engine divides a step's summed loss by the summed weights of its charged elements, known before the first backward,
so a partitioned step gives the gradient of one pass; without the hook the normaliser is the charged count."""

from __future__ import annotations

import pytest
import torch

from specframe import api
from specframe.engine import TrainConfig
from specframe.errors import PluginError
from specframe.interfaces.drafter import charged_weight
from tests.train_fixtures import build, small_options


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build(tmp_path_factory.mktemp("weights"))


def config(assets, out, **kw):
    target, chat = assets
    return TrainConfig(**{**dict(drafter="peagle", output=str(out), target=str(target), data=str(chat), seq_len=48,
                                 max_steps=1, batch_size=2, lr=3e-3, val_examples=1, mask_builder="dense",
                                 grad_clip=1e9, drafter_options=small_options(k_train=3, cod_ratio=1.0)), **kw})


def weigh(elements: api.ElementSet) -> torch.Tensor:
    """Weights with zeros and fractions: depth 1 weighs 0, the others exp(-d / 2) + anchor / 100."""
    w = torch.exp(-elements.depth.double() / 2) + elements.anchor.double() / 100
    return torch.where(elements.depth == 1, torch.zeros_like(w), w)


def weighted_trainer(assets, out, records: list, **kw):
    """A P-EAGLE trainer whose drafter weighs its elements (``weigh``) and whose loss is replaced, keeping the real
    terms' count and verdicts, by sum(w * l) over the charged elements with l = ||theta - c||^2 a known function of
    four parameter entries theta (c = the element's depth / 10 + anchor / 1000). ``records`` collects (w, c) of every
    charged element, so a test computes the expected loss and gradient by hand."""
    from specframe.engine.loop import Trainer

    trainer = Trainer(config(assets, out, **kw))
    drafter = trainer.drafter
    original = drafter.loss
    theta_param = next(p for p in drafter.module().parameters() if p.requires_grad and p.numel() >= 4)

    def loss(example, elements, segment, attention):
        terms = original(example, elements, segment, attention)
        sub = elements.subset(segment.elements)
        charged = segment.loss_mask.to(torch.bool) & drafter.supervision(example).to(torch.bool)[sub.position]
        w = weigh(sub)[charged]
        c = (sub.depth.double() / 10 + sub.anchor.double() / 1000)[charged]
        theta = theta_param.reshape(-1)[:4].double()
        per = ((theta[None, :] - c[:, None]) ** 2).sum(-1)
        records.append((w, c))
        return api.LossTerms((w * per).sum().float(), terms.count, terms.correct, terms.total, hit=terms.hit)

    drafter.element_weights = lambda example, elements: weigh(elements)
    drafter.loss = loss
    return trainer, theta_param


def expected(records, theta: torch.Tensor) -> tuple[float, torch.Tensor]:
    """sum(w * l) / sum(w) and its gradient in theta, by hand from the recorded (w, c)."""
    w = torch.cat([r[0] for r in records])
    c = torch.cat([r[1] for r in records])
    per = ((theta[None, :] - c[:, None]) ** 2).sum(-1)
    grad = (w[:, None] * 2 * (theta[None, :] - c[:, None])).sum(0) / w.sum()
    return float((w * per).sum() / w.sum()), grad


def test_the_engine_divides_by_the_summed_weights(assets, tmp_path):
    records: list = []
    trainer, param = weighted_trainer(assets, tmp_path / "o", records)
    try:
        theta = param.detach().reshape(-1)[:4].double().clone()
        entry = trainer.train_step()
        want, grad = expected(records, theta)
        w = torch.cat([r[0] for r in records])
        n = sum(int(r[0].numel()) for r in records)
        # the planted bug (dividing by the charged count) differs: some weights are 0, the others not 1
        assert entry["elements"] == n and abs(float(w.sum()) - n) > 1.0
        assert entry["train_loss"] == pytest.approx(want, rel=1e-5)
        assert entry["train_loss"] != pytest.approx(want * float(w.sum()) / n, rel=1e-3)
        torch.testing.assert_close(param.grad.reshape(-1)[:4].double(), grad, rtol=1e-5, atol=1e-7)
    finally:
        trainer.close()


def test_a_partitioned_step_gives_the_gradient_of_one_pass(assets, tmp_path):
    grads = []
    for name, kw in (("one", {}), ("four", dict(partitioner="peagle", partitions=4))):
        records: list = []
        trainer, param = weighted_trainer(assets, tmp_path / name, records, **kw)
        try:
            trainer.train_step()
            grads.append({n: p.grad.double().clone() for n, p in trainer.drafter.module().named_parameters()
                          if p.grad is not None})
        finally:
            trainer.close()
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7, msg=n)


class _Weighted:
    name = "w"

    def __init__(self, weights):
        self.weights = weights

    def element_weights(self, example, elements):
        return self.weights


def test_charged_weight_sums_the_charged_elements_and_checks_the_weights():
    from specframe.drafting.elements import full_grid

    elems = full_grid(5, 2)
    sup = torch.tensor([False, True, True, False, True])
    charged = sup[elems.position]
    w = torch.arange(len(elems), dtype=torch.float64) / 4
    assert charged_weight(_Weighted(w), None, elems, sup) == pytest.approx(float(w[charged].sum()))
    # without weights: the charged count (today's normaliser, exactly)
    assert charged_weight(_Weighted(None), None, elems, sup) == float(int(charged.sum()))
    for bad in (w[:-1], -w, w * float("nan"), [1.0] * len(elems)):
        with pytest.raises(PluginError, match="element_weights"):
            charged_weight(_Weighted(bad), None, elems, sup)
