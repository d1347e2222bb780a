"""``scheduled``: verify only the prefix of a chain whose expected return is positive (DSpark's hardware-aware prefix
scheduler), for any drafter that gives per-token confidence (``api.Draft.confidence``).

Before the target's forward (``api.Verifier.schedule``, API 7) the verifier walks the chain: with c_i the drafter's
estimate that token i is accepted given token i - 1 was, the expected number of tokens a round emits when it verifies
the first m draft tokens is E(m) = 1 + sum_{j <= m} prod_{i <= j} c_i (the correction or bonus token always comes),
and the round costs T(m), the target forward over m + 1 tokens (``cost_curve``: by default measured by
``measure_cost_curve`` on the target the engine hands over through ``Verifier.bind``, API 10, before anything is
timed; with ``measure`` off, the linear ``cost_base + cost_per_token * m``). Token j is kept while it raises the
expected tokens per second, E(j) / T(j) > E(j - 1) / T(j - 1); the walk stops at the first token that does not.

The stopping rule reads confidence[: j + 1] to decide on token j, and a drafter computes confidence[j] before it
draws token j (DSpark's head reads the previous token), so the decision to verify token j never depends on token j:
verification of the kept prefix is then exactly the inner rule's, greedy or speculative sampling, and as lossless.

The schedule is asked once the draft exists, so it can save the verification's extra cost but never the drafting's.
Where drafting costs as much as a target step (a small target on a CPU) that is most of the loss. With
``skip_drafting`` the verifier also decides before drafting (``api.Verifier.draft_budget``, API 11): after each
drafted round (``observe``) it asks whether drafting paid, i.e. whether the best prefix of that draft, with its drafting
cost D, gave more expected tokens per cost than a plain step, max_m E(m) / (D + T(m)) > 1 / T(0); if not, the next
rounds run the target alone, 1, then 2, 4, .. up to ``max_skip`` rounds after each further draft that does not pay
(the next draft is the probe), and the count falls back to none as soon as one does. D is ``draft_cost`` or the
drafting seconds the engine reports, in the curve's unit. Skipping depends only on earlier rounds, so it is lossless
under either rule.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import attrs
import torch

from specframe import api

RULES = ("greedy", "sampling")


_non_negative = api.non_negative("scheduled")


_sampling = api.SamplingFields("scheduled")


@attrs.define
class ScheduledOptions:
    rule: str = attrs.field(default="greedy", metadata={
        "help": "how the kept prefix is verified: 'greedy' (argmax match) or 'sampling' (speculative sampling)"})
    temperature: float = _sampling.temperature(1.0, "rule 'sampling': softmax temperature of the target")
    top_k: int = _sampling.top_k("rule 'sampling': keep the k most likely tokens (0: off)")
    top_p: float = _sampling.top_p("rule 'sampling': nucleus mass (1: off)")
    cost_curve: list[float] | None = attrs.field(default=None, metadata={
        "help": "seconds of a target forward verifying m = 0, 1, .. draft tokens; longer drafts cost the last "
                "entry's slope more; null: measured on the target the engine runs (see measure)"})
    measure: bool = attrs.field(default=True, metadata={
        "help": "without cost_curve: measure it on the target when the engine hands it over (measure_cost_curve, "
                "once per target, before anything is timed); false: the linear model below"})
    measure_tokens: int = attrs.field(default=8, validator=api.positive_int("scheduled"), metadata={
        "help": "draft tokens the measured curve covers (longer drafts extend its last slope)"})
    cost_base: float = attrs.field(default=1.0, validator=_non_negative, metadata={
        "help": "without cost_curve and measure false: the cost of a forward verifying no draft token (any unit)"})
    cost_per_token: float = attrs.field(default=0.1, validator=_non_negative, metadata={
        "help": "without cost_curve and measure false: the extra cost per verified draft token, in cost_base's unit"})
    skip_drafting: bool = attrs.field(default=False, metadata={
        "help": "also skip drafting while it does not pay: after a draft whose best prefix returns fewer expected "
                "tokens per cost (drafting included) than a plain step, run the target alone for 1, 2, 4 .. up to "
                "max_skip rounds before drafting again"})
    max_skip: int = attrs.field(default=8, validator=api.positive_int("scheduled"), metadata={
        "help": "skip_drafting: the most rounds run without drafting before the next probe"})
    draft_cost: float | None = attrs.field(default=None, metadata={
        "help": "skip_drafting: one round's drafting in the cost curve's unit; null: measured, the mean drafting "
                "seconds the engine reports for this decode, in the curve's unit"})

    def __attrs_post_init__(self) -> None:
        if self.rule not in RULES:
            raise api.UsageError(f"scheduled option 'rule' must be one of {', '.join(RULES)}, got {self.rule!r}")
        curve = self.cost_curve
        if curve is not None:
            if (not isinstance(curve, list | tuple) or len(curve) < 2
                    or any(isinstance(x, bool) or not isinstance(x, int | float) or not x > 0 for x in curve)):
                raise api.UsageError(f"scheduled option 'cost_curve' must list at least two positive costs "
                                     f"(m = 0, 1, ..), got {curve!r}")
        elif not self.cost_base > 0:
            raise api.UsageError("scheduled option 'cost_base' must be positive (the forward's fixed cost)")
        if not isinstance(self.skip_drafting, bool):
            raise api.UsageError(f"scheduled option 'skip_drafting' must be true or false, got {self.skip_drafting!r}")
        if self.draft_cost is not None:
            _non_negative(self, attrs.fields(ScheduledOptions).draft_cost, self.draft_cost)

    def cost(self, m: int) -> float:
        curve = self.cost_curve
        if curve is None:
            return self.cost_base + self.cost_per_token * m
        if m < len(curve):
            return float(curve[m])
        return float(curve[-1]) + (m - len(curve) + 1) * max(float(curve[-1]) - float(curve[-2]), 0.0)


class ScheduledVerifier(api.SamplesTarget, api.Verifier):
    name = "scheduled"
    Options = ScheduledOptions
    supports_tree = False

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        # id of the target the cost curve was measured on; None while the curve is the user's or not measured yet
        self._measured_on: int | None = None
        self._start_decode()

    def _start_decode(self) -> None:
        # skip_drafting's state, one decode long: the confidence of the draft being verified, the drafting costs
        # seen (curve units), the current run of skipped rounds and how many of it remain
        self._confidence: list[float] = []
        self._draft_costs: list[float] = []
        self._backoff = 0
        self._skip_left = 0

    def bind(self, model: Any) -> None:
        """API 10: without a given ``cost_curve``, measure it on this target (once per target), so the schedule
        weighs the round costs of the machine and engine it runs on rather than a made-up linear model. The engine
        calls it at the start of every decode, so it also starts ``skip_drafting``'s record afresh."""
        self._start_decode()
        o = self.options
        given = o.cost_curve is not None and self._measured_on is None
        if not o.measure or given or self._measured_on == id(model):
            return
        self.options = attrs.evolve(o, cost_curve=measure_cost_curve(model, o.measure_tokens))
        self._measured_on = id(model)

    def schedule(self, draft: api.Draft) -> int | None:
        if draft.branched:
            raise api.UsageError("the 'scheduled' verifier schedules chains; use 'tree' for draft trees")
        if draft.confidence is None:
            raise api.UsageError("the 'scheduled' verifier needs per-token confidence (api.Draft.confidence) from the "
                                 "drafter, and this draft has none (dspark gives it with its confidence head on)")
        o = self.options
        self._confidence = draft.confidence.double().tolist()
        expected, alive, kept = 1.0, 1.0, 0
        for j, c in enumerate(self._confidence, start=1):
            alive *= c
            if (expected + alive) / o.cost(j) <= expected / o.cost(j - 1):
                break
            expected += alive
            kept = j
        return kept

    def draft_budget(self, k: int) -> int:
        """API 11: ``k``, or 0 (no drafting this round) while a run of skipped rounds lasts (``skip_drafting``)."""
        if self._skip_left > 0:
            self._skip_left -= 1
            return 0
        return k

    def observe(self, cost: api.RoundCost) -> None:
        """API 11: after a drafted round, whether its draft paid for its drafting; if not, skip the next rounds'
        drafting (1, 2, 4 .. ``max_skip`` rounds: the next draft is the probe)."""
        o = self.options
        if not o.skip_drafting or cost.drafted == 0 or not self._confidence:
            return
        if o.draft_cost is not None:
            drafting = float(o.draft_cost)
        else:  # seconds to the curve's unit by this round's own forward (the ratio is 1 for a measured curve)
            unit = o.cost(cost.verified) / cost.target_seconds if cost.target_seconds > 0 else 1.0
            self._draft_costs.append(cost.draft_seconds * unit)
            drafting = statistics.fmean(self._draft_costs)
        expected, alive, best = 1.0, 1.0, 1.0 / (drafting + o.cost(0))
        for m, c in enumerate(self._confidence, start=1):
            alive *= c
            expected += alive
            best = max(best, expected / (drafting + o.cost(m)))
        self._confidence = []
        if best > 1.0 / o.cost(0):
            self._backoff = 0
        else:
            self._backoff = min(o.max_skip, max(1, 2 * self._backoff))
            self._skip_left = self._backoff

    @property
    def greedy(self) -> bool:
        # declared (API 6): the legacy default reads a temperature option of 0, and this one's temperature (1 by
        # default) only applies to rule 'sampling', so a greedy schedule would never be checked as lossless
        return self.options.rule == "greedy"

    def verify(self, logits: torch.Tensor, draft: api.Draft, generator: torch.Generator | None = None):
        if draft.branched:
            raise api.UsageError("the 'scheduled' verifier verifies chains; use 'tree' for draft trees")
        tokens = draft.tokens.tolist()
        if self.options.rule == "greedy":
            best = logits.argmax(-1).tolist()
            n = 0
            while n < len(tokens) and tokens[n] == best[n]:
                n += 1
            return api.chain_verification(list(range(n)), tokens, best[n])
        return api.speculative_chain(logits, draft, self.target, generator)


@torch.no_grad()
def measure_cost_curve(model: Any, max_tokens: int, context: int = 128, repeats: int = 5) -> list[float]:
    """Seconds (median of ``repeats``) of one forward of ``model`` (a transformers causal LM) over m + 1 new tokens
    after a cached context of ``context`` tokens, for m = 0 .. ``max_tokens``: a verification round's cost curve on
    the machine and engine this runs on, for ``cost_curve``."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context + max_tokens + 1), generator=g).to(device)
    cache = DynamicCache()
    model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True)
    curve = []
    for m in range(max_tokens + 1):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(input_ids=ids[:, context : context + m + 1], past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            cache.crop(context)
        curve.append(statistics.median(times))
    return curve
