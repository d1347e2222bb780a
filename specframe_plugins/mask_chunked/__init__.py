"""``chunked``: attention in query chunks with the visibility rule evaluated on the fly (docs/design.md section 3).

No mask is stored and no score matrix outlives its chunk: backward recomputes each chunk's scores from q, k, v and the
saved per-row log-sum-exp (the flash-attention recurrence), so forward plus backward hold O(chunk x keys) at a time.
Runs on any device.

The rule's structure splits each chunk's keys in two. A query sees the depth-0 keys of its own document up to its
anchor (plain causal context) and at most K keys of its own chain. So every depth-0 key of the chunk's document at or
before the chunk's smallest anchor is visible to *every* query of the chunk: that **prefix** is maskless attention,
which on CPU goes to torch's fused flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward: blocked, multi-threaded, no score matrix in memory; it takes the merged output and log-sum-exp, so its
gradients for the prefix keys are exact). The rest, the **band** (depth-0 keys between the chunk's smallest and
largest anchor plus the deeper keys of its anchors), is short and gets the rule applied exactly in plain torch. The two
parts are merged by log-sum-exp. Where the fused kernel is not available (another device, float64) the prefix runs
through the same plain-torch path without a mask, with identical results.

Both visibility rules (``specframe.drafting.elements``: ``chain`` and DFlash's ``block``) split this way: they share the
context clause that makes the prefix, and differ only among one anchor's own keys, all of which are in the band (its
depth-0 key lies between the smallest and largest anchor, its deeper keys are the band's deep part); the band applies
the set's rule exactly.

Grouped-query attention is handled inside (``grouped_kv``): k / v arrive with their own (fewer) heads and each
group's query heads are stacked along the query axis, so k and v are never repeated.
"""

from __future__ import annotations

import math

import attrs
import torch

from specframe import api


@attrs.define
class ChunkedOptions:
    chunk_size: int = attrs.field(default=512, validator=attrs.validators.gt(0), metadata={
        "help": "queries per chunk: band score memory is heads x chunk_size x band keys (the prefix never "
                "materialises scores)"})


@attrs.frozen
class _Chunk:
    start: int
    stop: int
    #: ``[prefix_start, prefix_stop)`` in the anchor-sorted depth-0 keys: visible to every query of the chunk
    prefix_start: int
    prefix_stop: int
    band: torch.Tensor  # int64 key indices the chunk may see besides the prefix (a superset; the rule is applied)

    @property
    def prefix(self) -> int:
        return self.prefix_stop - self.prefix_start


@attrs.frozen
class _Plan:
    chunks: tuple[_Chunk, ...]
    root: torch.Tensor  # indices of the depth-0 keys, sorted by anchor
    q_anchor: torch.Tensor
    q_depth: torch.Tensor
    q_doc: torch.Tensor
    k_anchor: torch.Tensor
    k_depth: torch.Tensor
    k_doc: torch.Tensor
    rule: str = "chain"
    window: int | None = None

    def to(self, device: torch.device) -> _Plan:
        chunks = tuple(attrs.evolve(c, band=c.band.to(device)) for c in self.chunks)
        tensors = attrs.astuple(self, recurse=False)[1:-2]
        return _Plan(chunks, *(t.to(device) for t in tensors), rule=self.rule, window=self.window)

    def visible(self, chunk: _Chunk) -> torch.Tensor:
        """The rule of ``specframe.api.visible`` for one chunk's band, bool [chunk queries, band keys]."""
        sl = slice(chunk.start, chunk.stop)
        qa, qd, qdoc = self.q_anchor[sl, None], self.q_depth[sl, None], self.q_doc[sl, None]
        ka, kd, kdoc = (t[chunk.band][None, :] for t in (self.k_anchor, self.k_depth, self.k_doc))
        return (qdoc == kdoc) & api.rule_matrix(self.rule, qa, qd, ka, kd, self.window)


