"""A drafter that caps the anchors a training step charges (``Training.max_anchors``, API 14; issue 54, D10): the
engine draws a uniform sample of the anchors whose depth-0 element is charged, leaves out the deeper elements of the
others and charges their depth-0 elements nothing (they stay every later element's context), so the count it checks
and normalises by is the sample's. Below the cap nothing is drawn and a step is the uncapped one, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specframe.drafting.elements import full_grid
from specframe.engine import TrainConfig, segments, train
from specframe.engine import checkpoint as ckpt
from specframe_plugins.partition_peagle import PeaglePartitioner
from tests.train_fixtures import build


def grid(rule: str, n: int = 40, depth: int = 4):
    sup = torch.ones(n, dtype=torch.bool)
    sup[[0, 1, 17]] = False  # a prompt's positions and one more: their depth-0 elements are not eligible
    return full_grid(n, depth).with_visibility(rule), sup


def sampled_step(rule: str, cap: int, seed: int = 0):
    elems, sup = grid(rule)
    kept = segments.anchor_sample(elems, sup, cap, torch.Generator().manual_seed(seed))
    sub = segments.sampled_elements(elems, kept)
    segs = segments.segments(PeaglePartitioner(PeaglePartitioner.Options()), 3, sub)
    segs = segments.uncharge(segs, sub, kept)
    return elems, sup, kept, sub, segs


@pytest.mark.parametrize("rule", ["chain", "block"])
def test_a_step_charges_exactly_the_sampled_anchors_and_keeps_every_context_element(rule):
    elems, sup, kept, sub, segs = sampled_step(rule, cap=5)
    eligible = set(elems.anchor[(elems.depth == 0) & sup[elems.position]].tolist())
    assert int(kept.sum()) == 5 and set(torch.nonzero(kept).squeeze(1).tolist()) <= eligible
    charged = segments.charged(sub, segs, sup)
    assert set(sub.anchor[charged].tolist()) == set(torch.nonzero(kept).squeeze(1).tolist())
    # every depth-0 element stays (the context of later anchors); deeper ones only at the sampled anchors
    assert int((sub.depth == 0).sum()) == int((elems.depth == 0).sum())
    assert bool(kept[sub.anchor[sub.depth > 0]].all())
    # the kept anchors are charged with every element they had: the sample's count, not a fraction of it
    full = sup[elems.position] & kept[elems.anchor]
    assert int(charged.sum()) == int(full.sum())


def test_the_sample_is_uniform_over_the_eligible_anchors_and_seeded():
    elems, sup = grid("block")
    draw = lambda seed: segments.anchor_sample(elems, sup, 5, torch.Generator().manual_seed(seed))  # noqa: E731
    assert torch.equal(draw(3), draw(3)) and not torch.equal(draw(3), draw(4))
    hits = torch.stack([draw(s) for s in range(400)]).sum(0).double()
    eligible = torch.tensor([a not in (0, 1, 17) for a in range(40)])
    assert hits[~eligible].sum() == 0
    rate = hits[eligible] / 400  # each of the 37 eligible anchors is drawn with chance 5 / 37
    assert (rate - 5 / 37).abs().max() < 0.07


def test_no_cap_no_generator_or_few_anchors_draw_nothing():
    elems, sup = grid("block")
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    assert segments.anchor_sample(elems, sup, None, gen) is None
    assert segments.anchor_sample(elems, sup, 5, None) is None  # validation charges every anchor
    assert segments.anchor_sample(elems, sup, 37, gen) is None  # 37 eligible anchors: the cap does not bind
    assert torch.equal(gen.get_state(), state)  # so a later draw of the step (COD) is what it was


# ------------------------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build(tmp_path_factory.mktemp("anchors"))


def run(assets, out, max_anchors):
    target, chat = assets
    options = {"layers": 1, "block_size": 4, "max_anchors": max_anchors}
    train(TrainConfig(drafter="dflash", target=str(target), data=str(chat), output=str(out), seq_len=32, max_steps=2,
                      batch_size=2, val_examples=1, lr=3e-3, mask_builder="dense", drafter_options=options),
          progress=False)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return load_file(str(ckpt.resolve(out) / "model.safetensors")), [m for m in metrics if "elements" in m]


def test_dflash_trains_a_sample_and_a_cap_that_does_not_bind_changes_nothing(assets, tmp_path):
    every, every_steps = run(assets, tmp_path / "every", None)
    above, _ = run(assets, tmp_path / "above", 10_000)
    assert every.keys() == above.keys() and all(torch.equal(every[k], above[k]) for k in every)
    few, few_steps = run(assets, tmp_path / "few", 2)
    assert any(not torch.equal(every[k], few[k]) for k in every)
    assert all(torch.isfinite(v).all() for v in few.values())
    # at most two anchors of a sequence, two sequences a step, three slots a block: at most 12 charged elements, and
    # fewer than every anchor's where a sequence had more than two
    assert all(f["elements"] <= min(12, e["elements"]) for f, e in zip(few_steps, every_steps, strict=True))
    assert any(f["elements"] < e["elements"] for f, e in zip(few_steps, every_steps, strict=True))
