"""The element counts of one training step: every segment's forwarded rows, charged elements and anchors.

Element counts: up to ``SAMPLED_MAX_LEN`` tokens the estimator runs the real COD sampler on an all-supervised sequence
and the real partitioner, so every segment's forwarded and charged counts are the ones a seeded draw gives. Longer
sequences are counted in closed form (``closed_segments``), in time and memory that do not grow with L: the full grid
exactly; COD's per-depth counts exactly while a draw keeps fewer than its candidates (at its floor, without the rare
drop-out at the sequence's end), and where the P-EAGLE partitioner cuts from each depth's expected share of a range
(within the spread of draws: ``tests/unit/test_memory_closed_form.py``). A partitioner that declares no rule the
closed form follows (``Partitioner.counted_as``), or a drafter whose supervision is not "every position but the last
few", is run up to ``RUN_MAX_LEN`` and refused beyond.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from specframe.errors import UsageError
from specframe.interfaces.partitioner import counting_rule
from specframe.memory.config import MemoryConfig, resolved_plan


#: (forwarded rows, charged elements, anchors) of every segment, and the sequence's element count
Counts = tuple[list[tuple[int, int, int]], int]


def sampled_segments(cfg: MemoryConfig, drafter: Any, depth: int, training: Any) -> Counts:
    """(forwarded rows, charged, anchors) of every segment, from the real COD sampler and partitioner under the
    drafter's visibility rule; the rows are the drafter's ``forwarded_rows`` of the segment's elements and of the
    distinct anchors of its charged ones (a segment's other elements are context it recomputes)."""
    from specframe import api
    from specframe.drafting.elements import cod_sample, full_grid

    n = cfg.seq_len
    example = api.TrainingExample(
        torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long)
    )
    sup = drafter.supervision(example).to(torch.bool).cpu()
    if training.cod_ratio < 1.0:
        elems = cod_sample(sup, depth, training.cod_ratio, training.cod_min_ratio,
                           generator=torch.Generator().manual_seed(0))
    else:
        elems = full_grid(sup.shape[0], depth)
    elems = elems.with_visibility(drafter.visibility)  # as the engine stamps it: the partitioner keeps blocks whole
    partitioner = _partitioner(cfg)
    segs = partitioner.partition(elems, cfg.partitions)  # the engine checks the partition itself
    charged_all = sup[elems.position]
    out = []
    for seg in segs:
        idx = seg.elements
        charged_here = seg.loss_mask & charged_all[idx]
        charged = int(charged_here.sum())
        anchors = int(torch.unique(elems.anchor[idx][charged_here]).numel())
        out.append((int(drafter.forwarded_rows(int(idx.numel()), anchors)), charged, anchors))
    return out, len(elems)


#: sequences up to this length are counted by running the COD sampler and the partitioner on them
#: (``sampled_segments``): a fraction of a second there, and the figures are the sampled ones; longer ones are counted
#: in closed form
SAMPLED_MAX_LEN = 8192
#: a partitioner or a drafter's supervision the closed form does not describe is counted by running it, up to this
#: length (its time and memory grow with the length: refused beyond, instead of growing without bound)
RUN_MAX_LEN = 65536
_PROBE_LENGTHS = (64, 65, 200)


def supervision_shape(drafter: Any) -> tuple[int, int] | None:
    """(shift, tail) when the drafter supervises one all-loss document as ``L - shift`` positions of which all but
    the last ``tail`` carry a loss, the same at every probed length (the EAGLE family: 1, 1; PARD: 0, 1); else None."""
    from specframe import api

    seen = set()
    for length in _PROBE_LENGTHS:
        sup = drafter.supervision(api.TrainingExample(
            torch.zeros(length, dtype=torch.long), torch.ones(length, dtype=torch.bool),
            torch.zeros(length, dtype=torch.long))).to(torch.bool).cpu()
        n = int(sup.shape[0]) if sup.dim() == 1 else -1
        tail = n - int(sup.sum())
        if n < 1 or tail >= n or not bool(sup[: n - tail].all()):
            return None
        seen.add((length - n, tail))
    return seen.pop() if len(seen) == 1 else None


@attrs.frozen
class _Depth:
    """One depth of the element grid: ``count`` elements spread over anchors 0 .. ``span`` - 1, charged at anchors up
    to ``charged_to``. The full grid fills its span; COD keeps a uniform random subset, so the closed form counts a
    range's share of them (every anchor of the span is equally likely to be kept: each took part in every draw)."""

    count: int
    span: int
    charged_to: int

    def upto(self, q: int) -> int:
        """Elements at anchors <= q."""
        if q < 0 or self.span <= 0:
            return 0
        return self.count * min(q + 1, self.span) // self.span

    def charged(self, lo: int, hi: int) -> int:
        """Charged elements at anchors lo .. hi."""
        return max(0, self.upto(min(hi, self.charged_to)) - self.upto(lo - 1))


def _grid(n: int, tail: int, depth: int, training: Any) -> list[_Depth]:
    """Every depth's elements over ``n`` positions whose last ``tail`` have no loss: the full grid, or what
    ``elements.cod_sample`` keeps. COD's count at a depth is exact while the draw keeps fewer than its candidates; at
    the floor (``cod_min_ratio``) a candidate can drop out at the sequence's end, and this is the count without that
    (at most one element a depth more than the draw)."""
    last = n - tail - 1  # the last position with a loss
    if training.cod_ratio >= 1.0:
        return [_Depth(max(n - d, 0), max(n - d, 0), last - d) for d in range(depth)]
    n_sup = n - tail
    out = [_Depth(n, n, last)]
    kept = max(last, 0)  # depth 1's candidates: anchors 0 .. last - 1
    for d in range(1, depth):
        keep = math.floor(n_sup * max(training.cod_ratio**d, training.cod_min_ratio) + 1e-9)
        kept = min(keep, kept, max(last + 1 - d, 0))
        if kept <= 0:
            break
        out.append(_Depth(kept, last + 1 - d, last - d))
    return out


