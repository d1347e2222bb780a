"""Shared pieces of the block drafters' tests (DFlash's and DSpark's, which live in their packages:
packages/specframe-dflash/tests and packages/specframe-dspark/tests): the tiny target as a module fixture, a prepared
drafter with one float64 example, the full element grid under the drafter's visibility rule, and the engine's
per-sequence accumulation with its checks. A test module imports ``target`` (the fixture) and the helpers from here."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from specframe import api, plugins
from specframe.drafting.elements import check_partition, full_grid, position_docs
from specframe.interfaces.drafter import charged_weight
from tests.drafter_helpers import features, tiny_target

SDPA = lambda q, k, v: F.scaled_dot_product_attention(q, k, v)  # noqa: E731


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.set_num_threads(1)
    return tiny_target(tmp_path_factory.mktemp("block-target"))


def make_block(name: str, small: dict[str, Any], target, length: int = 18, docs: int = 1, seed: int = 0, mask=None,
               init: Callable[[api.Drafter, torch.Generator], None] | None = None, **options):
    """Drafter ``name`` at options ``small`` (``options`` on top), prepared and in float64, with one seeded example of
    ``length`` tokens (``docs`` packed documents; the first two unsupervised unless ``mask`` is given) carrying its
    target features. ``init(drafter, generator)`` runs after the drafter is prepared, on the example's generator."""
    torch.manual_seed(seed)
    cls = plugins.get("drafter", name)
    drafter = cls(target.config, cls.Options(**{**small, **options}))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, target.config.vocab_size, (length,), generator=g)
    if mask is None:
        mask = torch.ones(length, dtype=torch.bool)
        mask[:2] = False
    doc = torch.arange(length) * docs // length
    plain = api.TrainingExample(ids, mask, doc)
    drafter.prepare(target, [plain])
    drafter.module().double()
    if init is not None:
        init(drafter, g)
    ex = api.TrainingExample(ids, mask, doc, {k: v.double() for k, v in features(target, ids, drafter).items()})
    return drafter, ex


def grid(drafter, ex, depth=None):
    """The full element grid of ``ex`` at the drafter's depth (or ``depth``) under its visibility rule, and its
    supervision."""
    sup = drafter.supervision(ex)
    n = sup.shape[0]
    return full_grid(n, depth or drafter.depth, position_docs(ex.doc, n)).with_visibility(drafter.visibility), sup


def run(drafter, ex, elems, sup, builder="dense", partitioner="none", parts=1, **builder_options):
    """The engine's per-sequence accumulation (segments, the normaliser ``charged_weight``: the charged elements'
    summed weights, API 14): (normalised loss, grads, hits)."""
    cls = plugins.get("mask builder", builder)
    b = cls(cls.Options(**builder_options)) if builder_options else cls()
    segments = plugins.get("partitioner", partitioner)().partition(elems, parts)
    check_partition(elems, segments, partitioner)
    count = charged_weight(drafter, ex, elems, sup)
    drafter.module().zero_grad(set_to_none=True)
    total, hits = 0.0, 0
    for seg in segments:
        terms = drafter.loss(ex, elems, seg, api.SegmentAttention.build(b, elems.subset(seg.elements)))
        (terms.loss_sum / count).backward()
        total += float(terms.loss_sum.detach())
        hits += int(terms.correct.sum())
        assert terms.count == int((seg.loss_mask & sup[elems.subset(seg.elements).position]).sum())
    grads = {n: p.grad.clone() for n, p in drafter.module().named_parameters() if p.grad is not None}
    return total / count, grads, hits


def reference_weight(ex, elems, sup, gamma=None) -> float:
    """The references' normaliser, written from them (SpecForge ``dflash_family_model.py`` L350-362, L455-458;
    DeepSpec ``loss.py`` L112-114): sum(w) over the trained slots, w = exp(-d / gamma) (1 without decay), a slot
    (a, d) trained when its anchor token x_{a+1} and the targets x_{a+2} .. x_{a+2+d} are supervised."""
    total = 0.0
    for a, d in zip(elems.anchor.tolist(), elems.depth.tolist()):
        if sup[a + d] and ex.loss_mask[a + 1] and bool(sup[a : a + d + 1].all()):
            total += math.exp(-d / gamma) if gamma else 1.0
    return total
