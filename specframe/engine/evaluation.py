"""Validation and confidence calibration: the held-out figures of a run (loss, per-depth top-1, the chain's expected
acceptance length, the confidence's calibration error) and, once at the end, the drafter's calibration fitted on the
held-out chains (API 8). The loop calls ``evaluate`` and ``calibrate``; the per-sequence work (elements, segments, a
segment's loss) is the loop's own (``engine.segments``), handed in."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from specframe import api
from specframe.engine.segments import record_hits
from specframe.interfaces.drafter import charged_weight
from specframe.metrics import chain_acceptance, expected_acceptance_length

#: the last validation's held-out chains: (confidence logits, verdicts, validation sequence of each), API 8
HeldOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def evaluate(*, step: int, drafter: api.Drafter, depth: int, val_ids: list[int], source: Any, dist: Any,
             autocast: Callable[[], Any], elements: Callable, segments: Callable, loss: Callable,
             ) -> tuple[dict[str, Any], HeldOut | None]:
    """The validation record at ``step`` and the held-out chains a calibration fits on. Each rank evaluates every
    world-th validation sequence (``elements(example, None)``, ``segments(elems)``, ``loss(example, elems, seg,
    sup)``) and every figure is summed over the ranks."""
    module = drafter.module()
    module.eval()
    loss_sum = torch.zeros(1)
    count = torch.zeros(1)
    # the loss's normaliser, as in training: the charged elements' summed weights (their count without weights)
    weight = torch.zeros(1, dtype=torch.float64)
    correct = torch.zeros(depth)
    total = torch.zeros(depth)
    # chain acceptance: anchors with a full chain, their accepted depths, and per depth reached / accepted
    chain = torch.zeros(2 + 2 * depth)
    chained = True  # every segment returned per-element hits
    # [elements the draft-vocabulary position mask left out, elements of segments that report it]
    masked = torch.zeros(2)
    held_out: list[tuple[torch.Tensor, ...]] = []  # (confidence logits, verdicts, sequence) of full chains
    # [present, validation index, anchors, accepted sum] per sequence: what a bootstrap over held-out sequences
    # resamples. One row per validation sequence, filled by the rank that evaluates it and summed over ranks with
    # the other figures (a plain all-reduce, as every other figure here travels)
    per_sequence = torch.zeros(len(val_ids), 4, dtype=torch.float64)
    for j, idx in enumerate(val_ids):
        if j % dist.world != dist.rank:
            continue
        example = source.example(idx)
        elems, sup = elements(example, None)
        weight += charged_weight(drafter, example, elems, sup)
        # verdict of element (anchor, depth): -1 none (not charged or not returned), else 0 / 1
        hits = torch.full((elems.seq_len, depth), -1, dtype=torch.long)
        # the drafter's confidence logit of each element (API 8), NaN where it gives none
        logits = torch.full((elems.seq_len, depth), math.nan, dtype=torch.float64)
        # its chance of acceptance under the rule the confidence is calibrated for (API 12), NaN where none
        acceptance = torch.full((elems.seq_len, depth), math.nan, dtype=torch.float64)
        for seg in segments(elems):
            with autocast():
                terms = loss(example, elems, seg, sup)
            loss_sum += terms.loss_sum.float()
            count += terms.count
            correct += terms.correct.float()
            total += terms.total.float()
            if getattr(terms, "masked", None) is not None:
                masked += torch.tensor([float(terms.masked), float(terms.count)])
            if terms.hit is None:
                chained = False
                continue
            record_hits(hits, elems, seg, sup, terms.hit)
            if getattr(terms, "confidence", None) is not None:
                record_hits(logits, elems, seg, sup, terms.confidence.double())
            if getattr(terms, "acceptance", None) is not None:
                record_hits(acceptance, elems, seg, sup, terms.acceptance.double())
        if chained:
            c = chain_acceptance(hits)
            chain += torch.tensor([c.anchors, c.accepted_sum, *c.reached, *c.accepted], dtype=chain.dtype)
            per_sequence[j] = torch.tensor([1.0, float(idx), float(c.anchors), float(c.accepted_sum)])
            full = hits.ge(0).all(1) & logits.isfinite().all(1)  # anchors with a full chain and its confidence
            if full.any():
                observed = torch.where(acceptance.isnan(), hits.clamp(min=0).double(), acceptance)
                held_out.append((logits[full], observed[full], torch.full((int(full.sum()),), j)))
    flag = torch.tensor([0.0 if chained else 1.0])
    for t in (loss_sum, count, weight, correct, total, chain, flag, masked, per_sequence):
        dist.sum_(t)
    module.train()
    held_out_confidence = gather_confidence(dist, held_out) if flag.item() == 0 else None
    acc = [float(c / t) if t > 0 else 0.0 for c, t in zip(correct, total, strict=True)]
    # exact only when a depth's hits are independent of the shallower depths'; with per-element hits
    # (LossTerms.hit) val_expected_al is the measured chain mean instead
    product = expected_acceptance_length(acc)
    out: dict[str, Any] = {
        "step": step,
        "val_loss": float(loss_sum.item() / (weight.item() if weight.item() > 0 else 1.0)),
        "val_elements": int(count.item()),
        "val_accuracy": acc,
        "val_product_al": product,
    }
    if masked[1] > 0:  # share of validation elements whose target top-1 lies outside the draft vocabulary
        out["val_vocab_masked"] = float(masked[0] / masked[1])
    anchors = int(chain[0].item())
    if flag.item() == 0 and anchors:
        k = depth
        reached, accepted = chain[2 : 2 + k], chain[2 + k :]
        out["val_expected_al"] = 1.0 + float(chain[1].item()) / anchors
        out["val_expected_al_method"] = "chain"
        out["val_chain_anchors"] = anchors
        out["val_chain_per_sequence"] = [[int(i), int(a), int(acc)] for present, i, a, acc in per_sequence.tolist()
                                         if present > 0]
        out["val_conditional_accuracy"] = [float(a / r) if r > 0 else 0.0 for a, r in zip(accepted, reached)]
    else:  # the drafter reports per-depth counts only
        out["val_expected_al"] = product
        out["val_expected_al_method"] = "per-depth product"
    if held_out_confidence is not None:
        out.update(confidence_metrics(drafter, *held_out_confidence[:2]))
    return out, held_out_confidence


def gather_confidence(dist: Any, held_out: list[tuple[torch.Tensor, ...]]) -> HeldOut | None:
    """Every rank's held-out (confidence logits, verdicts, sequence) together, on every rank (a calibration
    fitted on them is then the same everywhere), or None when the drafter gave no confidence."""
    parts = held_out
    if dist.world > 1:
        gathered: list[Any] = [None] * dist.world
        dist.dist.all_gather_object(gathered, held_out)
        parts = [pair for rank in gathered for pair in rank]
    if not parts:
        return None
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


def confidence_metrics(drafter: api.Drafter, logits: torch.Tensor, accepted: torch.Tensor) -> dict[str, Any]:
    """The validation metrics of the drafter's calibrated confidence on held-out chains: the prefix acceptance's
    ECE (``calibration.prefix_ece``: its mean, one per prefix length, and the rows it was measured on)."""
    from specframe.drafting.calibration import prefix_ece

    ece = prefix_ece(drafter.calibrated_confidence(logits), accepted)
    return {"val_confidence_ece": ece["mean"], "val_confidence_ece_by_position": ece["per_position"],
            "val_confidence_anchors": ece["anchors"]}


def calibrate(drafter: api.Drafter, held_out: HeldOut | None, step: int) -> dict[str, Any] | None:
    """API 8: fit the drafter's calibration on the last validation's held-out chains; the calibration record when
    it fitted something, else None.

    The ECE it reports is out of sample: the validation sequences are split in two (alternate sequences, so the
    anchors of one sequence stay together), the drafter calibrates on one half and the other half is measured
    before and after; the drafter then calibrates on every chain, which is the fit it keeps. With one validation
    sequence there is no second half, and the figures are the fitted chains' own (``in_sample`` says which)."""
    if held_out is None:
        return None
    logits, accepted, sequence = held_out
    check = (sequence % 2) == 1
    in_sample = not bool(check.any()) or bool(check.all())
    fit_rows, check_rows = (slice(None), slice(None)) if in_sample else (~check, check)
    before = confidence_metrics(drafter, logits[check_rows], accepted[check_rows])
    if not drafter.calibrate(logits[fit_rows], accepted[fit_rows]):
        return None
    after = confidence_metrics(drafter, logits[check_rows], accepted[check_rows])
    if not in_sample:
        drafter.calibrate(logits, accepted)  # the fit kept: on every held-out chain
    return {"step": step, "calibrated": True, "calibration_anchors": int(logits.shape[0]),
            "calibration_in_sample": in_sample, "calibration_checked_anchors": before["val_confidence_anchors"],
            "confidence_ece_before": before["val_confidence_ece"],
            "confidence_ece_after": after["val_confidence_ece"],
            "confidence_ece_after_by_position": after["val_confidence_ece_by_position"]}
