"""Unsupported combinations are refused before training starts. (Every drafter with every CPU mask builder and
partitioner giving the dense single pass's gradients is the drafter contract's check: tests/contract/test_contract.py.)"""

from __future__ import annotations

import pytest

from specframe.engine import TrainConfig, train
from specframe.errors import UsageError
from tests.train_fixtures import build


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
