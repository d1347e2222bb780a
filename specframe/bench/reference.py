"""The interleaved comparison on the reference engine (``compare``): acceptance and speed of several methods on the
same prompts, shared by ``specframe bench`` and ``benchmarks/``.

A comparison decodes the same prompts with several ``Method`` s (plain decoding first, then n-gram and trained
drafters) in one process, interleaved: for every repeat, for every prompt, each method in turn (the order rotates
per repeat), so a machine slowing down mid-run slows every method alike. From that:

- per method, the pooled metrics of ``specframe.metrics`` (AL, per-slot and conditional acceptance, OTPS) and the
  drafter's own cost per round (wall time inside ``propose`` / ``propose_tree`` / ``accept``, measured separately);
- speedup over plain decoding and ratios between methods: one ratio per repeat (OTPS pooled over the prompts of
  that repeat), summarised by the geometric mean with a 95% Student-t interval on the log ratios;
- ``lossless``: under a greedy verifier every method must emit plain decoding's tokens, prompt for prompt;
- what the speed is made of: R, a speculative round's wall time over one plain decoding step (``round_cost_ratio``),
  and the break-even AL (``break_even_al``, = R: speedup ~ AL / R, so a drafter wins only where its AL exceeds R);
- plausibility: a repeat whose speedup exceeds the physical bound (AL x 1.05: a round costs at least one target
  forward) or lies more than 2x off the repeats' median is flagged and that repeat is measured again, at most
  ``MAX_REMEASURE`` times; a ratio still flagged after that is left out of the reported speedup and listed in
  ``speed_flags`` (never reported as a result).

Evaluation protocol (docs/design.md section 8): prompts through the target's chat template; every user turn is a prompt,
a later turn asked after the target's own (plain-decoded) answer to the earlier ones, so MT-Bench gives two prompts
per question; the first N prompts by id.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from specframe import api
from specframe.bench.methods import PLAIN, Method, builds_trees, is_greedy
from specframe.bench.prompts import BenchPrompt, chat_ids
from specframe.errors import UsageError
from specframe.inference.engine import DEFAULT_MAX_NEW_TOKENS, Generation, generate
from specframe.metrics import AggregateMetrics, PromptMetrics, aggregate
from specframe.stats import Interval, TwoWayInterval, speed_flags, two_way_ratio


#: how many times flagged repeats are measured again before the flags are reported instead
MAX_REMEASURE = 2


def round_cost(spec: AggregateMetrics, plain: AggregateMetrics) -> dict[str, float | None]:
    """R = a speculative round's decode time over a plain step's (both per target forward), and the break-even AL
    it implies (R itself: speedup ~ AL / R)."""
    if not (spec.forwards and plain.forwards and spec.decode_seconds > 0 and plain.decode_seconds > 0):
        return {"round_cost_ratio": None, "break_even_al": None}
    r = (spec.decode_seconds / spec.forwards) / (plain.decode_seconds / plain.forwards)
    return {"round_cost_ratio": r, "break_even_al": r}


class _TimedDrafter:
    """Forwards to a drafter, adding the wall time of its decode-phase calls (every ``propose`` / ``propose_tree``
    and every ``accept`` but the first, which commits the prefill's token) to ``seconds``."""

    def __init__(self, drafter: api.Drafter) -> None:
        self._drafter = drafter
        self._accepts = 0
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._drafter, name)

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - started

    def propose(self, k: int, generator: torch.Generator | None = None) -> api.Draft:
        return self._timed(self._drafter.propose, k, generator)

    def propose_tree(self, depth: int, top_k: int, total: int, generator: torch.Generator | None = None) -> api.Draft:
        return self._timed(self._drafter.propose_tree, depth, top_k, total, generator)

    def accept(self, emitted: torch.Tensor, features: dict[str, torch.Tensor]) -> None:
        self._accepts += 1
        if self._accepts == 1:
            self._drafter.accept(emitted, features)
        else:
            self._timed(self._drafter.accept, emitted, features)


@attrs.frozen
class Trial:
    """One method on one prompt: the generation and the drafter's decode-phase seconds (its cost per round is
    ``draft_seconds / len(generation.rounds)``)."""

    generation: Generation
    draft_seconds: float


