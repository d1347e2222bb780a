"""``chunked``: attention in query chunks with the visibility rule evaluated on the fly (DESIGN.md section 3).

No mask is stored: each chunk of queries compares its (anchor, depth, doc) vectors with its keys' and the chunk's
scores are discarded after use; backward recomputes them from q, k, v and the saved per-row log-sum-exp (the
flash-attention recurrence, here in plain torch), so forward plus backward hold O(chunk x keys) scores at a time.
Runs on any device.

Structure makes each chunk's key list short: a query sees depth-0 keys of its own document up to its anchor (plain
causal context) and at most K keys of its own chain, so a chunk only gathers the depth-0 keys with anchors between the
start of its first document and its last anchor, plus the deeper keys of its own anchors. The rule is still applied
exactly to the gathered keys, so the key list only has to be a superset of what the chunk can see. With position-major
queries this cuts the work about K-fold against a chunk that scores every key up to its last anchor (and about 2K-fold
against one that scores every key).
"""

from __future__ import annotations

import math

import attrs
import torch

from specframe import api


@attrs.define
class ChunkedOptions:
    #: queries per chunk: peak score memory is batch x heads x chunk_size x (keys a chunk can see)
    chunk_size: int = attrs.field(default=256, validator=attrs.validators.gt(0))


@attrs.frozen
class _Chunk:
    start: int
    stop: int
    keys: torch.Tensor  # int64 indices of the keys this chunk may see (a superset)


@attrs.frozen
class _Plan:
    chunks: tuple[_Chunk, ...]
    q_anchor: torch.Tensor
    q_depth: torch.Tensor
    q_doc: torch.Tensor
    k_anchor: torch.Tensor
    k_depth: torch.Tensor
    k_doc: torch.Tensor

    def to(self, device: torch.device) -> _Plan:
        return _Plan(
            tuple(_Chunk(c.start, c.stop, c.keys.to(device)) for c in self.chunks),
            *(t.to(device) for t in attrs.astuple(self, recurse=False)[1:]),
        )

    def visible(self, chunk: _Chunk) -> torch.Tensor:
        """The rule of ``specframe.api.visible`` for one chunk, bool [chunk queries, chunk keys]."""
        sl = slice(chunk.start, chunk.stop)
        qa, qd, qdoc = self.q_anchor[sl, None], self.q_depth[sl, None], self.q_doc[sl, None]
        ka, kd, kdoc = (t[chunk.keys][None, :] for t in (self.k_anchor, self.k_depth, self.k_doc))
        return (qdoc == kdoc) & (((kd == 0) & (ka <= qa)) | ((ka == qa) & (kd <= qd)))


def plan(query: api.ElementSet, key: api.ElementSet, chunk_size: int) -> _Plan:
    """Cut the queries into chunks and list, for each, the keys it may see (CPU, once per segment)."""
    root = (key.depth == 0).nonzero().squeeze(1)
    root = root[torch.argsort(key.anchor[root], stable=True)]
    deep = (key.depth > 0).nonzero().squeeze(1)
    deep = deep[torch.argsort(key.anchor[deep], stable=True)]
    root_anchor, deep_anchor = key.anchor[root].contiguous(), key.anchor[deep].contiguous()
    # First depth-0 anchor of each query's document: no visible context key lies before it.
    docs, inverse = torch.unique(torch.cat([query.doc, key.doc]), return_inverse=True)
    q_doc_id, k_doc_id = inverse[: len(query)], inverse[len(query) :]
    first = torch.full((docs.numel(),), key.seq_len, dtype=torch.long)
    first.scatter_reduce_(0, k_doc_id[root], key.anchor[root], reduce="amin")
    q_first = first[q_doc_id]
    chunks = []
    for start in range(0, len(query), chunk_size):
        stop = min(start + chunk_size, len(query))
        qa = query.anchor[start:stop]
        lo, hi = q_first[start:stop].min().reshape(1), qa.max().reshape(1)
        r0, r1 = int(torch.searchsorted(root_anchor, lo)), int(torch.searchsorted(root_anchor, hi, right=True))
        d0 = int(torch.searchsorted(deep_anchor, qa.min().reshape(1)))
        d1 = int(torch.searchsorted(deep_anchor, hi, right=True))
        chunks.append(_Chunk(start, stop, torch.cat([root[r0:r1], deep[d0:d1]])))
    return _Plan(tuple(chunks), query.anchor, query.depth, query.doc, key.anchor, key.depth, key.doc)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # Softmax statistics in at least fp32, so bf16 / fp16 inputs keep an accurate normaliser.
    return torch.promote_types(dtype, torch.float32)


def _scores(plan: _Plan, chunk: _Chunk, q: torch.Tensor, kc: torch.Tensor, scale: float) -> torch.Tensor:
    scores = (q[:, :, chunk.start : chunk.stop] @ kc.transpose(-1, -2)).to(_accumulation_dtype(q.dtype)) * scale
    return scores.masked_fill_(~plan.visible(chunk), -math.inf)


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: _Plan, scale: float):
        out = torch.zeros_like(q)
        # A query that sees nothing gets output 0 and lse +inf, so backward's exp(score - lse) is 0 for it.
        lse = torch.full(q.shape[:-1], math.inf, dtype=_accumulation_dtype(q.dtype), device=q.device)
        for chunk in plan.chunks:
            if chunk.keys.numel() == 0:
                continue
            kc, vc = k.index_select(2, chunk.keys), v.index_select(2, chunk.keys)
            scores = _scores(plan, chunk, q, kc, scale)
            top = scores.amax(-1, keepdim=True)
            top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
            p = (scores - top).exp_()
            total = p.sum(-1, keepdim=True)
            seen = total > 0
            p /= torch.where(seen, total, torch.ones_like(total))
            out[:, :, chunk.start : chunk.stop] = (p.to(v.dtype) @ vc).to(out.dtype)
            lse[:, :, chunk.start : chunk.stop] = torch.where(seen, top + total.log(), math.inf).squeeze(-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        acc = _accumulation_dtype(q.dtype)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1)
        for chunk in plan.chunks:
            if chunk.keys.numel() == 0:
                continue
            sl = slice(chunk.start, chunk.stop)
            kc, vc = k.index_select(2, chunk.keys), v.index_select(2, chunk.keys)
            p = (_scores(plan, chunk, q, kc, scale) - lse[:, :, sl, None]).exp_()
            go = grad_out[:, :, sl]
            dv.index_add_(2, chunk.keys, (p.to(v.dtype).transpose(-1, -2) @ go).to(dv.dtype))
            ds = p * ((go @ vc.transpose(-1, -2)).to(acc) - delta[:, :, sl, None]) * scale
            ds = ds.to(q.dtype)
            dq[:, :, sl] = ds @ kc
            dk.index_add_(2, chunk.keys, ds.transpose(-1, -2) @ q[:, :, sl])
        return dq, dk, dv, None, None


class ChunkedAttention:
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

    def build(self, query: api.ElementSet, key: api.ElementSet) -> ChunkedAttention:
        return ChunkedAttention(plan(query, key, self.options.chunk_size))


@api.hookimpl
def register_mask_builders(register):
    register(ChunkedMaskBuilder)
