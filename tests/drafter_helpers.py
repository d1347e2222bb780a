"""Shared pieces of the drafter tests: a tiny target with a peaked output distribution, examples with target
features, small drafter options, and the engine's per-segment gradient accumulation in a few lines."""

from __future__ import annotations

from pathlib import Path

import torch

from specframe import api, plugins
from specframe.drafting.elements import cod_sample, full_grid, position_docs
from specframe.targets import load_target
from specframe.testing import accumulate_loss, gradients, target_features
from tests.train_fixtures import build

DRAFTERS = ("peagle", "eagle3", "pard", "parallelspec")
# vocab_position_mask off: these tests check the loss of single elements against an unmasked reference, and with a
# 128-token draft vocabulary of the random tiny target many elements' target top-1 lies outside it (the mask itself is
# tested in tests/unit/test_vocab_mask.py)
SMALL = {
    "peagle": {"layers": 2, "draft_vocab_size": 128, "k_train": 4, "vocab_position_mask": False},
    "eagle3": {"draft_vocab_size": 128, "ttt_steps": 4, "vocab_position_mask": False},
    "pard": {"layers": 1, "k_train": 4},
    "parallelspec": {"draft_vocab_size": 128, "k_train": 4, "vocab_position_mask": False},
}


def sharp_tiny_target(root: Path, sharpen: float = 30.0):
    """The shared tiny random target, its lm_head scaled so the target distribution is peaked (a random target is
    near uniform, so a distillation loss would start near zero and say little)."""
    target_dir, _ = build(root)
    target = load_target(target_dir)
    with torch.no_grad():
        target.model.get_output_embeddings().weight.mul_(sharpen)
    return target


# the drafter's target features, as the contract suite computes them
features = target_features


def make(name: str, target, length: int = 20, seed: int = 0, docs: int = 1, **options):
    """A prepared drafter and one example of ``length`` tokens (``docs`` packed documents), seeded."""
    torch.manual_seed(seed)
    cls = plugins.get("drafter", name)
    drafter = cls(target.config, cls.Options(**{**SMALL[name], **options}))
    g = torch.Generator().manual_seed(seed)
    # ids 7.. avoid the special and reserved tokens that mask-token rules pick
    ids = torch.randint(7, target.config.vocab_size, (length,), generator=g)
    mask = torch.ones(length, dtype=torch.bool)
    mask[:3] = False
    doc = torch.zeros(length, dtype=torch.long)
    if docs > 1:
        doc = torch.arange(length) * docs // length
    plain = api.TrainingExample(ids, mask, doc)
    drafter.prepare(target, [plain])
    return drafter, api.TrainingExample(ids, mask, doc, features(target, ids, drafter))


def depth_of(drafter: api.Drafter) -> int:
    return int(type(drafter).training(drafter.options).depth)  # its declared default (API 6)


def elements(drafter: api.Drafter, example: api.TrainingExample, depth: int, seed: int = 0):
    """The engine's element rule: COD when the drafter declares a ratio < 1, else the full grid."""
    sup = drafter.supervision(example)
    doc = position_docs(example.doc, sup.shape[0])
    declared = type(drafter).training(drafter.options)
    if declared.cod_ratio < 1.0:
        g = torch.Generator().manual_seed(seed)
        return cod_sample(sup, depth, declared.cod_ratio, declared.cod_min_ratio, generator=g, doc=doc), sup
    return full_grid(sup.shape[0], depth, doc), sup


# the engine's per-segment accumulation and the gradients it leaves: the plugin authors' test kit's, not a copy
accumulate = accumulate_loss
grads = gradients


def zero_grads(drafter) -> None:
    for p in drafter.module().parameters():
        p.grad = None


def overfit(drafter, example, depth: int, steps: int, lr: float = 1e-2) -> list[float]:
    """Adam on one fixed example (fixed element set); the losses per step."""
    elems, sup = elements(drafter, example, depth)
    params = [p for p in drafter.module().parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    drafter.module().train()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(accumulate(drafter, example, elems, sup))
        opt.step()
    return losses
