"""``peagle``: P-EAGLE's sequence partitioning (gradient accumulation within one sequence, docs/design.md section 3).

Positions are cut into contiguous ranges. A segment owns (is charged with) the depth-0 elements of its positions and
every deeper element of an anchor a whose a + 1 lies in its range (clamped to the last position). It forwards its owned elements plus every depth-0 element of earlier
segments, recomputed as context and charged nothing. That is causally complete: an owned element (a, d) sees
depth-0 keys at anchors <= a (all in this or earlier segments) and its own chain, whose root (a, 0) sits in this or
the previous segment and whose deeper members this segment owns. So each element's forward is the same as in one
pass, and with every segment's loss divided by the whole sequence's count the accumulated gradient is exact.

Cuts balance the owned element count, not positions: with COD most deep elements sit at supervised positions, so
equal position ranges could leave one segment with most of the chains.

Under the ``block`` visibility rule (DFlash, ``specframe.drafting.elements``) an element sees every element of its anchor's
block, the root included, and the root sees its block. So a segment owns whole blocks (every element is owned at its
anchor), and the context it recomputes must be complete too: an earlier root is only exact with its block, so a
segment forwards every earlier element of its documents. That keeps the gradients exact; the saving is then on the
charged side only (the loss and its logits), not the recomputed context.
"""

from __future__ import annotations

import torch

from specframe import api


def owner_position(elements: api.ElementSet) -> torch.Tensor:
    """The position whose segment is charged with each element: a for depth 0, a + 1 (clamped) deeper; under the
    block rule a for every depth, since a block's root and deeper elements see each other."""
    if elements.visibility == "block":
        return elements.anchor
    return torch.where(elements.depth == 0, elements.anchor, (elements.anchor + 1).clamp(max=elements.seq_len - 1))


def cut_positions(owner: torch.Tensor, seq_len: int, num_segments: int) -> torch.Tensor:
    """Segment start positions [S'] (S' <= num_segments), balancing the owned element count per segment.

    Segment s starts at the position whose running owned count (before it) is nearest s/S of the total; cuts that
    would leave a segment with no position or nothing to own are dropped, so large S collapses to what the data
    allows.
    """
    weight = torch.bincount(owner, minlength=seq_len)
    cumulative = torch.cumsum(weight, 0)
    before = cumulative - weight  # owned count strictly before each position
    total = int(cumulative[-1])
    targets = torch.tensor([s * total / num_segments for s in range(1, num_segments)], dtype=torch.float64)
    after = torch.searchsorted(before.double(), targets).clamp(max=seq_len - 1)
    # The nearest position to each target, from either side, balances better than always rounding up.
    below = (after - 1).clamp(min=0)
    closer_below = (targets - before[below].double()) < (before[after].double() - targets)
    candidates = torch.unique(torch.where(closer_below, below, after)).tolist()

    def owned(start: int, stop: int) -> int:
        return int(before[stop]) - int(before[start]) if stop < seq_len else total - int(before[start])

    starts = [0]
    for cut in candidates:
        if 0 < cut < seq_len and owned(starts[-1], cut) > 0:
            starts.append(cut)
    if len(starts) > 1 and owned(starts[-1], seq_len) == 0:
        starts.pop()
    return torch.tensor(starts, dtype=torch.long)


class PeaglePartitioner(api.Partitioner):
    name = "peagle"
    splits_sequences = True
    counted_as = "balanced_ranges"  # the memory estimate's closed form follows these cuts (cut_positions)

    def partition(self, elements: api.ElementSet, num_segments: int) -> list[api.Segment]:
        if isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments <= 0:
            raise api.UsageError(f"the number of partitions must be a positive integer, got {num_segments!r}")
        n = len(elements)
        if n == 0:
            return [api.Segment(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool))]
        owner = owner_position(elements)
        starts = cut_positions(owner, elements.seq_len, num_segments)
        owner_seg = torch.bucketize(owner, starts, right=True) - 1
        block = elements.visibility == "block"
        root_seg = torch.where(elements.depth == 0, owner_seg, torch.full_like(owner_seg, len(starts)))
        segments = []
        for s in range(len(starts)):
            owned = owner_seg == s
            if block:  # earlier roots need their blocks: every earlier element of the documents this segment owns
                forwarded = owned | ((owner_seg < s) & torch.isin(elements.doc, elements.doc[owned]))
            else:
                forwarded = owned | (root_seg < s)
            index = forwarded.nonzero().squeeze(1)
            segments.append(api.Segment(index, owned[index]))
        return segments


@api.hookimpl
def register_partitioners(register):
    register(PeaglePartitioner)
