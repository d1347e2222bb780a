"""``api.eagle.start_from_target``, which eagle3, peagle and parallelspec call from ``prepare`` (issue 55): the
drafter's token embedding is the target's, its draft vocabulary is installed and its head rows are the target head's
rows of that vocabulary. The drafters' own tests train through these and would pass with a fresh embedding."""

from __future__ import annotations

import pytest
import torch

from specframe import api, plugins
from specframe.targets import load_target
from tests.train_fixtures import build, small_options


@pytest.fixture(scope="module")
def target_and_example(tmp_path_factory):
    torch.manual_seed(0)
    target_dir, _ = build(tmp_path_factory.mktemp("start_from_target"))
    target = load_target(target_dir)
    ids = torch.randint(7, target.config.vocab_size, (24,))
    mask = torch.ones(24, dtype=torch.bool)
    mask[:5] = False
    return target, api.TrainingExample(ids, mask, torch.zeros(24, dtype=torch.long))


@pytest.mark.parametrize("name", ["eagle3", "peagle", "parallelspec"])
def test_prepare_starts_from_the_targets_embedding_vocabulary_and_head_rows(name, target_and_example):
    """Planted: the embedding copy dropped; ``head.weight[: draft.numel()]`` for ``head.weight[draft]``."""
    target, example = target_and_example
    cls = plugins.get("drafter", name)
    drafter = cls(target.config, cls.Options(**small_options()))
    drafter.prepare(target, [example])
    model = drafter.model
    assert torch.equal(model.embed_tokens.weight, target.model.get_input_embeddings().weight)
    draft = model.draft_ids()
    assert draft.numel() == 128 and bool((draft[1:] > draft[:-1]).all())
    assert int(draft[-1]) >= 128  # not the first rows: a draft vocabulary of the data's tokens (ids from 7)
    head = api.eagle.target_head(target)
    assert torch.equal(model.lm_head.weight, head.weight[draft])
