"""The ``peagle`` partitioner: structure, and the exactness of gradient accumulation within a sequence."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specframe import plugins
from specframe.drafting.elements import check_partition, cod_sample, full_grid
from specframe.errors import UsageError
from specframe.testing import TinyElementModel, accumulated_gradients


def partitioner(name: str = "peagle"):
    return plugins.get("partitioner", name)()


@settings(max_examples=50)
@given(
    st.integers(1, 48), st.integers(1, 5), st.integers(1, 12), st.integers(0, 2**31), st.sampled_from([0.0, 0.1, 0.3])
)
def test_peagle_segments_follow_the_ownership_rule(seq_len, max_depth, num_segments, seed, doc_rate):
    g = torch.Generator().manual_seed(seed)
    doc = torch.cumsum((torch.rand(seq_len, generator=g) < doc_rate).long(), 0)
    elements = cod_sample(torch.rand(seq_len, generator=g) < 0.8, max_depth, generator=g, doc=doc)
    segments = partitioner().partition(elements, num_segments)
    check_partition(elements, segments, "peagle")
    assert 1 <= len(segments) <= num_segments
    # Position ranges: the segment charged with (a, 0); deeper elements go with position a + 1, clamped.
    segment_of_position = torch.full((seq_len,), -1)
    owner = torch.full((len(elements),), -1)
    for s, seg in enumerate(segments):
        owner[seg.elements[seg.loss_mask]] = s
        roots = seg.elements[seg.loss_mask & (elements.depth[seg.elements] == 0)]
        segment_of_position[elements.anchor[roots]] = s
        # Non-charged elements are exactly the depth-0 elements of earlier segments.
        context = seg.elements[~seg.loss_mask]
        assert bool((elements.depth[context] == 0).all())
        assert bool((owner[context] < s).all()) and bool((owner[context] >= 0).all())
        earlier_roots = ((elements.depth == 0) & (owner >= 0) & (owner < s)).nonzero().squeeze(1)
        assert set(context.tolist()) == set(earlier_roots.tolist())
        assert seg.loss_mask.any()
    assert bool((torch.diff(segment_of_position) >= 0).all())  # contiguous position ranges
    deep = elements.depth > 0
    expected = segment_of_position[(elements.anchor[deep] + 1).clamp(max=seq_len - 1)]
    assert torch.equal(owner[deep], expected)


@settings(max_examples=50)
@given(
    st.integers(1, 48), st.integers(1, 5), st.integers(1, 12), st.integers(0, 2**31), st.sampled_from([0.0, 0.1, 0.3])
)
def test_peagle_segments_under_the_block_rule(seq_len, max_depth, num_segments, seed, doc_rate):
    """Block rule: whole blocks owned at their anchor, and the recomputed context is every earlier element of the
    segment's documents (an earlier root sees its block, so it is exact only with it)."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.cumsum((torch.rand(seq_len, generator=g) < doc_rate).long(), 0)
    elements = cod_sample(torch.rand(seq_len, generator=g) < 0.8, max_depth, generator=g, doc=doc, visibility="block")
    segments = partitioner().partition(elements, num_segments)
    check_partition(elements, segments, "peagle")
    assert 1 <= len(segments) <= num_segments
    owner = torch.full((len(elements),), -1)
    for s, seg in enumerate(segments):
        owner[seg.elements[seg.loss_mask]] = s
    segment_of_anchor = torch.full((seq_len,), -1)
    segment_of_anchor[elements.anchor] = owner
    # every element of an anchor is owned by one segment (its block is never split), in contiguous anchor ranges
    assert torch.equal(owner, segment_of_anchor[elements.anchor])
    assert bool((torch.diff(segment_of_anchor[elements.anchor]) >= 0).all())
    for s, seg in enumerate(segments):
        docs = elements.doc[seg.elements[seg.loss_mask]].unique()
        earlier = ((owner < s) & torch.isin(elements.doc, docs)).nonzero().squeeze(1)
        assert set(seg.elements[~seg.loss_mask].tolist()) == set(earlier.tolist())


def test_check_partition_applies_the_block_rule():
    """The chain partition of a block set is incomplete (a root without its deeper block), and check_partition says
    so; the same segments pass for the chain set."""
    from specframe.api import Segment
    from specframe.errors import PluginError

    chain = full_grid(6, 3)
    block = chain.with_visibility("block")
    # (0, 0) and (1, 0) charged first; (0, 1) / (0, 2) after: valid under chain (a root sees only depth-0 context)
    first = torch.tensor([0, 3])
    rest = torch.tensor([i for i in range(len(chain)) if i not in (0, 3)])
    segments = [Segment(first, torch.ones(2, dtype=torch.bool)),
                Segment(torch.arange(len(chain)), torch.isin(torch.arange(len(chain)), rest))]
    check_partition(chain, segments, "t")
    with pytest.raises(PluginError, match=r"not causally complete: it lacks element 1 \(anchor 0, depth 1\)"):
        check_partition(block, segments, "t")


def test_peagle_balances_element_counts_and_splits_unevenly():
    elements = cod_sample(torch.ones(300, dtype=torch.bool), 8, generator=torch.Generator().manual_seed(0))
    for num_segments in (2, 3, 4, 7):
        segments = partitioner().partition(elements, num_segments)
        assert len(segments) == num_segments
        owned = torch.tensor([int(s.loss_mask.sum()) for s in segments])
        assert int(owned.sum()) == len(elements)
        # Each cut lands within half a position's weight (at most 8 elements: a root and a 7-long chain) of its target.
        assert bool(((owned - len(elements) / num_segments).abs() <= 8).all()), owned
        assert all(len(s.elements) < len(elements) for s in segments)


