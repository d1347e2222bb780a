"""Helpers for tests that need a tiny trainable model over element sets (exactness of partitioning, mask builders).

``TinyElementModel`` is a few pre-norm attention layers over (anchor, depth) elements: depth-0 elements read the
token at their anchor, deeper ones a shared mask token (as P-EAGLE's drafter), and every element adds a learned
embedding of its position a + d. Everything but attention is per element, so any cross-element effect goes through
the ``api.Attention`` it is given, which is what the exactness tests probe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specframe.elements import ElementSet


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
    """Forward and backward every segment in turn, accumulating gradients as a training step would."""
    model.zero_grad(set_to_none=True)
    for segment in segments:
        segment_loss(model, input_ids, targets, supervised, elements, segment, builder).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
