"""An independent oracle for the visibility rules (docs/design.md section 3), written from the design in a second, naive
form, against ``specframe.drafting.elements.visible`` and every mask builder's attention.

The chain rule (the default): q may see k iff same document and ((k.depth == 0 and k.anchor <= q.anchor) or
(k.anchor == q.anchor and k.depth <= q.depth)). The block rule (a drafter's ``visibility = "block"``, DFlash): same
document and ((k.depth == 0 and k.anchor <= q.anchor) or k.anchor == q.anchor). ``visible`` states them as vectorised
comparisons; the oracle below enumerates, for each query, the (anchor, depth) pairs it may see (every earlier-or-equal
anchor at depth 0, then its own anchor's chain, or its whole block) and looks each key up in that set, so a slip in
either form shows as a disagreement. The attention reference is a masked softmax written out query by query over the
oracle's key list, in float64. Every test runs both rules.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specframe import plugins
from specframe.drafting.elements import VISIBILITY_RULES, ElementSet, cod_sample, full_grid, visible

BUILDERS = ("dense", "precomputed", "chunked")


def naive_visible(query: ElementSet, key: ElementSet, rule: str | None = None) -> torch.Tensor:
    """The rule by enumeration: the set of (doc, anchor, depth) each query may see, then a lookup per key. ``rule``
    defaults to the one the sets carry."""
    rule = rule or query.visibility
    out = torch.zeros(len(query), len(key), dtype=torch.bool)
    keys = [(int(key.doc[j]), int(key.anchor[j]), int(key.depth[j])) for j in range(len(key))]
    for i in range(len(query)):
        doc, anchor, depth = int(query.doc[i]), int(query.anchor[i]), int(query.depth[i])
        seen = set()
        for a in range(anchor + 1):  # the context: every anchor up to its own, at depth 0
            seen.add((doc, a, 0))
        # chain: the same anchor, depths up to its own; block: every depth of its anchor, deeper ones included
        own = range(depth + 1) if rule == "chain" else range(query.max_depth)
        for d in own:
            seen.add((doc, anchor, d))
        for j, k in enumerate(keys):
            out[i, j] = k in seen
    return out


def naive_attention(query, key, q, k, v) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over each query's visible keys, one query at a time ([B, H, N, D] tensors)."""
    mask = naive_visible(query, key)
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
    scale = 1.0 / math.sqrt(q.shape[-1])
    for i in range(len(query)):
        cols = mask[i].nonzero().squeeze(1)
        if cols.numel() == 0:
            continue
        scores = (q[..., i : i + 1, :].double() @ k[..., cols, :].double().transpose(-1, -2)) * scale
        out[..., i, :] = (torch.softmax(scores, -1) @ v[..., cols, :].double())[..., 0, :]
    return out


def builder(name: str, **options):
    cls = plugins.get("mask builder", name)
    return cls(cls.Options(**options))


