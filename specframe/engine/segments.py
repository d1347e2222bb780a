"""What one sequence's training step and its validation share: its elements (the full grid, or COD's sample), their
segments (the partitioner's, checked) and a segment's loss (through the DDP / FSDP wrapper when training, checked
against the API on the run's first step). Below both the loop and ``engine.evaluation``, so neither imports the
other."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from specframe import api
from specframe.drafting.elements import full_grid, position_docs
from specframe.engine import validate
from specframe.engine.sharding import DrafterLoss


def elements(drafter: api.Drafter, depth: int, training: api.Training, example: api.TrainingExample,
             generator: torch.Generator | None) -> tuple[Any, torch.Tensor]:
    """``example``'s elements and the drafter's supervision: COD's sample (seeded by ``generator``) where the
    drafter's training declaration samples, else the full grid; under the drafter's visibility rule."""
    sup = drafter.supervision(example).to(torch.bool)
    n = sup.shape[0]
    # the drafter's positions are the last n data positions (EAGLE's shift drops the first); in a packed
    # sequence a position that straddles two documents gets one of its own
    doc = position_docs(example.doc, n)
    ratio = training.cod_ratio
    if ratio < 1.0 and generator is not None:
        from specframe.drafting.elements import cod_sample

        elems = cod_sample(sup, depth, ratio, training.cod_min_ratio, generator=generator, doc=doc)
    else:
        elems = full_grid(n, depth, doc)
    # the drafter's declared visibility rule (api 2) travels with its elements to the partitioner and builder
    return elems.with_visibility(drafter.visibility), sup


def anchor_sample(elems: Any, sup: torch.Tensor, max_anchors: int | None,
                  generator: torch.Generator | None) -> torch.Tensor | None:
    """The anchors a training step charges when the drafter caps them (``Training.max_anchors``): a bool per position,
    true at a uniform sample of ``max_anchors`` of the anchors whose depth-0 element is charged (drawn with the step's
    ``generator``, as the block drafters' references draw 512: SpecForge, DeepSpec, speculators). None when every
    anchor is charged: no cap, validation (no generator), or no more such anchors than the cap; then nothing is
    drawn, so such a step is bit for bit the step without a cap."""
    if max_anchors is None or generator is None:
        return None
    eligible = elems.anchor[(elems.depth == 0) & sup.to(torch.bool)[elems.position]]  # one depth-0 per anchor
    if eligible.numel() <= max_anchors:
        return None
    kept = torch.zeros(int(sup.shape[0]), dtype=torch.bool)
    kept[eligible[torch.randperm(eligible.numel(), generator=generator)[:max_anchors]]] = True
    return kept


def sampled_elements(elems: Any, kept: torch.Tensor) -> Any:
    """``elems`` without the deeper elements of the anchors ``kept`` leaves out: under either visibility rule a deeper
    element is a key only to its own anchor's elements, so no kept element loses one. Every depth-0 element stays:
    each is the context of every later anchor (``rule_matrix``'s context clause)."""
    keep = (elems.depth == 0) | kept[elems.anchor]
    return elems.subset(torch.nonzero(keep).squeeze(1))


def uncharge(segs: list[api.Segment], elems: Any, kept: torch.Tensor) -> list[api.Segment]:
    """``segs`` with the depth-0 elements of the anchors ``kept`` leaves out charged nothing (they stay as context);
    the partitioner placed them, so its partition is checked before (``segments``)."""
    out = []
    for seg in segs:
        idx = seg.elements
        dropped = (elems.depth[idx] == 0) & ~kept[elems.anchor[idx]]
        out.append(api.Segment(seg.elements, seg.loss_mask & ~dropped.to(seg.loss_mask.device)))
    return out


def charged(elems: Any, segs: list[api.Segment], sup: torch.Tensor) -> torch.Tensor:
    """Which of ``elems`` a step charges: supervised at its position and charged by its segment's loss mask (every
    element is placed in exactly one segment; without an anchor sample this is the supervision at each position)."""
    mask = torch.zeros(len(elems), dtype=torch.bool)
    for seg in segs:  # an element is context (uncharged) in later segments than its own: or, never overwrite
        idx = seg.elements.cpu()
        mask[idx] |= seg.loss_mask.to(torch.bool).cpu()
    return mask & sup.to(torch.bool).cpu()[elems.position.cpu()]


def segments(partitioner: Any, partitions: int, elems: Any) -> list[api.Segment]:
    """The partitioner's segments of ``elems`` (checked to cover each element once), the empty ones left out."""
    from specframe.drafting.elements import check_partition

    segs = partitioner.partition(elems, partitions)
    check_partition(elems, segs, partitioner.name)
    return [seg for seg in segs if seg.elements.numel()]  # an empty segment has nothing to forward


def segment_loss(drafter: api.Drafter, attention_builder: Any, wrapped: Callable | None, example: api.TrainingExample,
                 elems: Any, seg: api.Segment, sup: torch.Tensor, *, training: bool,
                 check: tuple[str | None, str] | None) -> api.LossTerms:
    """The drafter's loss terms of one segment. ``wrapped``: the DDP / FSDP module a training loss runs through;
    ``check``: (mask builder, drafter) names under which the attention and the terms are checked (the run's first
    step), None once they were."""
    sub = elems.subset(seg.elements)
    attention = api.SegmentAttention.build(attention_builder, sub)
    # under DDP / FSDP a training loss runs through the wrapper's forward, which arms the gradient reduction (and
    # under FSDP gathers the parameters)
    loss = wrapped if training and wrapped is not None else DrafterLoss.call(drafter)
    if check is None:
        return loss(example, elems, seg, attention)[1]
    # the first step checks every plugin's output so a broken plugin is named, not a shape error deep in autograd
    builder_name, drafter_name = check
    attention = validate.CheckedAttention(attention, builder_name)
    terms = loss(example, elems, seg, attention)[1]
    validate.check_loss_terms(terms, drafter_name, elems, seg, sup, training=training)
    return terms


def record_hits(
    hits: torch.Tensor, elems: Any, segment: api.Segment, supervision: torch.Tensor, hit: torch.Tensor
) -> torch.Tensor:
    """Write a segment's per-element verdicts (``LossTerms.hit``, charged elements in segment order) into ``hits``
    [anchors, K] at their (anchor, depth); ``specframe.metrics.chain_acceptance`` reads the result. The same for
    any per-element value (``LossTerms.confidence``) into a matrix of its dtype."""
    sub = elems.subset(segment.elements)
    charged = segment.loss_mask.to(torch.bool).cpu() & supervision.to(torch.bool).cpu()[sub.position.cpu()]
    hits[sub.anchor.cpu()[charged], sub.depth.cpu()[charged]] = hit.detach().cpu().to(hits.dtype)
    return hits