def _cut_starts(before: Any, n: int, total: int, num_segments: int) -> list[int]:
    """``partition_peagle.cut_positions`` on a cumulative count given as a function, each target found by bisection."""
    candidates = set()
    for s in range(1, num_segments):
        target = s * total / num_segments
        lo, hi = 0, n  # the first position whose count before it reaches the target (n: none)
        while lo < hi:
            mid = (lo + hi) // 2
            if float(before(mid)) >= target:
                hi = mid
            else:
                lo = mid + 1
        after = min(lo, n - 1)
        below = max(after - 1, 0)
        candidates.add(below if (target - float(before(below))) < (float(before(after)) - target) else after)

    def owned(start: int, stop: int) -> int:
        return before(stop) - before(start) if stop < n else total - before(start)

    starts = [0]
    for cut in sorted(candidates):
        if 0 < cut < n and owned(starts[-1], cut) > 0:
            starts.append(cut)
    if len(starts) > 1 and owned(starts[-1], n) == 0:
        starts.pop()
    return starts


def closed_segments(cfg: MemoryConfig, drafter: Any, depth: int, training: Any,
                    shape: tuple[int, int]) -> Counts:
    """``sampled_segments`` without the sequence: the same (forwarded rows, charged, anchors) per segment, counted
    from the grid's per-depth counts and the partitioner's declared rule (``Partitioner.counted_as``: ``whole``, or
    ``balanced_ranges`` as P-EAGLE's partitioner cuts: a segment [x, y) owns depth-0 elements at anchors x .. y-1 and, under the chain rule,
    deeper ones at anchors x-1 .. y-2, under the block rule at x .. y-1; it forwards what it owns plus every earlier
    depth-0 element (chain) or every earlier element (block)). Cost: the depth times the partitions times log L,
    whatever L is."""
    shift, tail = shape
    n = cfg.seq_len - shift
    grid = _grid(n, tail, depth, training)
    total = sum(g.count for g in grid)
    block = drafter.visibility == "block"

    def before(p: int) -> int:  # elements owned by positions < p
        if p >= n:
            return total
        return grid[0].upto(p - 1) + sum(g.upto(p - 1 if block else p - 2) for g in grid[1:])

    balanced = counting_rule(resolved_plan(cfg).partitioner_cls) == "balanced_ranges"
    starts = _cut_starts(before, n, total, cfg.partitions) if balanced else [0]
    out = []
    for j, x in enumerate(starts):
        y = starts[j + 1] if j + 1 < len(starts) else n
        charged = grid[0].charged(x, y - 1)
        anchors = max(0, min(y, grid[0].charged_to + 1) - x)  # every depth-0 element with a loss has its anchor
        if block:
            charged += sum(g.charged(x, y - 1) for g in grid[1:])
            forwarded = before(y)
        else:
            charged += sum(g.charged(x - 1, y - 2) for g in grid[1:])
            forwarded = before(y) - before(x) + x
            # the one deeper anchor before the range (its depth-0 element belongs to the previous segment)
            if x >= 1 and len(grid) > 1 and grid[1].charged(x - 1, x - 1) > 0:
                anchors += 1
        out.append((int(drafter.forwarded_rows(int(forwarded), anchors)), charged, anchors))
    return out, total


def _partitioner(cfg: MemoryConfig) -> Any:
    """The run's partitioner with its options (the run's own, defaults included)."""
    plan = resolved_plan(cfg)
    return plan.partitioner_cls(plan.partitioner_options)


def segment_counts(cfg: MemoryConfig, drafter: Any, depth: int, training: Any) -> Counts:
    """Every segment's counts (``sampled_segments``): sampled up to ``SAMPLED_MAX_LEN``, in closed form beyond where the
    partitioner and the drafter's supervision are ones it describes, else run up to ``RUN_MAX_LEN`` and refused
    beyond with the reason."""
    if cfg.seq_len <= SAMPLED_MAX_LEN:
        return sampled_segments(cfg, drafter, depth, training)
    from specframe.drafting.elements import cod_sample, full_grid

    # the checks running them on a tiny sequence makes: a bad COD ratio or partition count fails as it would there
    _partitioner(cfg).partition(full_grid(2, 1, visibility=drafter.visibility), cfg.partitions)
    if training.cod_ratio < 1.0:
        cod_sample(torch.ones(2, dtype=torch.bool), depth, training.cod_ratio, training.cod_min_ratio,
                   generator=torch.Generator())  # never the global generator: training seeds it
    shape = supervision_shape(drafter)
    known = counting_rule(resolved_plan(cfg).partitioner_cls) is not None
    if shape is not None and known and cfg.seq_len - shape[0] > shape[1]:
        return closed_segments(cfg, drafter, depth, training, shape)
    if cfg.seq_len <= RUN_MAX_LEN:
        return sampled_segments(cfg, drafter, depth, training)
    why = (f"partitioner '{cfg.partitioner}' declares no rule it counts its segments by without running it "
           f"(Partitioner.counted_as)" if not known else
           f"drafter '{cfg.drafter}' supervises an all-loss sequence otherwise than every position but the last few")
    raise UsageError(f"cannot estimate --seq-len {cfg.seq_len}: {why}, so its segments are counted by running it on "
                     f"the sequence, which the estimate does up to {RUN_MAX_LEN} tokens; use --seq-len {RUN_MAX_LEN} "
                     "or less")