@st.composite
def cases(draw):
    """A random element set (full grid or COD, one or several packed documents), cut into segments by a
    partitioner, and optionally a query subset of one segment."""
    seq_len = draw(st.integers(1, 24))
    max_depth = draw(st.integers(1, 4))
    rule = draw(st.sampled_from(VISIBILITY_RULES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    doc = torch.cumsum((torch.rand(seq_len, generator=g) < draw(st.sampled_from([0.0, 0.15, 0.4]))).long(), 0)
    if draw(st.booleans()):
        elements = full_grid(seq_len, max_depth, doc, visibility=rule)
    else:
        supervised = torch.rand(seq_len, generator=g) < draw(st.floats(0.3, 1.0))
        elements = cod_sample(supervised, max_depth, draw(st.floats(0.2, 1.0)), draw(st.floats(0.0, 0.5)),
                              generator=g, doc=doc, visibility=rule)
    name = draw(st.sampled_from(["none", "peagle"]))
    partitioner = plugins.get("partitioner", name)()
    segments = partitioner.partition(elements, draw(st.integers(1, 4)) if name == "peagle" else 1)
    segment = segments[draw(st.integers(0, len(segments) - 1))]
    key = elements.subset(segment.elements)
    query = key
    if draw(st.booleans()) and len(key):
        query = key.subset((torch.rand(len(key), generator=g) < 0.5).nonzero().squeeze(1))
    return query, key, g


@settings(max_examples=60, deadline=None)
@given(cases())
@example((full_grid(3, 2), full_grid(3, 2), torch.Generator().manual_seed(0)))
@example((full_grid(3, 2, visibility="block"), full_grid(3, 2, visibility="block"), torch.Generator().manual_seed(0)))
def test_visible_agrees_with_the_naive_rule(case):
    query, key, _ = case
    assert torch.equal(visible(query, key), naive_visible(query, key))


@settings(max_examples=25, deadline=None)
@given(cases(), st.integers(1, 9))
def test_every_builder_attends_as_the_naive_rule_says(case, chunk_size):
    query, key, g = case
    if len(query) == 0:
        return
    q = torch.randn(1, 2, len(query), 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, len(key), 4, generator=g, dtype=torch.float64) for _ in range(2))
    expected = naive_attention(query, key, q, k, v)
    options = {"dense": {}, "precomputed": {"max_len": 8}, "chunked": {"chunk_size": chunk_size}}
    for name in BUILDERS:
        got = builder(name, **options[name]).build(query, key)(q, k, v)
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("rule", VISIBILITY_RULES)
def test_flex_forward_attends_as_the_naive_rule_says(rule):
    """FlexAttention runs forward only on the CPU (eager, slow per shape): one COD sample of packed documents."""
    g = torch.Generator().manual_seed(1)
    elements = cod_sample(torch.rand(10, generator=g) < 0.8, 3, generator=g, doc=torch.arange(10) // 4,
                          visibility=rule)
    query = elements.subset(torch.arange(1, len(elements), 2))
    q = torch.randn(1, 2, len(query), 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, len(elements), 8, generator=g, dtype=torch.float64) for _ in range(2))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        try:
            got = builder("flex").build(query, elements)(q, k, v)
        except (RuntimeError, NotImplementedError) as e:  # pragma: no cover - a torch without CPU flex
            pytest.skip(f"flex attention does not run forward on this CPU: {e}")
    torch.testing.assert_close(got, naive_attention(query, elements, q, k, v), atol=1e-10, rtol=1e-9)


def test_the_oracle_itself_on_a_hand_worked_case():
    """Two documents: [0, 0, 1] positions, depth 2. Written out by hand from the rule."""
    elements = full_grid(3, 2, torch.tensor([0, 0, 1]))
    pairs = [(int(a), int(d)) for a, d in zip(elements.anchor, elements.depth)]
    assert pairs == [(0, 0), (0, 1), (1, 0), (2, 0)]  # (1, 1) would reach position 2, another document
    expected = torch.tensor([
        [1, 0, 0, 0],  # (0,0) sees itself
        [1, 1, 0, 0],  # (0,1) sees its anchor's chain
        [1, 0, 1, 0],  # (1,0) sees depth-0 anchors 0 and 1
        [0, 0, 0, 1],  # (2,0) is alone in document 1
    ], dtype=torch.bool)
    assert torch.equal(naive_visible(elements, elements), expected)


def test_the_block_oracle_on_a_hand_worked_case():
    """One document of 3 positions, depth 3, block rule. Written out by hand: a block sees itself whole, both ways."""
    elements = full_grid(3, 3, visibility="block")
    pairs = [(int(a), int(d)) for a, d in zip(elements.anchor, elements.depth)]
    assert pairs == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0)]
    expected = torch.tensor([
        [1, 1, 1, 0, 0, 0],  # (0,0) sees its whole block, deeper elements included
        [1, 1, 1, 0, 0, 0],  # (0,1) sees (0,2) too: bidirectional inside the block
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 1, 0],  # (1,0): context (0,0), and its block; never another anchor's deeper elements
        [1, 0, 0, 1, 1, 0],
        [1, 0, 0, 1, 0, 1],  # (2,0): context (0,0), (1,0), and itself
    ], dtype=torch.bool)
    assert torch.equal(naive_visible(elements, elements), expected)
    # the same grid under the chain rule differs exactly where a key is deeper than its query on the same anchor
    chain = naive_visible(elements, elements, "chain")
    deeper = (elements.anchor[:, None] == elements.anchor[None, :]) & (elements.depth[None, :] > elements.depth[:, None])
    assert torch.equal(expected & ~chain, deeper)


def test_sets_under_different_rules_are_refused():
    from specframe.errors import PluginError

    chain, block = full_grid(3, 2), full_grid(3, 2, visibility="block")
    with pytest.raises(PluginError, match="different visibility rules"):
        visible(chain, block)
    with pytest.raises(PluginError, match="chain, block"):
        full_grid(3, 2, visibility="causal")
    assert chain.subset(torch.arange(2)).visibility == "chain" and block.subset(torch.arange(2)).visibility == "block"
