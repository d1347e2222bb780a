"""Acceptance and speed comparisons on the reference engine, shared by ``specframe bench`` and ``benchmarks/``.

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

import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from specframe import api
from specframe.errors import SpecframeError, UsageError, read_json, unknown_name
from specframe.inference.engine import DEFAULT_MAX_NEW_TOKENS, Generation, TreeShape, generate
from specframe.metrics import AggregateMetrics, PromptMetrics, aggregate
from specframe.stats import (  # noqa: F401 - t975, Interval, PHYSICAL_SLACK, OUTLIER_FACTOR: bench's names before
    OUTLIER_FACTOR, PHYSICAL_SLACK, Interval, TwoWayInterval, speed_flags, t975, two_way_ratio,
)

PLAIN = "plain"

#: how many times flagged repeats are measured again before the flags are reported instead
MAX_REMEASURE = 2


def round_cost(spec: AggregateMetrics, plain: AggregateMetrics) -> dict[str, float | None]:
    """R = a speculative round's decode time over a plain step's (both per target forward), and the break-even AL
    it implies (R itself: speedup ~ AL / R)."""
    if not (spec.forwards and plain.forwards and spec.decode_seconds > 0 and plain.decode_seconds > 0):
        return {"round_cost_ratio": None, "break_even_al": None}
    r = (spec.decode_seconds / spec.forwards) / (plain.decode_seconds / plain.forwards)
    return {"round_cost_ratio": r, "break_even_al": r}


# ------------------------------------------------------------------------------------------------------- prompts


@attrs.frozen
class BenchPrompt:
    """One evaluation item: ``turns`` are user messages; turn i > 0 follows the target's answer to turn i - 1."""

    source: str
    id: str
    turns: tuple[str, ...]
    category: str | None = None


def spread_over_categories(prompts: Sequence[BenchPrompt], n: int) -> list[BenchPrompt]:
    """``n`` prompts taken in turn from each category (in the set's order of categories, each category's prompts in
    the set's order), so a timed subset is not one category's: MT-Bench's first ten questions are all "writing".
    Prompts without a category count as one category."""
    groups: dict[str | None, list[BenchPrompt]] = {}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    queues = list(groups.values())
    chosen: list[BenchPrompt] = []
    depth = 0
    while len(chosen) < n and any(depth < len(q) for q in queues):
        chosen += [q[depth] for q in queues if depth < len(q)][: n - len(chosen)]
        depth += 1
    return chosen


def load_prompts(dataset: str, limit: int | None = None) -> list[BenchPrompt]:
    """The first ``limit`` items of a named evaluation set (``mt-bench``, ``humaneval``, ``gsm8k``) or of a JSON /
    JSONL file of records with ``messages`` (only the user messages are used; answers come from the target)."""
    from specframe.data.evalsets import EVAL_SETS, eval_prompts

    if limit is not None and limit < 1:
        raise UsageError(f"--num-prompts must be positive, got {limit}")
    if dataset in EVAL_SETS:
        return [BenchPrompt(p.source, p.id, p.turns, p.category) for p in eval_prompts(dataset, limit=limit)]
    path = Path(dataset).expanduser()
    if not path.is_file():
        err = unknown_name("dataset", dataset, EVAL_SETS)
        raise type(err)(f"{err} (or the path of a JSON/JSONL file of records with 'messages')")
    from specframe.data.sources import load_chat_file

    prompts = []
    for record in load_chat_file(path, limit=limit):
        turns = tuple(m["content"] for m in record["messages"] if m["role"] == "user")
        if not turns:
            raise SpecframeError(f"{path}: record {record['id']} has no user message")
        prompts.append(BenchPrompt(record["source"], record["id"], turns))
    if not prompts:
        raise SpecframeError(f"{path} holds no prompts")
    return prompts


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    """Prompt token ids: ``messages`` through the target's chat template, with the generation prompt."""
    from specframe.data.chat import encode_prompt

    return torch.tensor(encode_prompt(tokenizer, messages), dtype=torch.long)


# ------------------------------------------------------------------------------------------------------- methods