def test_peagle_collapses_when_there_are_more_segments_than_positions():
    elements = full_grid(3, 2)
    segments = partitioner().partition(elements, 50)
    check_partition(elements, segments, "peagle")
    assert len(segments) <= 3
    single = partitioner().partition(full_grid(1, 4), 5)
    assert len(single) == 1 and bool(single[0].loss_mask.all())


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_peagle_rejects_a_bad_number_of_segments(bad):
    with pytest.raises(UsageError, match=str(bad).replace(".", r"\.")):
        partitioner().partition(full_grid(8, 2), bad)


# -------------------------------------------------------------------------------- exactness of the accumulated grad


def _sequence(seed: int, seq_len: int, docs: int, rule: str = "chain"):
    g = torch.Generator().manual_seed(seed)
    supervised = torch.rand(seq_len, generator=g) < 0.8
    # Uneven packed documents: boundaries at 12 and 29 of 40 when there are three.
    doc = torch.bucketize(torch.arange(seq_len), torch.tensor([12, 29][: docs - 1]), right=True)
    elements = cod_sample(supervised, 5, 0.7, 0.2, generator=g, doc=doc, visibility=rule)
    input_ids = torch.randint(0, 32, (seq_len,), generator=g)
    targets = torch.randint(0, 32, (seq_len, 5), generator=g)
    return input_ids, targets, supervised, elements


def _model(seed: int) -> TinyElementModel:
    torch.manual_seed(seed)
    return TinyElementModel(vocab=32, hidden=16, heads=2, layers=2, max_len=64).double().eval()


@pytest.mark.parametrize("rule", ["chain", "block"])
@pytest.mark.parametrize("mask_builder", ["dense", "precomputed", "chunked"])
@pytest.mark.parametrize("docs", [1, 3])
def test_partitioned_gradients_equal_the_single_pass(mask_builder, docs, rule):
    input_ids, targets, supervised, elements = _sequence(seed=docs, seq_len=40, docs=docs, rule=rule)
    assert len(elements.doc.unique()) == docs
    model = _model(0)
    cls = plugins.get("mask builder", mask_builder)
    builder = cls(cls.Options(chunk_size=16)) if mask_builder == "chunked" else cls()

    def grads(segments):
        check_partition(elements, segments, "test")
        return accumulated_gradients(model, input_ids, targets, supervised, elements, segments, builder)

    whole = grads(partitioner("none").partition(elements, 1))
    assert torch.equal(torch.stack([v.abs().sum() for v in whole.values()]) > 0, torch.ones(len(whole), dtype=torch.bool))
    for num_segments in (1, 3, 4):
        segments = partitioner().partition(elements, num_segments)
        assert len(segments) == num_segments
        if num_segments > 1:
            # under the block rule the last segment recomputes every earlier block as context; what it saves is the
            # charged part (every segment is charged with less than the whole sequence)
            forwarded = [len(s.elements) for s in segments] if rule == "chain" else [int(s.loss_mask.sum()) for s in segments]
            assert all(n < len(elements) for n in forwarded)
        got = grads(segments)
        assert got.keys() == whole.keys()
        for name in whole:
            torch.testing.assert_close(got[name], whole[name], atol=1e-12, rtol=1e-10, msg=f"S={num_segments} {name}")


@pytest.mark.parametrize("rule", ["chain", "block"])
def test_a_partition_that_drops_context_changes_the_gradient(rule):
    # The exactness test can fail: forwarding a segment without its recomputed context gives other gradients.
    input_ids, targets, supervised, elements = _sequence(seed=5, seq_len=40, docs=1, rule=rule)
    model = _model(0)
    builder = plugins.get("mask builder", "dense")()
    whole = accumulated_gradients(
        model, input_ids, targets, supervised, elements, partitioner("none").partition(elements, 1), builder
    )
    from specframe.api import Segment

    broken = [Segment(s.elements[s.loss_mask], s.loss_mask[s.loss_mask]) for s in partitioner().partition(elements, 3)]
    got = accumulated_gradients(model, input_ids, targets, supervised, elements, broken, builder)
    assert any(not torch.allclose(got[n], whole[n], atol=1e-8) for n in whole)


def test_block_context_without_its_blocks_changes_the_gradient():
    """Under the block rule the recomputed context must carry the earlier roots' blocks: the chain-rule partition
    (roots only) of the same block set gives other gradients, so the exactness test above can tell them apart."""
    input_ids, targets, supervised, elements = _sequence(seed=5, seq_len=40, docs=1, rule="block")
    model = _model(0)
    builder = plugins.get("mask builder", "dense")()
    whole = accumulated_gradients(
        model, input_ids, targets, supervised, elements, partitioner("none").partition(elements, 1), builder
    )
    from specframe.api import Segment

    roots_only = []
    for seg in partitioner().partition(elements, 3):
        keep = seg.loss_mask | (elements.depth[seg.elements] == 0)  # drop earlier blocks' deeper elements
        roots_only.append(Segment(seg.elements[keep], seg.loss_mask[keep]))
    assert sum(len(s.elements) for s in roots_only) < sum(len(s.elements) for s in partitioner().partition(elements, 3))
    got = accumulated_gradients(model, input_ids, targets, supervised, elements, roots_only, builder)
    assert any(not torch.allclose(got[n], whole[n], atol=1e-8) for n in whole)
