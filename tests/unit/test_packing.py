"""Packing short conversations into --seq-len sequences: greedy in data order, every token kept once, and a packed
sequence trains exactly as its conversations would alone (per-element losses, every built-in drafter)."""

from __future__ import annotations

import pytest
import torch

from specframe import api, plugins
from specframe.drafting.elements import full_grid, position_docs
from specframe.engine.data import OnlineSource, _Sequences, pack
from tests.drafter_helpers import DRAFTERS, SMALL, features, sharp_tiny_target
from tests.train_fixtures import build

DEPTH = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return sharp_tiny_target(tmp_path_factory.mktemp("packing"))


def test_pack_is_greedy_in_data_order():
    assert pack([5, 4, 3, 8, 1, 1], 10) == [[0, 1], [2], [3, 4, 5]]
    assert pack([10, 10], 10) == [[0], [1]]
    assert pack([], 10) == []
    with pytest.raises(ValueError):
        pack([11], 10)


def test_packing_fills_sequences_and_keeps_every_token_once(tmp_path, target):
    _, chat = build(tmp_path)
    seq_len = 400  # the tiny tokenizer's conversations are 100-odd tokens
    packed = OnlineSource(str(chat), target, None, seq_len, None)
    alone = OnlineSource(str(chat), target, None, seq_len, None, pack=False)
    convs = alone.conversations
    assert len(convs) == len(alone) == 12
    assert 1 < len(packed) < len(convs)
    ids, masks = [], []
    for i in range(len(packed)):
        ex = packed.tokens(i)
        assert ex.input_ids.shape[0] <= seq_len
        group = packed.groups[i]
        # doc numbers the sequence's conversations 0, 1, ... in order, one id per token
        lengths = [convs[j].input_ids.shape[0] for j in group]
        assert ex.doc.tolist() == [d for d, n in enumerate(lengths) for _ in range(n)]
        ids.append(ex.input_ids)
        masks.append(ex.loss_mask)
    # every token of every conversation exactly once, in data order
    assert torch.equal(torch.cat(ids), torch.cat([c.input_ids for c in convs]))
    assert torch.equal(torch.cat(masks), torch.cat([c.loss_mask for c in convs]))
    assert [j for g in packed.groups for j in g] == list(range(len(convs)))
    # greedy: the next conversation did not fit in what a sequence left
    for i, group in enumerate(packed.groups[:-1]):
        used = sum(convs[j].input_ids.shape[0] for j in group)
        assert used + convs[packed.groups[i + 1][0]].input_ids.shape[0] > seq_len


def test_a_conversation_longer_than_seq_len_is_truncated(tmp_path, target):
    _, chat = build(tmp_path)
    source = OnlineSource(str(chat), target, None, 40, None)
    assert len(source) == len(source.conversations)  # each fills a sequence on its own
    assert all(source.tokens(i).input_ids.shape[0] == 40 for i in range(len(source)))


def _conversations(target, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(7, target.config.vocab_size, (n,), generator=g)
        mask = torch.ones(n, dtype=torch.bool)
        mask[:2] = False  # a prompt
        out.append(api.TrainingExample(ids, mask, torch.zeros(n, dtype=torch.long)))
    return out


@torch.no_grad()
def _element_losses(drafter, example):
    """{(anchor, depth): (loss, hit)} of every charged element of ``example``, each alone in the loss (one-hot
    charge over the whole element set: the elements around it are forwarded exactly as in training)."""
    builder = plugins.get("mask builder", "dense")()
    sup = drafter.supervision(example)
    n = sup.shape[0]
    elems = full_grid(n, DEPTH, position_docs(example.doc, n))
    attention = api.SegmentAttention.build(builder, elems)
    out = {}
    for i in sup[elems.position].nonzero().squeeze(1).tolist():
        charge = torch.zeros(len(elems), dtype=torch.bool)
        charge[i] = True
        terms = drafter.loss(example, elems, api.Segment(torch.arange(len(elems)), charge), attention)
        assert terms.count == 1
        out[(int(elems.anchor[i]), int(elems.depth[i]))] = (float(terms.loss_sum), int(terms.correct.sum()))
    return out


@pytest.mark.parametrize("name", DRAFTERS)
def test_packed_sequence_has_the_losses_of_its_conversations_alone(target, name):
    torch.manual_seed(0)
    cls = plugins.get("drafter", name)
    drafter = cls(target.config, cls.Options(**SMALL[name]))
    convs = _conversations(target, [7, 9, 6])
    drafter.prepare(target, convs)
    drafter.module().eval()
    alone = [api.TrainingExample(c.input_ids, c.loss_mask, c.doc, features(target, c.input_ids, drafter))
             for c in convs]
    # the engine's packed sequence: per-conversation features (computed alone) concatenated
    seqs = _Sequences(convs, 64, True, lambda j: alone[j].features)
    assert len(seqs) == 1
    packed = seqs.example(0)

    got = _element_losses(drafter, packed)
    shift = packed.input_ids.shape[0] - drafter.supervision(packed).shape[0]
    want = {}
    start = 0
    for ex in alone:
        for (a, d), value in _element_losses(drafter, ex).items():
            want[(a + start, d)] = value
        start += ex.input_ids.shape[0]
    assert shift in (0, 1)
    assert sorted(got) == sorted(want)  # the same charged elements, no extra one at a document boundary
    for key, (loss, hit) in want.items():
        assert got[key][0] == pytest.approx(loss, rel=1e-4, abs=1e-6), (name, key)
        assert got[key][1] == hit, (name, key)


def test_position_docs_isolates_positions_that_straddle_documents():
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    assert position_docs(doc, 8).tolist() == [0, 0, 0, 1, 1, 2, 2, 2]  # unshifted: the data's own documents
    # shift 1: position i reads x_i's feature and x_{i+1}; positions 2 and 4 straddle a boundary
    assert position_docs(doc, 7).tolist() == [0, 0, 1, 2, 3, 4, 4]
