"""COD sampling and the partition check (docs/design.md section 8)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specframe import api
from specframe.drafting.elements import check_partition, cod_sample, full_grid, visible
from specframe.errors import PluginError, UsageError


@st.composite
def sequences(draw, max_len: int = 48):
    seq_len = draw(st.integers(1, max_len))
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    supervised = torch.rand(seq_len, generator=g) < draw(st.floats(0.0, 1.0))
    cuts = torch.rand(seq_len, generator=g) < draw(st.sampled_from([0.0, 0.1, 0.3]))
    doc = torch.cumsum(cuts.long(), 0)
    return supervised, doc, g


@settings(max_examples=50)
@given(
    sequences(),
    st.integers(1, 6),
    st.floats(0.05, 1.0),
    st.floats(0.0, 1.0),
)
def test_cod_follows_the_definition(seq, max_depth, ratio, min_ratio):
    supervised, doc, g = seq
    seq_len = supervised.shape[0]
    e = cod_sample(supervised, max_depth, ratio, min_ratio, generator=g, doc=doc)
    key = (e.anchor * max_depth + e.depth).tolist()
    assert key == sorted(key) and len(set(key)) == len(key)
    assert torch.equal(e.doc, doc[e.anchor]) and e.seq_len == seq_len and e.max_depth == max_depth
    kept = {d: set(e.anchor[e.depth == d].tolist()) for d in range(max_depth)}
    assert kept[0] == set(range(seq_len))
    n_sup = int(supervised.sum())
    for d in range(1, max_depth):
        candidates = {
            a for a in kept[d - 1] if a + d < seq_len and doc[a + d] == doc[a] and bool(supervised[a + d])
        }
        assert kept[d] <= candidates
        assert len(kept[d]) == min(len(candidates), math.floor(n_sup * max(ratio**d, min_ratio) + 1e-9))


def test_cod_is_deterministic_given_the_generator():
    supervised = torch.ones(64, dtype=torch.bool)

    def sample(seed):
        return cod_sample(supervised, 6, generator=torch.Generator().manual_seed(seed))

    a, b, c = sample(1), sample(1), sample(2)
    assert torch.equal(a.anchor, b.anchor) and torch.equal(a.depth, b.depth)
    assert not torch.equal(a.anchor, c.anchor)


def test_cod_chooses_uniformly():
    # 9 candidates at depth 1 (anchors 0..8), floor(10 * 0.5) = 5 kept: each should be kept 5/9 of the time.
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(10)
    runs = 3000
    for _ in range(runs):
        e = cod_sample(torch.ones(10, dtype=torch.bool), 2, 0.5, 0.0, generator=g)
        counts[e.anchor[e.depth == 1]] += 1
    assert counts[9] == 0
    freq = counts[:9] / runs
    assert torch.allclose(freq, torch.full((9,), 5 / 9), atol=0.04), freq


def test_cod_default_ratios_shrink_the_grid():
    e = cod_sample(torch.ones(1000, dtype=torch.bool), 8, generator=torch.Generator().manual_seed(0))
    per_depth = torch.bincount(e.depth).tolist()
    assert per_depth == [1000, 700, 490, 343, 240, 200, 200, 200]
    assert len(e) < 3.5 * 1000


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"max_depth": 0}, UsageError, "max_depth"),
        ({"ratio": 0.0}, UsageError, "0.0"),
        ({"ratio": 1.5}, UsageError, "1.5"),
        ({"min_ratio": -0.1}, UsageError, "-0.1"),
        ({"supervised": torch.ones(4)}, ValueError, "bool"),
        ({"doc": torch.zeros(3, dtype=torch.long)}, ValueError, "(3,)"),
    ],
)
def test_cod_rejects_bad_arguments(kwargs, error, needle):
    args = {"supervised": torch.ones(4, dtype=torch.bool), "max_depth": 3, **kwargs}
    with pytest.raises(error, match=needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        cod_sample(generator=torch.Generator(), **args)


def _brute_force_valid(elements, segments) -> bool:
    charged = torch.zeros(len(elements), dtype=torch.long)
    for seg in segments:
        charged[seg.elements[seg.loss_mask]] += 1
        inside = torch.zeros(len(elements), dtype=torch.bool)
        inside[seg.elements] = True
        needed = visible(elements.subset(seg.elements), elements).any(0)
        if bool((needed & ~inside).any()):
            return False
    return bool((charged == 1).all())


@settings(max_examples=50)
@given(sequences(max_len=24), st.integers(1, 4), st.integers(1, 4), st.data())
def test_check_partition_agrees_with_the_visibility_rule(seq, max_depth, num_segments, data):
    supervised, doc, g = seq
    elements = cod_sample(supervised, max_depth, generator=g, doc=doc)
    n = len(elements)
    owner = torch.tensor(data.draw(st.lists(st.integers(0, num_segments - 1), min_size=n, max_size=n)))
    close = data.draw(st.booleans())
    segments = []
    for s in range(num_segments):
        forwarded = (owner == s) | (torch.rand(n, generator=g) < 0.3)
        if close:  # add everything the forwarded elements see, so the segment is complete
            forwarded |= visible(elements.subset(forwarded), elements).any(0)
        index = forwarded.nonzero().squeeze(1)
        segments.append(api.Segment(index, (owner == s)[index]))
    if _brute_force_valid(elements, segments):
        check_partition(elements, segments, "random")
    else:
        with pytest.raises(PluginError, match="partitioner 'random'"):
            check_partition(elements, segments, "random")


def test_check_partition_names_the_problem():
    e = full_grid(4, 2)
    everything = torch.arange(len(e))
    with pytest.raises(PluginError, match="'p'.*charged 2 times"):
        check_partition(e, [api.Segment(everything, torch.ones(len(e), dtype=torch.bool))] * 2, "p")
    with pytest.raises(PluginError, match="not strictly increasing"):
        check_partition(e, [api.Segment(everything.flip(0), torch.ones(len(e), dtype=torch.bool))], "p")
    with pytest.raises(PluginError, match="not causally complete"):
        check_partition(e, [api.Segment(everything[1:], torch.ones(len(e) - 1, dtype=torch.bool))], "p")
    with pytest.raises(PluginError, match="no segments"):
        check_partition(e, [], "p")