def verifier_spec(text: str) -> tuple[str, api.Verifier]:
    """``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE`` (values read as JSON where they parse, else as text: ``true``, ``8``,
    ``[1.0, 2.0]``) -> (the label suffix, the verifier with those options, checked by its ``Options``)."""
    import json
    import re

    from specframe import compose

    name, _, rest = text.partition(":")
    given: dict[str, Any] = {}
    # a comma ends an option only where the next KEY= starts, so a JSON list's commas stay inside its value
    for item in filter(None, (part.strip() for part in re.split(r",(?=\s*[A-Za-z_]\w*\s*=)", rest))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"verifier option '{item}' in '{text}' is not KEY=VALUE (e.g. scheduled:skip_drafting=true)")
        try:
            given[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            given[key.strip()] = value.strip()
    cls, options = compose.verifier(name.strip(), given)
    return text.strip(), cls(options)


def make_verifier(name: str, *, temperature: float | None = None, top_k: int | None = None,
                  top_p: float | None = None) -> api.Verifier:
    """A verifier by name with its sampling options; options the verifier does not have are refused."""
    from specframe import plugins

    cls = plugins.get("verifier", name)
    given = {k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)) if v is not None}
    known = {a.name for a in attrs.fields(cls.Options)} if attrs.has(cls.Options) else set()
    unknown = sorted(set(given) - known)
    if unknown:
        has = f"its options: {', '.join(sorted(known))}" if known else "it is greedy"
        raise UsageError(
            f"verifier '{name}' has no {', '.join(unknown)} option ({has}); use --verifier sampling or tree to sample"
        )
    try:
        options = cls.Options(**given)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"invalid options for verifier '{name}': {exc}") from None
    return cls(options)


def is_greedy(verifier: api.Verifier) -> bool:
    """Whether the verifier's output is plain greedy decoding's (so speculative output must match it exactly)."""
    return bool(verifier.greedy)  # declared by the verifier (API 6)


@attrs.define(eq=False)
class Method:
    """A decoding method: ``drafter`` None is plain decoding. ``checkpoint_hash`` / ``token_budget`` are the
    trained drafter's provenance (None for plain and n-gram)."""

    label: str
    drafter: api.Drafter | None = None
    k: int = 5
    tree: TreeShape | None = None
    checkpoint: str | None = None
    checkpoint_hash: str | None = None
    token_budget: int | None = None
    #: this method's own verifier (None: the run's): one drafter under two verifiers side by side, e.g. DSpark's
    #: block verified whole and through its confidence schedule
    verifier: api.Verifier | None = None

    @property
    def slots(self) -> int:
        """Draft slots reported in per-position acceptance."""
        if self.drafter is None:
            return 0
        return self.tree.depth if self.tree is not None else self.k


def builds_trees(drafter: api.Drafter | None) -> bool:
    """Whether the drafter's ``propose_tree`` builds a real tree (``Drafter.builds_trees``)."""
    return bool(getattr(drafter, "builds_trees", False))


def _shape(drafter: api.Drafter, k: int, tree: TreeShape | None) -> tuple[int, TreeShape | None]:
    """(k, tree) a method really decodes with: a drafter that does not build trees drafts its chain of the tree's
    depth (what its ``propose_tree`` falls back to), so it is measured and labelled as that chain, never as a tree."""
    if tree is not None and not builds_trees(drafter):
        return tree.depth, None
    return k, tree


def default_k(drafter: api.Drafter, fallback: int = 5) -> int:
    """The drafter's own inference depth where it declares one (``Drafter.training``, API 6), else ``fallback``."""
    return int(type(drafter).training(drafter.options).k or fallback)


def token_budget(checkpoint_dir: Path) -> int | None:
    """Training tokens a checkpoint saw: the recorded count if the run logged one, else steps x batch x seq_len (an
    upper bound: conversations shorter than seq_len are not padded)."""
    state_path, config_path = checkpoint_dir / "state.json", checkpoint_dir / "config.json"
    if not state_path.exists() or not config_path.exists():
        return None
    state = read_json(state_path, "the checkpoint's training state")
    config = read_json(config_path, "the checkpoint's run config")
    if "tokens_seen" in state:
        return int(state["tokens_seen"])
    try:
        return int(state["step"]) * int(config["batch_size"]) * int(config["seq_len"])
    except (KeyError, TypeError, ValueError):
        return None


def checkpoint_method(path: str | Path, target_config: Any, *, k: int | None = None,
                      tree: TreeShape | None = None, label: str | None = None) -> Method:
    """A trained drafter from a checkpoint, a run's output folder or a foreign drafter folder (speculators,
    SafeAILab / SpecForge, PARD), in eval mode, with its provenance."""
    from specframe.drafter_folders import load_drafter, locate
    from specframe.engine.checkpoint import drafter_hash

    directory = locate(path)[1]
    drafter = load_drafter(directory, target_config)
    drafter.module().eval()
    k = default_k(drafter) if k is None else k
    if k < 1:
        raise UsageError(f"--k must be positive, got {k}")
    k, tree = _shape(drafter, k, tree)
    return Method(
        label=label or drafter.name, drafter=drafter, k=k, tree=tree, checkpoint=str(directory),
        checkpoint_hash=drafter_hash(directory), token_budget=token_budget(directory),
    )


