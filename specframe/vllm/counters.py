"""vLLM's speculative-decoding figures as specframe reads them: one prompt's ``VllmGeneration`` and its ``Round`` s
(from vLLM's per-request, per-step counts) and the engine's aggregate ``SpecCounters``. How vLLM 0.32's counters map
onto ``specframe.metrics`` is told in ``specframe.vllm.engine``'s docstring (docs/design.md section 8). Plain
records: the parent process rebuilds them from a child's dictionaries (``as_dict`` / ``from_dict``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from specframe.errors import SpecframeError
from specframe.metrics import PromptMetrics


@attrs.frozen
class Round:
    """One decode forward as vLLM reported it: ``drafted`` draft tokens, ``accepted`` of them, ``emitted`` kept."""

    drafted: int
    accepted: int
    emitted: int


@attrs.frozen
class VllmGeneration:
    """One prompt's outcome: new ``tokens`` (the prefill's first), the decode ``rounds`` (drafting steps in order,
    then the draft-less decode forwards, whose position in the sequence vLLM does not report) and timings."""

    tokens: tuple[int, ...]
    rounds: tuple[Round, ...]
    decode_seconds: float
    total_seconds: float

    def prompt_metrics(self) -> PromptMetrics:
        return PromptMetrics(
            emitted=sum(r.emitted for r in self.rounds),
            forwards=len(self.rounds),
            accepted=tuple(r.accepted for r in self.rounds),
            drafted=tuple(r.drafted for r in self.rounds),
            decode_seconds=self.decode_seconds,
        )

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VllmGeneration:
        return cls(
            tokens=tuple(data["tokens"]),
            rounds=tuple(Round(**r) for r in data["rounds"]),
            decode_seconds=data["decode_seconds"],
            total_seconds=data["total_seconds"],
        )


def rounds_from_steps(n_tokens: int, accepted: Sequence[int], drafted: Sequence[int]) -> tuple[Round, ...]:
    """specframe rounds from vLLM's per-step counts for a request that produced ``n_tokens`` tokens.

    Step i emitted accepted[i] + 1 tokens, cut so the total never passes the n_tokens - 1 decode tokens (vLLM cuts
    the output at ``max_tokens`` / eos after counting). Decode tokens left over came from draft-less forwards.
    """
    if len(accepted) != len(drafted):
        raise SpecframeError(f"vLLM reported {len(accepted)} accepted counts for {len(drafted)} drafting steps")
    remaining = max(n_tokens - 1, 0)
    rounds = []
    for a, d in zip(accepted, drafted):
        if not 0 <= a <= d:
            raise SpecframeError(f"vLLM reported {a} accepted of {d} drafted tokens in one step")
        emitted = min(a + 1, remaining)
        remaining -= emitted
        rounds.append(Round(drafted=int(d), accepted=min(int(a), emitted), emitted=emitted))
    rounds.extend(Round(drafted=0, accepted=0, emitted=1) for _ in range(remaining))
    return tuple(rounds)


@attrs.frozen
class SpecCounters:
    """vLLM's aggregate spec-decode counters (cumulative over an engine's life)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    @classmethod
    def from_metrics(cls, metrics: Iterable[Any]) -> SpecCounters:
        """From ``LLM.get_metrics()`` (objects with ``name`` and ``value`` or ``values``)."""
        by_name = {m.name: m for m in metrics}

        def value(name: str) -> int:
            m = by_name.get(f"vllm:spec_decode_{name}")
            return int(m.value) if m is not None else 0

        per_pos = by_name.get("vllm:spec_decode_num_accepted_tokens_per_pos")
        return cls(
            drafts=value("num_drafts"),
            draft_tokens=value("num_draft_tokens"),
            accepted_tokens=value("num_accepted_tokens"),
            accepted_per_pos=tuple(int(v) for v in per_pos.values) if per_pos is not None else (),
        )

    def minus(self, before: SpecCounters) -> SpecCounters:
        """The counts between two snapshots."""
        pos = [a - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0) for i, a in enumerate(self.accepted_per_pos)]
        return SpecCounters(
            drafts=self.drafts - before.drafts,
            draft_tokens=self.draft_tokens - before.draft_tokens,
            accepted_tokens=self.accepted_tokens - before.accepted_tokens,
            accepted_per_pos=tuple(pos),
        )

    def drafting_acceptance_length(self) -> float:
        """Tokens emitted per *drafting* verification step (accepted + the target's token), vLLM's "mean acceptance
        length". It equals specframe's AL when every decode forward drafted and nothing was cut at ``max_tokens``;
        ``VllmGeneration.prompt_metrics`` gives the exact figure."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else float("nan")

    def per_slot_acceptance(self) -> list[float]:
        """Slot i accepted / drafting steps: specframe's per-slot acceptance (``specframe.metrics``)."""
        return [c / self.drafts if self.drafts else float("nan") for c in self.accepted_per_pos]

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)
