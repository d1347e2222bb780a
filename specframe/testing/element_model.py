"""A tiny trainable model over element sets and the references the component contracts hold builders and
partitioners to (exactness of partitioning, mask builders).

``TinyElementModel`` is a few pre-norm attention layers over (anchor, depth) elements: depth-0 elements read the
token at their anchor, deeper ones a shared mask token (as P-EAGLE's drafter), and every element adds a learned
embedding of its position a + d. Everything but attention is per element, so any cross-element effect goes through
the ``api.Attention`` it is given, which is what the exactness tests probe. ``RuleAttention`` is that attention
written from the visibility rule itself (``specframe.drafting.elements.visible``, one full mask, float64-exact), and
``sample_element_sets`` the small element sets, one of each shape the engine makes, the contracts run on.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from specframe import api
from specframe.drafting.elements import VISIBILITY_RULES, ElementSet, cod_sample, full_grid, visible


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(self, h: torch.Tensor, attention) -> torch.Tensor:
        n, width = h.shape[0], h.shape[1]
        q, k, v = self.qkv(self.norm1(h)).view(n, 3, self.heads, width // self.heads).permute(1, 2, 0, 3)
        mixed = attention(q[None], k[None], v[None])[0]  # [heads, n, head_dim]
        h = h + self.out(mixed.transpose(0, 1).reshape(n, width))
        return h + self.mlp(self.norm2(h))


class TinyElementModel(nn.Module):
    """Element-set language model: ``forward(input_ids [L], elements, attention) -> logits [len(elements), vocab]``."""

    def __init__(self, vocab: int = 32, hidden: int = 16, heads: int = 2, layers: int = 2, max_len: int = 64) -> None:
        super().__init__()
        self.mask_token = vocab  # one extra embedding row that no data token uses
        self.embed = nn.Embedding(vocab + 1, hidden)
        self.position = nn.Embedding(max_len, hidden)
        self.layers = nn.ModuleList(_Layer(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor, elements: ElementSet, attention) -> torch.Tensor:
        tokens = torch.where(elements.depth == 0, input_ids[elements.anchor], self.mask_token)
        h = self.embed(tokens) + self.position(elements.position)
        for layer in self.layers:
            h = layer(h, attention)
        return self.head(self.norm(h))


def segment_loss(
    model: TinyElementModel,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    supervised: torch.Tensor,
    elements: ElementSet,
    segment,
    builder,
) -> torch.Tensor:
    """One segment's loss: cross-entropy of its charged, supervised elements against ``targets[anchor, depth]``,
    summed and divided by the whole sequence's supervised element count (docs/design.md section 8)."""
    forwarded = elements.subset(segment.elements)
    logits = model(input_ids, forwarded, builder.build(forwarded, forwarded))
    wanted = segment.loss_mask & supervised[forwarded.position]
    losses = F.cross_entropy(logits[wanted], targets[forwarded.anchor[wanted], forwarded.depth[wanted]], reduction="sum")
    return losses / int(supervised[elements.position].sum())


def accumulated_gradients(model, input_ids, targets, supervised, elements, segments, builder) -> dict[str, torch.Tensor]:
    """Forward and backward every segment in turn, accumulating gradients as a training step would (an empty
    segment is skipped, as the engine skips it)."""
    model.zero_grad(set_to_none=True)
    for segment in segments:
        if len(segment.elements) == 0:
            continue
        segment_loss(model, input_ids, targets, supervised, elements, segment, builder).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


class RuleAttention:
    """softmax(q k^T / sqrt(D)) v over the keys ``specframe.drafting.elements.visible`` lets each query see, with the whole
    (queries x keys) mask: the reference every mask builder's attention must equal. Grouped k / v (fewer heads than
    q) are repeated, as a builder declaring ``grouped_kv`` must read them."""

    def __init__(self, query: ElementSet, key: ElementSet) -> None:
        self.mask = visible(query, key)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~self.mask.to(q.device), float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


class RuleMaskBuilder(api.MaskBuilder):
    """``RuleAttention`` as a mask builder (every rule, windows too): what the contracts compare against."""

    name = "rule-reference"
    visibilities = frozenset(VISIBILITY_RULES)
    windows = True

    def build(self, query: ElementSet, key: ElementSet) -> RuleAttention:
        return RuleAttention(query, key)


def sample_element_sets(rules=VISIBILITY_RULES, window: bool = True) -> list[tuple[str, ElementSet]]:
    """Small seeded element sets of every shape the engine makes, under each of ``rules``: a full grid of one
    document; a full grid of three packed documents; a COD sample (docs/design.md section 8) of packed documents with
    unsupervised positions; and, when ``window``, the packed grid under a sliding window of 3. ``(label, set)``."""
    doc = torch.tensor([0] * 5 + [1] * 6 + [2] * 3)
    g = torch.Generator().manual_seed(0)
    supervised = torch.rand(20, generator=g) < 0.8
    cod_doc = torch.tensor([0] * 8 + [1] * 9 + [2] * 3)
    out = []
    for rule in rules:
        out.append((f"{rule} grid", full_grid(9, 3, visibility=rule)))
        out.append((f"{rule} packed grid", full_grid(14, 4, doc, visibility=rule)))
        cod = cod_sample(supervised, 4, 0.6, 0.2, generator=torch.Generator().manual_seed(1), doc=cod_doc,
                         visibility=rule)
        out.append((f"{rule} COD sample", cod))
        if window:
            windowed = attrs.evolve(full_grid(14, 4, doc, visibility=rule), window=3)
            out.append((f"{rule} packed grid, window 3", windowed))
    return out
