"""The (anchor, depth) element model shared by every drafter (DESIGN.md section 3).

Element (a, d) asks the drafter for the token d steps beyond a plain next-token prediction at anchor a; its rotary
position is a + d. Elements are laid out position-major (index a*K + d in the full grid), and every element also
carries the document it belongs to, so packed sequences never attend across documents.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class ElementSet:
    """The elements of one training sequence (or a subset of them), as parallel int64 vectors."""

    anchor: torch.Tensor
    depth: torch.Tensor
    doc: torch.Tensor
    seq_len: int
    max_depth: int

    def __attrs_post_init__(self) -> None:
        n = self.anchor.shape[0]
        if self.anchor.dim() != 1 or self.depth.shape != (n,) or self.doc.shape != (n,):
            raise ValueError(
                f"anchor, depth and doc must be 1-D and equally long, got "
                f"{tuple(self.anchor.shape)}, {tuple(self.depth.shape)}, {tuple(self.doc.shape)}"
            )

    def __len__(self) -> int:
        return int(self.anchor.shape[0])

    @property
    def position(self) -> torch.Tensor:
        """Rotary position (and reference position for targets / loss masks) of each element: anchor + depth."""
        return self.anchor + self.depth

    def subset(self, index: torch.Tensor) -> ElementSet:
        """The elements at ``index`` (int64 indices or a bool mask), order kept."""
        return ElementSet(self.anchor[index], self.depth[index], self.doc[index], self.seq_len, self.max_depth)


def full_grid(seq_len: int, max_depth: int, doc: torch.Tensor | None = None) -> ElementSet:
    """Every element (a, d) with 0 <= d < max_depth and a + d < seq_len, position-major.

    ``doc`` gives the document id of each of the ``seq_len`` positions (default: one document); an element belongs to
    its anchor's document, and elements whose reference position a + d falls in another document are dropped.
    """
    if seq_len < 1 or max_depth < 1:
        raise ValueError(f"seq_len and max_depth must be positive, got {seq_len} and {max_depth}")
    if doc is None:
        doc = torch.zeros(seq_len, dtype=torch.long)
    anchor = torch.arange(seq_len).repeat_interleave(max_depth)
    depth = torch.arange(max_depth).repeat(seq_len)
    pos = anchor + depth
    keep = pos < seq_len
    keep[keep.clone()] &= doc[pos[keep]] == doc[anchor[keep]]
    return ElementSet(anchor[keep], depth[keep], doc[anchor[keep]], seq_len, max_depth)


def visible(query: ElementSet, key: ElementSet) -> torch.Tensor:
    """The reference visibility rule as a dense bool matrix [len(query), len(key)].

    q may see k iff same document and ((k is depth 0 and k.anchor <= q.anchor) or (same anchor and
    k.depth <= q.depth)). A precomputed single-document mask combines with packed documents by AND-ing this
    block-diagonal document condition.
    """
    qa, qd, qdoc = query.anchor[:, None], query.depth[:, None], query.doc[:, None]
    ka, kd, kdoc = key.anchor[None, :], key.depth[None, :], key.doc[None, :]
    context = (kd == 0) & (ka <= qa)
    chain = (ka == qa) & (kd <= qd)
    return (qdoc == kdoc) & (context | chain)