def decode(model: Any, prompt_ids: torch.Tensor, verifier: api.Verifier, method: Method, *,
           max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, eos_token_id: Any = None, seed: int = 0) -> Trial:
    """Decode one prompt with ``method`` (seeded generator, no autograd), under its own verifier if it has one."""
    verifier = method.verifier if method.verifier is not None else verifier
    timed = _TimedDrafter(method.drafter) if method.drafter is not None else None
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        generation = generate(
            model, prompt_ids, verifier, timed, k=method.k, tree=method.tree, max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id, generator=generator,
        )
    return Trial(generation, timed.seconds if timed is not None else 0.0)


@attrs.frozen
class Record:
    """One method on one prompt turn in one repeat."""

    prompt: str
    turn: int
    repeat: int
    prompt_tokens: int
    tokens: tuple[int, ...]
    metrics: PromptMetrics
    draft_seconds: float


@attrs.define
class Comparison:
    """Everything one interleaved run measured; ``methods[0]`` is plain decoding. ``remeasured``: how many repeats
    were measured again because a ratio was flagged (``speed_flags``)."""

    methods: list[Method]
    records: dict[str, list[Record]]
    repeats: int
    greedy: bool
    remeasured: int = 0
    #: engine facts worth keeping beside the figures (vLLM: the CPUs its threads were pinned to, start-up times)
    engine_info: dict[str, Any] = attrs.Factory(dict)

    def by_repeat(self, label: str, repeat: int) -> list[Record]:
        return [r for r in self.records[label] if r.repeat == repeat]

    def aggregate(self, label: str) -> AggregateMetrics:
        method = self._method(label)
        plain = [r.metrics for r in self.records[PLAIN]]
        return aggregate([r.metrics for r in self.records[label]], method.slots, plain)

    def _method(self, label: str) -> Method:
        return next(m for m in self.methods if m.label == label)

    def otps_by_repeat(self, label: str) -> list[float]:
        return [aggregate([r.metrics for r in self.by_repeat(label, i)], 0).otps for i in range(self.repeats)]

    def ratio(self, label: str, over: str = PLAIN, exclude: Sequence[int] = ()) -> Interval:
        """OTPS(label) / OTPS(over), one ratio per repeat (``exclude``: repeats left out)."""
        pairs = zip(self.otps_by_repeat(label), self.otps_by_repeat(over))
        return Interval.of([a / b for i, (a, b) in enumerate(pairs) if i not in exclude])

    def ratio_over_prompts(self, label: str, over: str = PLAIN, exclude: Sequence[int] = ()) -> TwoWayInterval:
        """OTPS(label) / OTPS(over) pooled over every prompt turn and repeat, with an interval that resamples the
        turns and the repeats together (``specframe.stats.two_way_ratio``): prompt variation and timing noise, where
        ``ratio``'s interval over repeats holds the timing noise alone. ``exclude``: repeats left out."""
        kept = [i for i in range(self.repeats) if i not in exclude]
        turns = sorted({(r.prompt, r.turn) for r in self.records[over]})

        def cells(name: str, field: str) -> list[list[float]]:
            by = {(r.prompt, r.turn, r.repeat): r.metrics for r in self.records[name]}
            return [[float(getattr(by[(prompt, turn, i)], field)) for i in kept] for prompt, turn in turns]

        return two_way_ratio(cells(label, "emitted"), cells(label, "decode_seconds"),
                             cells(over, "emitted"), cells(over, "decode_seconds"))

    def al_by_repeat(self, label: str) -> list[float]:
        return [aggregate([r.metrics for r in self.by_repeat(label, i)], 0).acceptance_length
                for i in range(self.repeats)]

    def flags(self, label: str) -> list[dict[str, Any]]:
        """``speed_flags`` of ``label``'s speedup over plain decoding, repeat by repeat."""
        return speed_flags(self.ratio(label).values, self.al_by_repeat(label))

    def flagged_repeats(self) -> list[int]:
        return sorted({f["repeat"] for m in self.methods if m.label != PLAIN for f in self.flags(m.label)})

    def draft_seconds_per_round(self, label: str) -> float | None:
        """The drafter's decode-phase time per drafting round (None for plain decoding)."""
        if self._method(label).drafter is None:
            return None
        rounds = sum(r.metrics.forwards for r in self.records[label])
        return sum(r.draft_seconds for r in self.records[label]) / rounds if rounds else float("nan")

    def target_seconds_per_forward(self) -> float:
        """Plain decoding's decode time per forward: the target's cost of one token."""
        agg = aggregate([r.metrics for r in self.records[PLAIN]], 0)
        return agg.decode_seconds / agg.forwards if agg.forwards else float("nan")

    def mismatches(self, label: str) -> list[str]:
        """Prompt turns where ``label`` emitted other tokens than plain decoding (same repeat)."""
        plain = {(r.prompt, r.turn, r.repeat): r.tokens for r in self.records[PLAIN]}
        return sorted({f"{r.prompt}#{r.turn + 1}" for r in self.records[label]
                       if plain[(r.prompt, r.turn, r.repeat)] != r.tokens})

    def summary(self) -> dict[str, Any]:
        """Per method: pooled metrics, speedup interval, drafter cost; plus pairwise ratios between drafters."""
        methods = {}
        for m in self.methods:
            agg = self.aggregate(m.label)
            entry: dict[str, Any] = {
                **agg.as_dict(),
                "k": m.k if m.drafter is not None else 0,
                "tree": attrs.asdict(m.tree) if m.tree is not None else None,
                "drafter": getattr(m.drafter, "name", None),
                "builds_trees": builds_trees(m.drafter) if m.drafter is not None else None,
                "checkpoint": m.checkpoint,
                "draft_seconds_per_round": self.draft_seconds_per_round(m.label),
                "otps_by_repeat": self.otps_by_repeat(m.label),
            }
            if m.label != PLAIN:
                entry.update(round_cost(agg, self.aggregate(PLAIN)))
                flags = self.flags(m.label)
                excluded = sorted({f["repeat"] for f in flags})
                entry["speed_flags"] = flags
                if excluded:  # a flagged ratio is never reported as a result
                    entry["speedup_excluded_repeats"] = excluded
                    kept = [i for i in range(self.repeats) if i not in excluded]
                    entry["speedup"] = _pooled_speedup(self, m.label, kept)
                entry["speedup_interval"] = self.ratio(m.label, exclude=excluded).as_dict()
                if len(excluded) < self.repeats:
                    entry["speedup_interval_prompts"] = self.ratio_over_prompts(m.label, exclude=excluded).as_dict()
                if self.greedy:
                    entry["lossless"] = not self.mismatches(m.label)
                if m.verifier is not None:
                    entry["verifier"] = m.verifier.name
            methods[m.label] = entry
        drafted = [m.label for m in self.methods if m.label != PLAIN]
        ratios = {}
        for i, a in enumerate(drafted):
            for b in drafted[i + 1:]:
                al_a, al_b = methods[a]["acceptance_length"], methods[b]["acceptance_length"]
                ratios[f"{a} / {b}"] = {
                    "otps": self.ratio(a, b).as_dict(),
                    "acceptance_length": al_a / al_b if al_b else float("nan"),
                }
        return {
            "methods": methods,
            "ratios": ratios,
            "target_seconds_per_forward": self.target_seconds_per_forward(),
            "repeats": self.repeats,
            "remeasured_repeats": self.remeasured,
            "prompt_turns": len(self.by_repeat(PLAIN, 0)),
            "greedy": self.greedy,
            **self.engine_info,
        }

    def per_prompt(self) -> list[dict[str, Any]]:
        """Per prompt turn and method: tokens, AL and forwards (repeat 0; identical across repeats under greedy
        verification) and decode seconds / OTPS of every repeat."""
        rows = []
        for m in self.methods:
            first = self.by_repeat(m.label, 0)
            for rec in first:
                runs = [r for r in self.records[m.label] if (r.prompt, r.turn) == (rec.prompt, rec.turn)]
                rows.append({
                    "method": m.label,
                    "id": rec.prompt,
                    "turn": rec.turn + 1,
                    "prompt_tokens": rec.prompt_tokens,
                    "new_tokens": len(rec.tokens),
                    "acceptance_length": rec.metrics.acceptance_length,
                    "forwards": rec.metrics.forwards,
                    "accepted": sum(rec.metrics.accepted),
                    "decode_seconds": [r.metrics.decode_seconds for r in runs],
                    "otps": [r.metrics.otps for r in runs],
                    "draft_seconds": [r.draft_seconds for r in runs],
                })
        return rows