def plugin_method(name: str, target_config: Any, *, k: int = 5, tree: TreeShape | None = None,
                  label: str | None = None) -> Method:
    """An untrained drafter plugin by name (the ``ngram`` baseline)."""
    from specframe import plugins

    if k < 1:
        raise UsageError(f"--k must be positive, got {k}")
    drafter = plugins.get("drafter", name)(target_config)
    k, tree = _shape(drafter, k, tree)
    return Method(label=label or name, drafter=drafter, k=k, tree=tree)


# ------------------------------------------------------------------------------------------------------ decoding


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


# ---------------------------------------------------------------------------------------------------- comparison


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


# ---------------------------------------------------------------------------------------------------- vLLM engine


def compare_vllm(
    target: str,
    prompts: Sequence[BenchPrompt],
    methods: Sequence[Method],
    *,
    repeats: int = 1,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    warmup: int = 1,
    threads: int | None = None,
    chat_template: str | None = None,
    max_remeasure: int = MAX_REMEASURE,
    progress: Callable[[str], None] | None = None,
    concurrency: int = 1,
) -> Comparison:
    """``compare`` on vLLM (greedy): plain vLLM and each method served by vLLM, every engine started once and warmed
    up, prompt turns interleaved across the engines, ``repeats`` times (``specframe.vllm.engine.run_interleaved``).
    ``concurrency`` > 1: each engine gets that many conversations' turns at once, and each request's speed is its own
    (tokens over its first-to-last-token time), so OTPS is what one of that many concurrent users sees.
    Trained checkpoints are exported (`specframe export`) and served at each method's K; the ``ngram`` plugin is
    served as vLLM's own prompt-lookup method with the plugin's n-gram sizes. vLLM's threads are pinned to the first
    ``threads`` CPUs (all this process may use by default). The result is a ``Comparison`` like the reference
    engine's (AL and per-slot acceptance from vLLM's per-request counters, lossless = equal to plain vLLM's tokens;
    the drafter's own time per round is not observable inside vLLM and is left undefined); flagged repeats are
    measured again the same way."""
    import tempfile

    from specframe.vllm import vllm_available

    if not vllm_available():
        raise SpecframeError(
            "--engine vllm needs vLLM, which is not installed in this environment: run `make setup VLLM=cpu` (or "
            "VLLM=gpu), or use --engine reference"
        )
    if repeats < 1:
        raise UsageError(f"--repeats must be positive, got {repeats}")
    if concurrency < 1:
        raise UsageError(f"--concurrency must be positive, got {concurrency}")
    labels = [m.label for m in methods]
    if PLAIN in labels or len(set(labels)) != len(labels):
        raise UsageError(f"method labels must be distinct and not '{PLAIN}': {labels}")
    from specframe.targets import target_source
    from specframe.vllm.engine import Conversation, EngineOptions, cpu_binding, run_interleaved

    source = target_source(target)
    every = [Method(PLAIN), *methods]
    options = EngineOptions(threads_bind=cpu_binding(threads), max_num_seqs=concurrency)
    conversations = [Conversation(p.id, tuple(p.turns)) for p in prompts]
    records: dict[str, list[Record]] = {m.label: [] for m in every}
    contexts: dict[str, list[int]] = {}
    info: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="specframe-bench-") as tmp:
        jobs = vllm_jobs(every, source, Path(tmp))

        def run(indices: Sequence[int]) -> None:
            result = run_interleaved(jobs, conversations, source, plain=PLAIN, repeats=indices, contexts=contexts,
                                     warmup=warmup, max_new_tokens=max_new_tokens, chat_template=chat_template,
                                     options=options, progress=progress, concurrency=concurrency)
            contexts.update(result.contexts)
            info.update(vllm_threads_bind=result.threads_bind, vllm_startup_seconds=result.startup_seconds,
                        concurrency=concurrency)
            for t in result.trials:
                g = t.generation
                # nan: the drafter's share of a vLLM round is not observable from outside the engine
                records[t.label].append(Record(t.conversation, t.turn, t.repeat, t.prompt_tokens, g.tokens,
                                               g.prompt_metrics(), float("nan")))

        run(range(repeats))
        comparison = Comparison(list(every), records, repeats, True, engine_info=info)
        remeasure(comparison, lambda repeat: run([repeat]), max_remeasure, progress)
    return comparison