def plan(query: api.ElementSet, key: api.ElementSet, chunk_size: int) -> _Plan:
    """Cut the queries into chunks and find each one's prefix and band (CPU, once per segment)."""
    rule, window = api.shared_visibility(query, key), api.shared_window(query, key)
    root = (key.depth == 0).nonzero().squeeze(1)
    root = root[torch.argsort(key.anchor[root], stable=True)]
    deep = (key.depth > 0).nonzero().squeeze(1)
    deep = deep[torch.argsort(key.anchor[deep], stable=True)]
    root_anchor, deep_anchor = key.anchor[root].contiguous(), key.anchor[deep].contiguous()
    root_doc = key.doc[root]
    # doc_runs[i]: how many document changes the anchor-sorted depth-0 keys have before key i (uniform-range test)
    doc_runs = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(root_doc[1:] != root_doc[:-1], 0)])
    # First depth-0 anchor of each query's document: no visible context key lies before it.
    docs, inverse = torch.unique(torch.cat([query.doc, key.doc]), return_inverse=True)
    q_doc_id, k_doc_id = inverse[: len(query)], inverse[len(query) :]
    first = torch.full((docs.numel(),), key.seq_len, dtype=torch.long)
    first.scatter_reduce_(0, k_doc_id[root], key.anchor[root], reduce="amin")
    q_first = first[q_doc_id]
    chunks = []
    for start in range(0, len(query), chunk_size):
        stop = min(start + chunk_size, len(query))
        qa, qdoc = query.anchor[start:stop], query.doc[start:stop]
        a_min, a_max = qa.min().reshape(1), qa.max().reshape(1)
        r0 = int(torch.searchsorted(root_anchor, q_first[start:stop].min().reshape(1)))
        r1 = int(torch.searchsorted(root_anchor, a_max, right=True))
        p0 = p1 = r0
        if bool((qdoc == qdoc[0]).all()):
            # depth-0 keys of this document up to the smallest anchor: seen by every query of the chunk
            end = int(torch.searchsorted(root_anchor, a_min, right=True))
            if end > r0 and int(root_doc[r0]) == int(qdoc[0]) and int(doc_runs[end - 1] - doc_runs[r0]) == 0:
                p1 = end
        d0 = int(torch.searchsorted(deep_anchor, a_min))
        d1 = int(torch.searchsorted(deep_anchor, a_max, right=True))
        lo = r0
        if window is not None:
            # a sliding window W: a context key at anchor a is seen by the queries at positions < a + W only, so
            # the prefix keeps the keys the chunk's last position still sees, the keys only its earlier positions
            # see join the band (where the rule is applied), and the keys none of them sees are left out
            pos = qa + query.depth[start:stop]
            seen_by_all = int(torch.searchsorted(root_anchor, (pos.max() - window + 1).reshape(1)))
            # (the depth-0 keys of the chunk's own anchors stay: their chains see them whatever the window)
            lo = max(r0, min(int(torch.searchsorted(root_anchor, (pos.min() - window + 1).reshape(1))),
                             int(torch.searchsorted(root_anchor, a_min))))
            p0 = min(max(p0, seen_by_all), p1)
        band_root = torch.cat([root[lo:p0], root[max(lo, p1):r1]])
        chunks.append(_Chunk(start, stop, p0, p1, torch.cat([band_root, deep[d0:d1]])))
    return _Plan(tuple(chunks), root, query.anchor, query.depth, query.doc, key.anchor, key.depth, key.doc, rule,
                 window)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # Softmax statistics in at least fp32, so bf16 / fp16 inputs keep an accurate normaliser.
    return torch.promote_types(dtype, torch.float32)


def _fused(x: torch.Tensor) -> bool:
    """Whether torch's CPU flash-attention kernel takes these inputs (it has no float64 or CUDA variant)."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"
    )


def _group(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, heads, n, ...] -> [B, kv_heads, rep, n, ...]: the query heads that share each k / v head."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads))


def _stack(x: torch.Tensor) -> torch.Tensor:
    """[B, kv, rep, n, D] -> [B, kv, rep * n, D]: one group's query heads as extra queries of its k / v head."""
    return x.flatten(2, 3).contiguous()


def _scores(qg: torch.Tensor, kc: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores [B, kv, rep, n, keys] of grouped queries over keys [B, kv, keys, D], in the accumulation dtype."""
    return (qg @ kc.unsqueeze(2).transpose(-1, -2)).to(_accumulation_dtype(qg.dtype)) * scale


def _band_scores(plan: _Plan, chunk: _Chunk, qg: torch.Tensor, kb: torch.Tensor, scale: float) -> torch.Tensor:
    return _scores(qg, kb, scale).masked_fill_(~plan.visible(chunk), -math.inf)


def _softmax_forward(scores: torch.Tensor, vc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(scores) @ v, log-sum-exp); a row that sees nothing gets output 0 and lse -inf."""
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    p = (scores - top).exp_()
    total = p.sum(-1, keepdim=True)
    seen = total > 0
    p /= torch.where(seen, total, torch.ones_like(total))
    return p.to(vc.dtype) @ vc.unsqueeze(2), torch.where(seen, top + total.log(), -math.inf).squeeze(-1)


def _prefix_forward(qg, kp, vp, scale):
    """Maskless attention of grouped queries [B, kv, rep, n, D] over prefix keys [B, kv, m, D]: (out, lse)."""
    if _fused(qg):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(_stack(qg), kp, vp, scale=scale)
        return out.view(qg.shape), lse.view(qg.shape[:-1]).to(_accumulation_dtype(qg.dtype))
    return _softmax_forward(_scores(qg, kp, scale), vp)


def _prefix_backward(go, qg, kp, vp, out, lse, scale):
    """Gradients (dq [B, kv, rep, n, D], dk, dv [B, kv, m, D]) of the prefix part, given the merged out and lse."""
    if _fused(qg):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _stack(go), _stack(qg), kp, vp, _stack(out), lse.flatten(2, 3).contiguous(), 0.0, False, scale=scale
        )
        return dq.view(qg.shape), dk, dv
    p = (_scores(qg, kp, scale) - lse[..., None]).exp_()
    return _softmax_backward(p, go, qg, kp, vp, out, scale)