def _pooled_speedup(comparison: Comparison, label: str, repeats: Sequence[int]) -> float | None:
    spec = [r.metrics for r in comparison.records[label] if r.repeat in repeats]
    plain = [r.metrics for r in comparison.records[PLAIN] if r.repeat in repeats]
    return aggregate(spec, 0, plain).speedup if spec else None


def compare(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[BenchPrompt],
    methods: Sequence[Method],
    verifier: api.Verifier,
    *,
    repeats: int = 1,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    max_remeasure: int = MAX_REMEASURE,
    warmup: int = 1,
) -> Comparison:
    """Decode every prompt turn with plain decoding and every method, interleaved, ``repeats`` times, after
    ``warmup`` short untimed decodes of the first prompt by every method (first calls pay for lazy initialisation).

    A later turn is asked after plain decoding's answer to the earlier turns in the first repeat (the target's own
    answer, the same context for every method). Each prompt turn gets one seed, shared by all methods. Repeats whose
    speedup ratio is flagged (``speed_flags``) are measured again, up to ``max_remeasure`` rounds.
    """
    if repeats < 1:
        raise UsageError(f"--repeats must be positive, got {repeats}")
    labels = [m.label for m in methods]
    if PLAIN in labels or len(set(labels)) != len(labels):
        raise UsageError(f"method labels must be distinct and not '{PLAIN}': {labels}")
    every = [Method(PLAIN), *methods]
    records: dict[str, list[Record]] = {m.label: [] for m in every}
    contexts: dict[tuple[str, int], torch.Tensor] = {}
    answers: dict[str, list[dict[str, str]]] = {}
    answered: set[tuple[str, int]] = set()

    def run_repeat(repeat: int) -> None:
        shift = repeat % len(every)
        order = every[shift:] + every[:shift]
        for p_index, prompt in enumerate(prompts):
            for turn, text in enumerate(prompt.turns):
                key = (prompt.id, turn)
                if key not in contexts:
                    history = answers.get(prompt.id, [])
                    contexts[key] = chat_ids(tokenizer, [*history, {"role": "user", "content": text}])
                ids = contexts[key]
                turn_seed = seed + 1000 * p_index + turn
                for method in order:
                    trial = decode(model, ids, verifier, method, max_new_tokens=max_new_tokens, seed=turn_seed)
                    gen = trial.generation
                    records[method.label].append(
                        Record(prompt.id, turn, repeat, len(ids), tuple(gen.tokens), PromptMetrics.of(gen),
                               trial.draft_seconds)
                    )
                    if method.label == PLAIN and key not in answered:
                        answered.add(key)
                        answer = tokenizer.decode(gen.tokens, skip_special_tokens=True).strip()
                        answers[prompt.id] = [
                            *answers.get(prompt.id, []),
                            {"role": "user", "content": text},
                            {"role": "assistant", "content": answer},
                        ]
                if progress is not None:
                    progress(f"repeat {repeat + 1}/{repeats} prompt {prompt.id} turn {turn + 1}")

    if prompts and warmup:
        first = chat_ids(tokenizer, [{"role": "user", "content": prompts[0].turns[0]}])
        for method in every:
            for _ in range(warmup):
                decode(model, first, verifier, method, max_new_tokens=min(max_new_tokens, 16), seed=seed)
    for repeat in range(repeats):
        run_repeat(repeat)
    # outputs must equal plain decoding's only where every verifier in the run is greedy
    greedy = is_greedy(verifier) and all(is_greedy(m.verifier) for m in methods if m.verifier is not None)
    comparison = Comparison(list(every), records, repeats, greedy)
    remeasure(comparison, run_repeat, max_remeasure, progress)
    return comparison


def remeasure(comparison: Comparison, run_repeat: Callable[[int], None], max_rounds: int = MAX_REMEASURE,
              progress: Callable[[str], None] | None = None) -> Comparison:
    """Measure flagged repeats again (``run_repeat(i)`` appends repeat i's records anew; the old ones are dropped
    first), at most ``max_rounds`` times; what is still flagged after that stays in the summary's ``speed_flags``."""
    for _ in range(max_rounds):
        bad = comparison.flagged_repeats()
        if not bad:
            break
        for repeat in bad:
            if progress is not None:
                progress(f"repeat {repeat + 1}: speedup flagged, measuring it again")
            for label in comparison.records:
                comparison.records[label] = [r for r in comparison.records[label] if r.repeat != repeat]
            run_repeat(repeat)
            comparison.remeasured += 1
    return comparison
