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