def vllm_jobs(
    methods: Sequence[Method], source: str, workdir: Path, refused: dict[str, str] | None = None,
    manifests: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One vLLM engine job (``specframe.vllm.engine.Job``) per method label: plain, a trained checkpoint (exported
    once into ``workdir``, served at the method's K) or the ``ngram`` baseline (vLLM's prompt lookup with the
    plugin's n-gram sizes). A checkpoint whose export vLLM cannot serve at the method's K (a DFlash drafter below
    its block, ``Manifest.refusal``) raises that reason, or, given ``refused``, is left out with its reason there.
    Given ``manifests``, each checkpoint's export manifest is put there (checkpoint -> ``Manifest``: the K range it
    serves), so a caller needs no export of its own to ask."""
    from specframe.drafter_folders import export_checkpoint
    from specframe.vllm.engine import Job
    from specframe.layouts.export import read_manifest, speculative_config

    exports: dict[str, Path] = {}
    jobs = {}
    for m in methods:
        if m.drafter is None:
            jobs[m.label] = Job(source)
        elif m.tree is not None:
            raise UsageError("--engine vllm drafts chains only: drop the --tree-* options")
        elif m.checkpoint is not None:
            if m.checkpoint not in exports:
                exports[m.checkpoint] = workdir / f"export-{len(exports)}"
                export_checkpoint(m.checkpoint, exports[m.checkpoint], source)
            manifest = read_manifest(exports[m.checkpoint])
            if manifests is not None:
                manifests[m.checkpoint] = manifest
            reason = manifest.refusal(m.k)
            if reason is not None and refused is not None:
                refused[m.label] = reason
                continue
            jobs[m.label] = Job(source, speculative_config(exports[m.checkpoint], m.k))
        elif (config := m.drafter.vllm_speculative_config(int(m.k))) is not None:
            jobs[m.label] = Job(source, config)  # a weightless method vLLM implements itself (API 6)
        else:
            raise UsageError(f"--engine vllm serves trained checkpoints and the ngram baseline, not the untrained "
                             f"drafter '{m.drafter.name}'")
    return jobs


def vllm_refusals(methods: Sequence[Method], source: str) -> dict[str, str]:
    """The methods vLLM cannot serve (label -> the one-line reason their export gives, ``Manifest.refusal``), e.g. a
    DFlash checkpoint at K below its block; the benchmark suites skip those with the reason instead of failing."""
    import tempfile

    refused: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="specframe-refusals-") as tmp:
        vllm_jobs(methods, source, Path(tmp), refused)
    return refused


# ------------------------------------------------------------------------------------------------------- results


def json_safe(value: Any) -> Any:
    """JSON has no NaN: undefined figures (no drafting rounds, say) become null; tuples become lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def recorded_target(checkpoints: Sequence[str | Path]) -> str | None:
    """The target the first checkpoint that names one was trained against (or the verifier its speculators config
    names)."""
    from specframe import drafter_folders

    for path in checkpoints:
        target = drafter_folders.recorded_target(path)
        if target:
            return target
    return None


def results_provenance(target: Any, methods: Sequence[Method], command: list[str] | None = None) -> dict[str, Any]:
    """``specframe.results.provenance`` for a comparison. With one trained checkpoint (at any number of K / tree
    settings) its hash and token budget are scalars; with several they map drafter name (or method label, where two
    checkpoints share a drafter) to value."""
    from specframe.results import provenance

    trained = list({m.checkpoint: m for m in methods if m.checkpoint_hash is not None}.values())
    if len(trained) == 1:
        ckpt_hash, budget = trained[0].checkpoint_hash, trained[0].token_budget
    elif trained:
        names = [m.drafter.name for m in trained]
        keys = names if len(set(names)) == len(names) else [m.label for m in trained]
        ckpt_hash = {key: m.checkpoint_hash for key, m in zip(keys, trained)}
        budget = {key: m.token_budget for key, m in zip(keys, trained)}
    else:
        ckpt_hash = budget = None
    return provenance(
        target={"id": target.id, "weights_hash": target.weights_hash}, drafter_checkpoint_hash=ckpt_hash,
        token_budget=budget, command=command,
    )
