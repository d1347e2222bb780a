"""Every drafter with every CPU mask builder and every partitioner: same gradients as the dense single pass, a few
finite training steps, and unsupported combinations refused before training starts."""

from __future__ import annotations

import math

import pytest
import torch

from specframe.engine import TrainConfig, train
from specframe.errors import UsageError
from tests.drafter_helpers import DRAFTERS, accumulate, depth_of, elements, grads, make, tiny_target, zero_grads
from tests.train_fixtures import build

BUILDERS = ("dense", "precomputed", "chunked")
PARTITIONS = (("none", 1), ("peagle", 1), ("peagle", 3))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.set_num_threads(1)
    return tiny_target(tmp_path_factory.mktemp("matrix"))


@pytest.fixture(scope="module")
def reference(target):
    """Dense, unpartitioned gradients of each drafter on a two-document example."""
    out = {}
    for name in DRAFTERS:
        drafter, ex = make(name, target, length=18, docs=2)
        elems, sup = elements(drafter, ex, depth_of(drafter))
        loss = accumulate(drafter, ex, elems, sup)
        out[name] = (loss, grads(drafter))
    return out


@pytest.mark.parametrize("partitioner,parts", PARTITIONS)
@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("name", DRAFTERS)
def test_combination_matches_dense_and_trains(target, reference, name, builder, partitioner, parts):
    drafter, ex = make(name, target, length=18, docs=2)
    elems, sup = elements(drafter, ex, depth_of(drafter))
    loss = accumulate(drafter, ex, elems, sup, builder, partitioner, parts)
    ref_loss, ref_grads = reference[name]
    assert math.isclose(loss, ref_loss, rel_tol=1e-4, abs_tol=1e-6)
    got = grads(drafter)
    assert got.keys() == ref_grads.keys()
    for key, value in got.items():
        torch.testing.assert_close(value, ref_grads[key], rtol=1e-4, atol=1e-6, msg=f"{name} {key}")
    assert any(float(v.abs().sum()) > 0 for v in got.values())

    params = [p for p in drafter.module().parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-2)
    for _ in range(2):
        opt.step()
        zero_grads(drafter)
        assert math.isfinite(accumulate(drafter, ex, elems, sup, builder, partitioner, parts))


def test_unsupported_combinations_are_refused_before_training(tmp_path):
    target, chat = build(tmp_path / "assets")
    base = dict(target=str(target), data=str(chat), seq_len=32, max_steps=2, batch_size=1, val_examples=1)
    # FlexAttention has no CPU backward: the engine refuses the builder at start-up
    with pytest.raises(UsageError, match="does not train on cpu"):
        train(TrainConfig(drafter="eagle3", output=str(tmp_path / "a"), mask_builder="flex",
                          drafter_options={"draft_vocab_size": 64}, **base), progress=False)
    # ParallelSpec has one distinct mask token per depth: a deeper group is refused before any step
    with pytest.raises(UsageError, match="mask tokens"):
        train(TrainConfig(drafter="parallelspec", output=str(tmp_path / "b"), depth=6, mask_builder="dense",
                          drafter_options={"draft_vocab_size": 64, "num_masks": 3}, **base), progress=False)
    assert not (tmp_path / "b" / "latest").exists()
