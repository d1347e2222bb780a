"""Train/serve parity: does vLLM produce what specframe's reference engine produces, and accept as much?

Two greedy runs of the same target on the same prompt ids must agree token for token, except after a near-tie of
the target's top-2 logits, where different kernels may legitimately pick different tokens. ``top2_gaps`` measures
those gaps with the transformers target on CPU in fp32 along the reference tokens; ``compare_tokens`` compares up
to the first gap below ``eps``.

Acceptance is compared per verification round where both engines expose it: the reference engine records every
round (``specframe.inference.Round``); vLLM 0.32 reports per-request, per-step accepted / drafted counts when
started with ``per_request_spec_decode_metrics="detailed"`` (``specframe.vllm.engine`` does), in order, but only for
steps that carried a draft (draft-less decode steps are counted as leftovers, order unknown). ``compare_rounds``
therefore pairs drafting rounds in order, over the rounds wholly inside the compared token prefix, and
``compare_per_slot`` compares the aggregate per-slot counts (what vLLM's Prometheus counters expose).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

DEFAULT_EPS = 1e-3


def top2_gaps(model: Any, prompt_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """[len(tokens)] top-1 minus top-2 logit of ``model`` (a transformers causal LM) at each position that predicts
    ``tokens[i]`` after ``prompt_ids`` + ``tokens[:i]``, computed in fp32 in one teacher-forced forward."""
    ids = torch.tensor([list(prompt_ids) + list(tokens)], dtype=torch.long)
    if not tokens:
        return torch.zeros(0)
    with torch.no_grad():
        logits = model.float()(ids).logits[0, len(prompt_ids) - 1 : ids.shape[1] - 1].float()
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


@attrs.frozen
class TokenParity:
    """``compared`` positions checked (up to ``tie_at``, the first near-tie, or the shorter output);
    ``first_mismatch`` the first differing position among them, None when they agree."""

    compared: int
    first_mismatch: int | None
    tie_at: int | None

    @property
    def equal(self) -> bool:
        return self.first_mismatch is None


def compare_tokens(
    reference: Sequence[int], candidate: Sequence[int], gaps: torch.Tensor | Sequence[float], eps: float = DEFAULT_EPS
) -> TokenParity:
    """Compare two greedy outputs up to the first position whose reference top-2 gap is below ``eps``."""
    gaps = torch.as_tensor(gaps, dtype=torch.float32)
    if gaps.numel() < len(reference):
        raise ValueError(f"{gaps.numel()} gaps for {len(reference)} reference tokens")
    ties = (gaps[: len(reference)] < eps).nonzero()
    tie_at = int(ties[0]) if len(ties) else None
    limit = min(len(reference), len(candidate), tie_at if tie_at is not None else len(reference))
    mismatch = next((i for i in range(limit) if int(reference[i]) != int(candidate[i])), None)
    if mismatch is None and tie_at is None and len(reference) != len(candidate):
        mismatch = limit  # one run stopped earlier although no tie explains it
    return TokenParity(compared=limit, first_mismatch=mismatch, tie_at=tie_at)


@attrs.frozen
class RoundParity:
    """Drafting rounds paired in order (``compared`` of them); ``equal`` of them accepted as many tokens;
    ``first_difference`` the index of the first that did not; ``reference`` / ``candidate`` the accepted counts."""

    compared: int
    equal: int
    first_difference: int | None
    reference: tuple[int, ...]
    candidate: tuple[int, ...]

    @property
    def identical(self) -> bool:
        return self.first_difference is None


def _drafting_prefix(rounds: Sequence[Any], tokens: int) -> list[int]:
    """Accepted counts of the drafting rounds that lie wholly within the first ``tokens`` decode tokens."""
    out, emitted = [], 0
    for r in rounds:
        emitted += r.emitted
        if emitted > tokens:
            break
        if r.drafted:
            out.append(int(r.accepted))
    return out


def compare_rounds(reference_rounds: Sequence[Any], candidate_rounds: Sequence[Any], parity: TokenParity) -> RoundParity:
    """Pair the drafting rounds of two runs (objects with ``drafted``, ``accepted``, ``emitted``) inside the token
    prefix ``parity`` found equal (decode tokens exclude the prefill's first token)."""
    tokens = max(parity.compared if parity.first_mismatch is None else parity.first_mismatch, 1) - 1
    ref = _drafting_prefix(reference_rounds, tokens)
    cand = _drafting_prefix(candidate_rounds, tokens)
    n = min(len(ref), len(cand))
    diffs = [i for i in range(n) if ref[i] != cand[i]]
    return RoundParity(
        compared=n,
        equal=n - len(diffs),
        first_difference=diffs[0] if diffs else None,
        reference=tuple(ref[:n]),
        candidate=tuple(cand[:n]),
    )


def per_slot_counts(rounds: Sequence[Any], k: int) -> list[int]:
    """How many drafting rounds accepted slot i, i = 1..k (vLLM's ``num_accepted_tokens_per_pos``)."""
    return [sum(1 for r in rounds if r.drafted and r.accepted >= i) for i in range(1, k + 1)]


def compare_per_slot(reference_rounds: Sequence[Any], counts: Sequence[int], drafts: int, k: int) -> dict[str, Any]:
    """Aggregate comparison against vLLM's counters (``SpecCounters.accepted_per_pos`` and ``drafts``): per-slot
    acceptance rates of both and their largest absolute difference."""
    ref_drafts = sum(1 for r in reference_rounds if r.drafted)
    ref = [c / ref_drafts if ref_drafts else float("nan") for c in per_slot_counts(reference_rounds, k)]
    cand = [c / drafts if drafts else float("nan") for c in list(counts)[:k]]
    return {
        "reference": ref,
        "vllm": cand,
        "max_abs_difference": max((abs(a - b) for a, b in zip(ref, cand)), default=float("nan")),
    }
