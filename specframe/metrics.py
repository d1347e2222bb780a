"""Speculative-decoding metrics, defined once (docs/design.md section 8).

- Acceptance length (AL): tokens emitted per target verification forward, bonus/correction token included, the
  prefill forward (and the token it yields) excluded. A round that drafted K tokens emits 1..K+1, so
  1 <= AL <= K+1. Aggregated over prompts it is pooled: total emitted / total forwards.
- Per-position acceptance, reported both ways, for draft slots i = 1..K:
  *per slot* (vLLM's count): rounds whose draft slot i was accepted / rounds that drafted anything;
  *conditional* (EAGLE's): rounds accepting slot i / rounds that accepted slots 1..i-1 and drafted slot i.
- OTPS: tokens emitted by decode forwards / wall time of the decode phase (prefill excluded on both sides).
- Speedup: OTPS(speculative) / OTPS(plain), same target, prompts and run.

Validation (training) side: ``chain_acceptance`` is the same AL measured teacher-forced on validation data: for each
anchor with a full chain of K supervised depths, the number of consecutive top-1 hits from depth 0, plus the bonus
token, averaged over those anchors. That is what greedy chain verification emits at that anchor when the validation
sequence is the target's own greedy continuation. ``expected_acceptance_length`` (1 + sum_k prod_{i<=k} acc_i) is
the older estimate from per-depth accuracies alone; it equals the chain mean only when a depth's hits are
independent of the shallower depths', and the engine reports it beside the chain figure, never instead of it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

import attrs


@attrs.frozen
class PromptMetrics:
    """The figures of one decoded prompt. ``accepted`` / ``drafted``: per decode forward, draft tokens accepted and
    draft depth (0 = nothing drafted); ``emitted``: tokens those forwards emitted."""

    emitted: int
    forwards: int
    accepted: tuple[int, ...]
    drafted: tuple[int, ...]
    decode_seconds: float

    @classmethod
    def of(cls, generation: Any) -> PromptMetrics:
        """From a ``specframe.inference.Generation``."""
        rounds = generation.rounds
        return cls(
            emitted=sum(r.emitted for r in rounds),
            forwards=len(rounds),
            accepted=tuple(r.accepted for r in rounds),
            drafted=tuple(r.drafted for r in rounds),
            decode_seconds=generation.decode_seconds,
        )

    @property
    def acceptance_length(self) -> float:
        return self.emitted / self.forwards if self.forwards else float("nan")

    @property
    def otps(self) -> float:
        return self.emitted / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def per_slot_acceptance(accepted: Sequence[int], drafted: Sequence[int], k: int) -> list[float]:
    """Fraction of drafting rounds whose slot i (1..k) was accepted, as vLLM counts it."""
    rounds = sum(1 for d in drafted if d > 0)
    if not rounds:
        return [float("nan")] * k
    return [sum(1 for a in accepted if a >= i) / rounds for i in range(1, k + 1)]


def conditional_acceptance(accepted: Sequence[int], drafted: Sequence[int], k: int) -> list[float]:
    """P(slot i accepted | slots 1..i-1 accepted and slot i drafted), i = 1..k, as EAGLE reports it."""
    out = []
    for i in range(1, k + 1):
        reached = [a for a, d in zip(accepted, drafted) if a >= i - 1 and d >= i]
        out.append(sum(1 for a in reached if a >= i) / len(reached) if reached else float("nan"))
    return out


@attrs.frozen
class AggregateMetrics:
    """Pooled figures over prompts; ``speedup`` is None without a plain-decoding baseline."""

    prompts: int
    emitted: int
    forwards: int
    acceptance_length: float
    per_slot: tuple[float, ...]
    conditional: tuple[float, ...]
    otps: float
    decode_seconds: float
    speedup: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def aggregate(prompts: Iterable[PromptMetrics], k: int, baseline: Iterable[PromptMetrics] | None = None) -> AggregateMetrics:
    """Pool per-prompt metrics; ``k`` is the number of draft slots reported; ``baseline`` plain-decoding runs of the
    same prompts give the speedup."""
    prompts = list(prompts)
    emitted = sum(p.emitted for p in prompts)
    forwards = sum(p.forwards for p in prompts)
    seconds = sum(p.decode_seconds for p in prompts)
    accepted = [a for p in prompts for a in p.accepted]
    drafted = [d for p in prompts for d in p.drafted]
    otps = emitted / seconds if seconds > 0 else float("nan")
    speedup = None
    if baseline is not None:
        base = list(baseline)
        base_seconds = sum(p.decode_seconds for p in base)
        if base_seconds > 0 and seconds > 0:
            speedup = otps / (sum(p.emitted for p in base) / base_seconds)
    return AggregateMetrics(
        prompts=len(prompts),
        emitted=emitted,
        forwards=forwards,
        acceptance_length=emitted / forwards if forwards else float("nan"),
        per_slot=tuple(per_slot_acceptance(accepted, drafted, k)),
        conditional=tuple(conditional_acceptance(accepted, drafted, k)),
        otps=otps,
        decode_seconds=seconds,
        speedup=speedup,
    )


def expected_acceptance_length(per_depth_accuracy: Sequence[float]) -> float:
    """AL implied by per-depth top-1 accuracy: 1 + sum_k prod_{i<=k} acc_i.

    Assumes ``acc_i`` is the *conditional* accuracy at depth i (correct given every shallower depth was correct,
    which is what training measures when depth i is fed the true tokens before it) and greedy chain verification;
    the leading 1 is the target's own token. Bounded by len(per_depth_accuracy) + 1.
    """
    total, running = 1.0, 1.0
    for acc in per_depth_accuracy:
        if not 0.0 <= acc <= 1.0:
            raise ValueError(f"accuracies must lie in [0, 1], got {acc}")
        running *= acc
        total += running
    return total


@attrs.frozen
class ChainAcceptance:
    """Teacher-forced chain acceptance over anchors: ``anchors`` with a full chain, ``accepted_sum`` the sum of their
    accepted depths (consecutive hits from depth 0), ``reached[d]`` / ``accepted[d]`` the anchors whose depths
    0..d-1 were all hits and those of them that hit depth d too (EAGLE's conditional acceptance)."""

    anchors: int
    accepted_sum: int
    reached: tuple[int, ...]
    accepted: tuple[int, ...]

    @property
    def acceptance_length(self) -> float:
        """Mean accepted chain length plus the bonus token; nan without a full chain."""
        return 1.0 + self.accepted_sum / self.anchors if self.anchors else float("nan")

    @property
    def conditional(self) -> list[float]:
        return [a / r if r else float("nan") for a, r in zip(self.accepted, self.reached)]


def chain_acceptance(hits: Any) -> ChainAcceptance:
    """Chain acceptance of a hit matrix [anchors, K] (bool, or int with -1 for an element that has no verdict).

    A row with any -1 (a depth without supervision: the end of an answer, a document boundary) has no full chain and
    is left out, as decoding never drafts past the end of what it verifies.
    """
    import torch

    hits = torch.as_tensor(hits)
    if hits.dim() != 2:
        raise ValueError(f"hits must be a matrix [anchors, K], got shape {tuple(hits.shape)}")
    k = int(hits.shape[1])
    full = hits.ge(0).all(1) if hits.dtype != torch.bool else torch.ones(hits.shape[0], dtype=torch.bool)
    rows = hits[full].bool() if hits.dtype != torch.bool else hits
    prefix = rows.long().cumprod(1)  # prefix[:, d]: depths 0..d all hit
    reached = [int(rows.shape[0])] + [int(prefix[:, d - 1].sum()) for d in range(1, k)]
    return ChainAcceptance(
        anchors=int(rows.shape[0]),
        accepted_sum=int(prefix.sum()),
        reached=tuple(reached),
        accepted=tuple(int(prefix[:, d].sum()) for d in range(k)),
    )


def bootstrap_al(prompts: Sequence[PromptMetrics], *, resamples: int = 2000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
    """A percentile bootstrap interval of the pooled acceptance length, resampling prompts with replacement."""
    if not prompts:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    emitted = [p.emitted for p in prompts]
    forwards = [p.forwards for p in prompts]
    n = len(prompts)
    stats = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        f = sum(forwards[i] for i in idx)
        stats.append(sum(emitted[i] for i in idx) / f if f else float("nan"))
    stats.sort()
    lo = stats[int((1 - level) / 2 * (resamples - 1))]
    hi = stats[int((1 + level) / 2 * (resamples - 1))]
    return lo, hi
