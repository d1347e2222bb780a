"""Train/serve consistency of every built-in drafter, without vLLM: the training forward's prediction at element
(a, d) is the token ``propose`` drafts at slot d after the same prefix.

The training side is the drafter's own ``loss`` (the engine's path: element grid, one segment, the mask builder's
attention) charged with one element at a time; its prediction is read where the loss consumes the drafter's logits
(``modeling.chunked_forward_kl``, or PARD's ``chunked_cross_entropy``) as the argmax of hidden @ lm_head^T, mapped to a
target id. Autoregressive drafters are teacher-forced in training, so the sequence carries the drafted tokens after
the prefix (what the served drafter fed itself). A drafter whose training reads an input serving does not (P-EAGLE's
mask slots reading the anchor's features instead of ``mask_hidden``) predicts differently here.
"""

from __future__ import annotations

import sys

import pytest
import torch

from specframe import api, plugins

from specframe.drafting import modeling
from specframe.drafting.elements import full_grid
from tests.drafter_helpers import DRAFTERS, depth_of, make, sharp_tiny_target

#: drafters whose position i reads x_{i+1} with the target's feature g_i (docs/design.md section 8); PARD reads x_i
SHIFTED = {"peagle", "eagle3", "parallelspec"}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.set_num_threads(1)
    return sharp_tiny_target(tmp_path_factory.getbasetemp() / "shared-train-assets")


class Predictions:
    """Records the argmax of the logits every loss kernel call sees (one row per charged element)."""

    def __init__(self, monkeypatch, drafter) -> None:
        self.rows: list[torch.Tensor] = []
        real_kl = modeling.chunked_forward_kl

        def kl(hidden, weight, *args, **kwargs):
            self.rows.append((hidden.detach().float() @ weight.detach().float().T).argmax(-1))
            return real_kl(hidden, weight, *args, **kwargs)

        monkeypatch.setattr(modeling, "chunked_forward_kl", kl)
        module = sys.modules[type(drafter).__module__]
        if hasattr(module, "chunked_cross_entropy"):
            real_ce = module.chunked_cross_entropy

            def ce(hidden, head, *args, **kwargs):
                self.rows.append((hidden.detach().float() @ head.detach().float().T).argmax(-1))
                return real_ce(hidden, head, *args, **kwargs)

            monkeypatch.setattr(module, "chunked_cross_entropy", ce)

    def take(self) -> torch.Tensor:
        rows, self.rows = torch.cat(self.rows) if self.rows else torch.zeros(0, dtype=torch.long), []
        return rows


def to_target(drafter, draft_ids: torch.Tensor) -> torch.Tensor:
    module = drafter.module()
    return module.draft_ids()[draft_ids] if hasattr(module, "draft_ids") else draft_ids


def served(drafter, example, p: int, k: int) -> list[int]:
    """``propose(k)`` after the prompt ids[:p] and the verifier's bonus token ids[p]."""
    ids = example.input_ids
    aux = example.features.get("aux_hidden")
    feats = (lambda rows: {"aux_hidden": rows}) if aux is not None else (lambda rows: {})
    drafter.start(ids[:p], feats(aux[:p]) if aux is not None else {})
    drafter.accept(ids[p : p + 1], feats(aux[p - 1 : p]) if aux is not None else {})
    return drafter.propose(k).tokens.tolist()


def trained(drafter, example, anchor: int, k: int, record: Predictions) -> list[int]:
    """The training forward's prediction at (anchor, d) for d < k, one charged element per loss call."""
    sup = drafter.supervision(example)
    n = sup.shape[0]
    elements = full_grid(n, k, example.doc[example.doc.shape[0] - n :])
    builder = plugins.get("mask builder", "dense")()
    attention = api.SegmentAttention.build(builder, elements)
    out = []
    for d in range(k):
        charged = (elements.anchor == anchor) & (elements.depth == d)
        assert charged.sum() == 1 and bool(sup[anchor + d]), (anchor, d)
        terms = drafter.loss(example, elements, api.Segment(torch.arange(len(elements)), charged), attention)
        assert terms.count == 1
        row = record.take()
        assert row.numel() == 1, f"expected one charged row, the loss kernel saw {row.numel()}"
        out.append(int(to_target(drafter, row)[0]))
    return out


@pytest.mark.parametrize("name", DRAFTERS)
@pytest.mark.parametrize("p", [6, 11])
def test_training_prediction_equals_the_served_draft(target, monkeypatch, name, p):
    drafter, example = make(name, target, length=20, seed=p)
    k = depth_of(drafter)
    module = drafter.module().eval()
    with torch.no_grad():
        draft = served(drafter, example, p, k)
        assert len(draft) == k
        # the sequence the served drafter saw: the prefix, then its own drafted tokens (teacher forcing in training)
        forced = example.input_ids.clone()
        forced[p + 1 : p + k] = torch.tensor(draft[: k - 1])
        teacher = api.TrainingExample(forced, example.loss_mask, example.doc, example.features)
        record = Predictions(monkeypatch, drafter)
        anchor = p - 1 if name in SHIFTED else p
        got = trained(drafter, teacher, anchor, k, record)
    module.train()
    assert got == draft, f"{name}: training predicts {got} at anchor {anchor}, serving drafts {draft}"


def test_peagle_mask_slots_are_driven_by_mask_hidden(target):
    """P-EAGLE's mask slots read the learned ``mask_hidden`` (vLLM's layout feeds it to every mask slot): the loss of
    deeper elements depends on it and trains it, and drafting after the first slot changes with it."""
    drafter, example = make("peagle", target, length=20, seed=3)
    model = drafter.module()
    elements = full_grid(drafter.supervision(example).shape[0], depth_of(drafter))
    deep = elements.depth > 0
    attention = api.SegmentAttention.build(plugins.get("mask builder", "dense")(), elements)
    terms = drafter.loss(example, elements, api.Segment(torch.arange(len(elements)), deep), attention)
    terms.loss_sum.backward()
    assert model.mask_hidden.grad is not None and bool(model.mask_hidden.grad.abs().sum() > 0)
    with torch.no_grad():
        before = served(drafter, example, 9, 4)
        model.mask_hidden.mul_(-50.0)
        after = served(drafter, example, 9, 4)
    assert before[0] == after[0]  # slot 0 is the real token's, no mask slot involved
    assert before[1:] != after[1:], "the mask slots' drafts ignore mask_hidden"