def _softmax_backward(p, go, qg, kb, vb, out, scale):
    acc = _accumulation_dtype(qg.dtype)
    delta = (go.to(acc) * out.to(acc)).sum(-1, keepdim=True)
    dv = (p.to(vb.dtype).transpose(-1, -2) @ go).sum(2)
    ds = (p * ((go @ vb.unsqueeze(2).transpose(-1, -2)).to(acc) - delta) * scale).to(qg.dtype)
    return ds @ kb.unsqueeze(2), (ds.transpose(-1, -2) @ qg).sum(2), dv


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: _Plan, scale: float):
        kv = k.shape[1]
        acc = _accumulation_dtype(q.dtype)
        out = torch.zeros_like(q)
        # A query that sees nothing gets output 0 and lse +inf, so backward's exp(score - lse) is 0 for it.
        lse = torch.full(q.shape[:-1], math.inf, dtype=acc, device=q.device)
        k_root, v_root = k.index_select(2, plan.root), v.index_select(2, plan.root)
        og, lg = _group(out, kv), _group(lse, kv)
        for chunk in plan.chunks:
            sl = slice(chunk.start, chunk.stop)
            qg = _group(q[:, :, sl], kv)
            parts = []
            if chunk.prefix:
                ps = slice(chunk.prefix_start, chunk.prefix_stop)
                parts.append(_prefix_forward(qg, k_root[:, :, ps], v_root[:, :, ps], scale))
            if chunk.band.numel():
                kb, vb = k.index_select(2, chunk.band), v.index_select(2, chunk.band)
                parts.append(_softmax_forward(_band_scores(plan, chunk, qg, kb, scale), vb))
            if not parts:
                continue
            merged = parts[0][1]
            for _, part_lse in parts[1:]:
                merged = torch.logaddexp(merged, part_lse)
            seen = torch.isfinite(merged)
            safe = torch.where(seen, merged, torch.zeros_like(merged))
            o = sum(part.to(acc) * torch.exp(part_lse - safe)[..., None] for part, part_lse in parts)
            og[:, :, :, sl] = torch.where(seen[..., None], o, 0.0).to(out.dtype)
            lg[:, :, :, sl] = torch.where(seen, merged, math.inf)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale, kv = ctx.plan, ctx.scale, k.shape[1]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        k_root, v_root = k.index_select(2, plan.root), v.index_select(2, plan.root)
        dk_root, dv_root = torch.zeros_like(k_root), torch.zeros_like(v_root)
        dqg = _group(dq, kv)
        for chunk in plan.chunks:
            sl = slice(chunk.start, chunk.stop)
            qg, go, og = (_group(t[:, :, sl], kv) for t in (q, grad_out, out))
            lg = _group(lse[:, :, sl], kv)
            if chunk.prefix:
                ps = slice(chunk.prefix_start, chunk.prefix_stop)
                g_q, g_k, g_v = _prefix_backward(go, qg, k_root[:, :, ps], v_root[:, :, ps], og, lg, scale)
                dqg[:, :, :, sl] += g_q.to(dq.dtype)
                dk_root[:, :, ps] += g_k.to(dk.dtype)
                dv_root[:, :, ps] += g_v.to(dv.dtype)
            if chunk.band.numel():
                kb, vb = k.index_select(2, chunk.band), v.index_select(2, chunk.band)
                p = (_band_scores(plan, chunk, qg, kb, scale) - lg[..., None]).exp_()
                g_q, g_k, g_v = _softmax_backward(p, go, qg, kb, vb, og, scale)
                dqg[:, :, :, sl] += g_q.to(dq.dtype)
                dk.index_add_(2, chunk.band, g_k.to(dk.dtype))
                dv.index_add_(2, chunk.band, g_v.to(dv.dtype))
        dk.index_add_(2, plan.root, dk_root)
        dv.index_add_(2, plan.root, dv_root)
        return dq, dk, dv, None, None


class ChunkedAttention:
    #: takes k / v with their own (grouped-query) head count; see ``specframe.api.Attention``
    grouped_kv = True

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan
        self._on: dict[torch.device, _Plan] = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.device not in self._on:
            self._on[q.device] = self.plan.to(q.device)
        return _ChunkedAttention.apply(q, k, v, self._on[q.device], 1.0 / math.sqrt(q.shape[-1]))


class ChunkedMaskBuilder(api.MaskBuilder):
    name = "chunked"
    Options = ChunkedOptions
    visibilities = frozenset(api.VISIBILITY_RULES)
    windows = True
    # the default wherever flex does not train (CPU): bounded memory at any length, one code path on every device
    preference = 30
    query_blocks = True
    grouped_kv = True

    def build(self, query: api.ElementSet, key: api.ElementSet) -> ChunkedAttention:
        return ChunkedAttention(plan(query, key, self.options.chunk_size))

    def attention_bytes(self, shape: api.AttentionShape) -> int:
        return api.query_block_bytes(shape, self.options.chunk_size)


@api.hookimpl
def register_mask_builders(register):
    register(ChunkedMaskBuilder)
