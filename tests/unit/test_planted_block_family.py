"""Checks the planted-bug audit of issue 55's shared drafter pieces found unguarded by a fast test (each fails with
the one-line bug named in its docstring planted): the EAGLE family's aux-layer range, the block drafters' trained
elements, checkpoint aux-layer check and export refusal of repeated target layers."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from specframe import api, plugins
from specframe.drafting.block import trained_elements
from specframe.drafting.eagle import aux_layer_ids
from specframe.errors import SpecframeError, UsageError

TINY = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=False)


def test_aux_layer_ids_accepts_exactly_the_targets_layers():
    """Planted: ``0 <= i <= num_layers`` (one past the last layer accepted)."""
    assert aux_layer_ids("eagle3", [0, 2, 3], 4) == [0, 2, 3]
    for bad in ([0, 2, 4], [-1, 1, 2], [0, 1]):
        with pytest.raises(UsageError, match=r"eagle3 needs 3 aux layer ids in 0\.\.3"):
            aux_layer_ids("eagle3", bad, 4)


def test_a_block_trains_depth_d_only_while_targets_0_to_d_are_supervised():
    """Planted: ``gaps[anchor + depth]`` for ``gaps[anchor + depth + 1]`` (the last target's supervision unread)."""
    n = 8
    loss_mask = torch.ones(n + 1, dtype=torch.bool)
    supervised = torch.ones(n, dtype=torch.bool)
    supervised[4] = False  # the target at position 4 is not supervised: a block stops there
    anchor = torch.tensor([2, 2, 2, 2, 5, 5])
    depth = torch.tensor([0, 1, 2, 3, 0, 1])
    # anchor 2: targets at 2, 3 supervised, 4 not (depth 2 stops the block, and every deeper one)
    assert trained_elements(loss_mask, supervised, anchor, depth).tolist() == [True, True, False, False, True, True]
    loss_mask[6] = False  # anchor 5's anchor token x_6 carries no loss: the block is not trained at all
    assert trained_elements(loss_mask, supervised, anchor, depth).tolist() == [True, True, False, False, False, False]


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_a_checkpoint_of_other_aux_layers_is_refused(name, tmp_path):
    """Planted: the recorded aux layers compared with themselves (the check never fires)."""
    cls = plugins.get("drafter", name)
    drafter = cls(TINY, cls.Options(layers=1, block_size=4, aux_layer_ids=[2]))
    drafter.check_checkpoint(tmp_path, {"aux_layer_ids": [2]})
    with pytest.raises(SpecframeError, match=r"trained with aux layers \[1\], this drafter has \[2\]"):
        drafter.check_checkpoint(tmp_path, {"aux_layer_ids": [1]})


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_the_export_refuses_repeated_aux_layers(name):
    """Planted: ``len(set(ids)) > len(ids)`` for ``!=`` (a repeated layer passes). The slow test_dflash one writes
    a folder from a trained target; this one reads the preamble alone."""
    cls = plugins.get("drafter", name)
    drafter = cls(TINY, cls.Options(layers=2, block_size=4, aux_layer_ids=[2, 2]))
    drafter.mask_token_id = 0
    with pytest.raises(api.SpecframeError, match=r"aux layers \[2, 2\] repeat a target layer"):
        drafter.export_weights()
    distinct = cls(TINY, cls.Options(layers=2, block_size=4, aux_layer_ids=[1, 2]))
    distinct.mask_token_id = 0
    assert "fc.weight" in distinct.export_weights()
