"""Every mask builder against the dense reference: outputs and gradients (docs/design.md section 3)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from specframe import plugins
from specframe.drafting.elements import VISIBILITY_RULES, cod_sample, full_grid, visible
from specframe.masks import default_mask_builder


def builder(name: str, **options):
    cls = plugins.get("mask builder", name)
    return cls(cls.Options(**options))


@st.composite
def element_sets(draw):
    seq_len = draw(st.integers(1, 48))
    max_depth = draw(st.integers(1, 5))
    rule = draw(st.sampled_from(VISIBILITY_RULES))  # every builder is held to dense under both rules
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    doc = torch.cumsum((torch.rand(seq_len, generator=g) < draw(st.sampled_from([0.0, 0.1, 0.3]))).long(), 0)
    if draw(st.booleans()):
        return full_grid(seq_len, max_depth, doc, visibility=rule), g
    supervised = torch.rand(seq_len, generator=g) < draw(st.floats(0.3, 1.0))
    ratio, min_ratio = draw(st.floats(0.2, 1.0)), draw(st.floats(0.0, 0.5))
    return cod_sample(supervised, max_depth, ratio, min_ratio, generator=g, doc=doc, visibility=rule), g


def _attend(attention, q, k, v, grad_out):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


@settings(max_examples=30)
@given(element_sets(), st.sampled_from([torch.float32, torch.float64]), st.integers(1, 17), st.booleans())
def test_builders_match_dense(sample, dtype, chunk_size, query_subset):
    elements, g = sample
    n = len(elements)
    query = elements
    if query_subset:  # queries a subset, keys everything (each query still sees itself)
        query = elements.subset((torch.rand(n, generator=g) < 0.5).nonzero().squeeze(1))
    q = torch.randn(2, 2, len(query), 8, generator=g, dtype=dtype)
    k, v = (torch.randn(2, 2, n, 8, generator=g, dtype=dtype) for _ in range(2))
    grad_out = torch.randn(2, 2, len(query), 8, generator=g, dtype=dtype)
    reference = _attend(builder("dense").build(query, elements), q, k, v, grad_out)
    tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-10, "rtol": 1e-9}
    candidates = {
        "precomputed": builder("precomputed", max_len=8),
        "chunked": builder("chunked", chunk_size=chunk_size),
    }
    for name, b in candidates.items():
        got = _attend(b.build(query, elements), q, k, v, grad_out)
        for what, x, y in zip(("output", "dq", "dk", "dv"), got, reference):
            torch.testing.assert_close(x, y, **tol, msg=lambda m, name=name, what=what: f"{name} {what}: {m}")


@pytest.mark.parametrize("rule", VISIBILITY_RULES)
def test_flex_forward_matches_dense_on_cpu(rule):
    # FlexAttention has no CPU backward and its eager CPU path retraces per shape (seconds each), hence forward only
    # on two fixed cases: a full grid of one document, and a COD sample of packed documents with a query subset.
    g = torch.Generator().manual_seed(0)
    grid = full_grid(20, 4, visibility=rule)
    cod = cod_sample(torch.rand(30, generator=g) < 0.8, 4, generator=g, doc=torch.arange(30) // 11, visibility=rule)
    for query, key in ((grid, grid), (cod.subset(torch.arange(0, len(cod), 2)), cod)):
        q = torch.randn(1, 2, len(query), 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(1, 2, len(key), 8, generator=g, dtype=torch.float64) for _ in range(2))
        with warnings.catch_warnings():  # eager flex warns that it is unfused, which is expected on CPU
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
            out = builder("flex").build(query, key)(q, k, v)
        torch.testing.assert_close(out, builder("dense").build(query, key)(q, k, v), atol=1e-10, rtol=1e-9)


def test_precomputed_caches_and_grows():
    b = builder("precomputed", max_len=4)
    short = full_grid(4, 3)
    b.build(short, short)
    cached = b.cached_mask(4, 3)
    assert cached.shape == (12, 12)
    b.build(short.subset(torch.arange(5)), short)
    assert b.cached_mask(4, 3) is cached  # a subset reuses the cached mask
    long = full_grid(200, 3)
    mask = b.build(long, long).mask
    assert b.cached_mask(200, 3).shape[0] >= 600
    assert torch.equal(mask, visible(long, long))
    deeper = full_grid(10, 5, torch.tensor([0] * 4 + [1] * 6))
    assert torch.equal(b.build(deeper, deeper).mask, visible(deeper, deeper))
    # a block drafter's sets rebuild the cache under the block rule, and a chain set after them gets chain again
    block = full_grid(10, 5, torch.tensor([0] * 4 + [1] * 6), visibility="block")
    assert torch.equal(b.build(block, block).mask, visible(block, block))
    assert not torch.equal(visible(block, block), visible(deeper, deeper))
    assert torch.equal(b.build(deeper, deeper).mask, visible(deeper, deeper))


def test_chunked_band_holds_the_whole_block_under_the_block_rule():
    # A block query sees its anchor's deeper keys: they must be in its chunk's band, never left to a prefix that
    # holds depth-0 keys only. One anchor per chunk makes the band exactly its block's other elements.
    elements = full_grid(6, 4, visibility="block")
    attention = builder("chunked", chunk_size=4).build(elements, elements)
    for chunk in attention.plan.chunks:
        anchor = int(elements.anchor[chunk.start])
        band = chunk.band
        assert set(zip(elements.anchor[band].tolist(), elements.depth[band].tolist())) >= {
            (anchor, d) for d in range(1, 4) if anchor + d < 6
        }


class _ChainOnly(type(builder("dense"))):
    name = "chain-only"
    visibilities = frozenset({"chain"})


def test_a_builder_that_does_not_declare_the_block_rule_is_refused_a_block_drafter():
    from specframe.api import SegmentAttention
    from specframe.errors import UsageError

    block = full_grid(4, 2, visibility="block")
    with pytest.raises(UsageError, match="'chain-only' applies the chain visibility rule.*not the drafter's 'block'"):
        SegmentAttention.build(_ChainOnly(), block)
    chain = full_grid(4, 2)
    attention = SegmentAttention.build(_ChainOnly(), chain)  # the rule it declares still works, subsets too
    with pytest.raises(UsageError, match="'block'"):
        attention.subset(block, block)
    for name in ("dense", "precomputed", "chunked", "flex"):
        assert set(VISIBILITY_RULES) <= plugins.get("mask builder", name).visibilities


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op produces, forward and backward."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest_tensor(attention, n: int) -> int:
    q, k, v = (torch.randn(1, 1, n, 4, requires_grad=True) for _ in range(3))
    with _LargestTensor() as probe:
        attention(q, k, v).sum().backward()
    return probe.largest


def test_chunked_never_holds_all_scores():
    elements = full_grid(100, 4)
    n = len(elements)
    chunk = 8
    bound = chunk * n  # one chunk's scores over every key
    assert _largest_tensor(builder("chunked", chunk_size=chunk).build(elements, elements), n) <= bound
    # The probe can see a full score matrix: the dense reference makes one.
    assert _largest_tensor(builder("dense").build(elements, elements), n) >= n * n


def test_chunked_gathers_only_keys_a_chunk_can_see():
    elements = full_grid(64, 8)
    attention = builder("chunked", chunk_size=8).build(elements, elements)
    chunks = attention.plan.chunks
    widest = max(c.prefix + c.band.numel() for c in chunks)
    # 8 queries of one anchor see its 64 context anchors at most plus its own chain of 8.
    assert widest <= 64 + 8 + 8 < len(elements)
    # Only the chunk's own anchors' keys need the rule (a chunk spans at most two anchors here); its earlier
    # context is the maskless prefix, which grows with the chunk's first anchor.
    assert max(c.band.numel() for c in chunks) <= 2 * 8
    first_anchor = [int(elements.anchor[c.start]) for c in chunks]
    assert [c.prefix for c in chunks] == [a + 1 for a in first_anchor]


@settings(max_examples=20, deadline=None)
@given(element_sets(), st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), st.integers(1, 17))
def test_chunked_grouped_query_heads_match_dense(sample, dtype, chunk_size):
    """k / v with fewer heads than q (grouped-query attention) are used as they are, never repeated."""
    elements, g = sample
    n = len(elements)
    q = torch.randn(1, 6, n, 8, generator=g, dtype=dtype)
    k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=dtype) for _ in range(2))
    grad_out = torch.randn(1, 6, n, 8, generator=g, dtype=dtype)
    attention = builder("chunked", chunk_size=chunk_size).build(elements, elements)
    assert attention.grouped_kv
    got = _attend(attention, q, k, v, grad_out)
    wide = [t.float() if dtype == torch.bfloat16 else t for t in (q, k, v, grad_out)]
    dense = builder("dense").build(elements, elements)
    ref = _attend(dense, wide[0], wide[1].repeat_interleave(3, 1), wide[2].repeat_interleave(3, 1), wide[3])
    ref = (ref[0], ref[1], *(g.unflatten(1, (2, 3)).sum(2) for g in ref[2:]))
    tol = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-9),
           torch.bfloat16: dict(atol=0.1, rtol=0.05)}[dtype]
    for what, x, y in zip(("output", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(x.to(y.dtype), y, **tol, msg=lambda m, what=what: f"{what}: {m}")


def test_default_mask_builder_is_registered_and_supports_the_device():
    assert default_mask_builder(torch.device("cpu")) == "chunked"
    assert default_mask_builder("cuda") == "flex"
    for device in ("cpu", "cuda"):
        assert device in plugins.get("mask builder", default_mask_builder(device)).devices


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention trains only on CUDA")
def test_flex_matches_dense_on_cuda():
    g = torch.Generator().manual_seed(0)
    elements = cod_sample(torch.rand(300, generator=g) < 0.8, 5, generator=g, doc=torch.arange(300) // 120)
    n = len(elements)
    q, k, v, grad_out = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float32).cuda() for _ in range(4))
    reference = _attend(builder("dense").build(elements, elements), q, k, v, grad_out)
    got = _attend(builder("flex").build(elements, elements), q, k, v, grad_out)
    for x, y in zip(got, reference):
        torch.testing.assert_close(x, y, atol=2e-4, rtol=2e-3)


def test_dense_reference_agrees_with_sdpa_definition():
    # Guards the reference itself: masked softmax written out by hand, with the mask from the independent oracle
    # (not visible(), which the builders use themselves)
    from tests.contract.test_visibility_oracle import naive_visible

    elements = cod_sample(torch.ones(12, dtype=torch.bool), 3, generator=torch.Generator().manual_seed(3),
                          doc=torch.arange(12) // 5)
    n = len(elements)
    q, k, v = (torch.randn(1, 1, n, 4, dtype=torch.float64) for _ in range(3))
    mask = naive_visible(elements, elements)
    scores = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(builder("dense").build(elements, elements)(q, k, v), F.softmax(scores, -1) @ v)


def test_default_mask_builder_falls_back_when_flex_is_disabled(monkeypatch):
    monkeypatch.setenv("SPECFRAME_DISABLE_PLUGINS", "mask_flex")
    plugins.reset()
    try:
        assert default_mask_builder("cuda") == "chunked"
    finally:
        monkeypatch.delenv("SPECFRAME_DISABLE_PLUGINS")
        plugins.reset()
    assert default_mask_builder("cuda") == "flex"


@pytest.mark.parametrize("name", ["dense", "chunked", "precomputed"])
def test_a_segment_hands_its_builder_one_dtype_under_autocast(name):
    """Under bf16 autocast q and k leave fp32-weight RMSNorms in fp32 while v leaves a projection in bf16 (DFlash's
    block): the builder gets all three in autocast's dtype, from the segment's attention and from its subsets."""
    from specframe import api

    elements = full_grid(12, 3, visibility="block")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, len(elements), 8, generator=g) for _ in range(3))
    segment = api.SegmentAttention.build(builder(name), elements)
    reference = segment(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for attention in (segment, segment.subset(elements, elements)):
            out = attention(q, k, v.bfloat16())
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out.float(), reference, atol=3e-2, rtol=3e-2)
    assert api.one_dtype(q, k, v.double())[0].dtype == torch.float64  # no autocast: the promoted dtype
