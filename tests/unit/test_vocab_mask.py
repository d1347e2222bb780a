"""The draft-vocabulary position mask of the EAGLE-family loss (the EAGLE-3 / P-EAGLE reference trainers'
``t2d[target argmax] * loss_mask``): rows whose target top-1 lies outside the draft vocabulary add nothing to the
loss, the count left out comes back in ``LossTerms.masked``, and the option switches it off."""

from __future__ import annotations

import pytest
import torch

from specframe import api

from specframe.drafting import modeling
from specframe.drafting.eagle import in_draft_vocab


def test_masked_rows_add_nothing_and_are_counted():
    torch.manual_seed(0)
    n, h, vocab, vd = 10, 8, 12, 5
    draft_ids = torch.tensor([0, 2, 4, 6, 8])
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    full_head = torch.randn(vocab, h) * 3
    hidden, head, target_hidden = torch.randn(n, h), torch.randn(vd, h), torch.randn(n, h)
    keep = in_draft_vocab(t2d, full_head)(target_hidden)
    assert keep.tolist() == t2d[(target_hidden @ full_head.T).argmax(-1)].tolist()
    assert 0 < int(keep.sum()) < n  # some rows in, some out: the case the mask is for
    per_row = torch.stack([modeling.chunked_forward_kl(hidden[i:i + 1], head, target_hidden[i:i + 1],
                                                       full_head[draft_ids]).loss_sum for i in range(n)])
    plain = modeling.chunked_forward_kl(hidden, head, target_hidden, full_head[draft_ids], chunk=3)
    masked = modeling.chunked_forward_kl(hidden, head, target_hidden, full_head[draft_ids], chunk=3,
                                         position_mask=in_draft_vocab(t2d, full_head))
    torch.testing.assert_close(plain.loss_sum, per_row.sum())
    torch.testing.assert_close(masked.loss_sum, per_row[keep].sum())
    assert masked.dropped == n - int(keep.sum()) and plain.dropped == 0
    assert masked.correct.tolist() == plain.correct.tolist()  # verdicts are reported for every row


@pytest.mark.parametrize("name", ["peagle", "eagle3", "parallelspec"])
def test_drafters_mask_by_default_and_report_what_they_left_out(tmp_path_factory, name):
    from specframe import plugins
    from specframe.drafting.elements import full_grid
    from tests.drafter_helpers import SMALL, features, sharp_tiny_target

    torch.set_num_threads(1)
    target = sharp_tiny_target(tmp_path_factory.mktemp("mask"))
    cls = plugins.get("drafter", name)
    assert cls.Options().vocab_position_mask is True  # the reference behaviour is the default
    ids = torch.randint(7, target.config.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    mask, doc = torch.ones(24, dtype=torch.bool), torch.zeros(24, dtype=torch.long)
    out = {}
    for on in (True, False):
        torch.manual_seed(0)
        drafter = cls(target.config, cls.Options(**{**SMALL[name], "vocab_position_mask": on}))
        drafter.prepare(target, [api.TrainingExample(ids, mask, doc)])
        example = api.TrainingExample(ids, mask, doc, features(target, ids, drafter))
        sup = drafter.supervision(example)
        elems = full_grid(sup.shape[0], 4)
        segment = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
        builder = plugins.get("mask builder", "dense")()
        with torch.no_grad():
            out[on] = drafter.loss(example, elems, segment, api.SegmentAttention.build(builder, elems))
        # what the mask must leave out: charged elements whose target argmax (full vocabulary) is not drafted
        t2d = drafter.module().t2d
        head = target.model.get_output_embeddings().weight
        charged = sup[elems.position]
        final = example.features["final_hidden"]
        expected = int((~t2d[(final[elems.position[charged] + 1] @ head.T).argmax(-1)]).sum())
    assert out[True].masked == expected > 0 and out[False].masked == 0
    assert out[True].count == out[False].count  # the engine's normalisation is unchanged (the reference's mean)
    assert float(out[True].loss_sum) < float(out[False].loss_sum)
    assert out[True].hit.tolist() == out[False].hit.tolist()
