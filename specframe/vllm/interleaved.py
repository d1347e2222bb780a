"""Several vLLM engines measured side by side on the same prompts: ``run_interleaved`` (every engine kept alive in
``EngineProcesses``, prompt turns interleaved across them, the order rotating per repeat and prompt, so a machine
slowing down mid-run slows every engine alike) with its records ``Conversation``, ``VllmTrial`` and ``Interleaved``;
and ``compare_to_plain``, plain then speculative decoding of the same prompts in one child, as a ``VllmComparison``
(named for vLLM: ``Trial``, ``Comparison`` and ``compare`` are ``specframe.bench``'s, the reference engine's)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from specframe.errors import SpecframeError
from specframe.metrics import AggregateMetrics, aggregate
from specframe.vllm.counters import VllmGeneration
from specframe.vllm.engine import EngineOptions, cpu_binding
from specframe.vllm.jobs import EngineProcesses, Job, VllmRun, run_jobs


@attrs.frozen
class Conversation:
    """One evaluation item for ``run_interleaved``: user ``turns``; turn i > 0 is asked after plain decoding's
    answer to the turns before it."""

    id: str
    turns: tuple[str, ...]


@attrs.frozen
class VllmTrial:
    """One engine on one prompt turn in one repeat."""

    label: str
    conversation: str
    turn: int
    repeat: int
    prompt_tokens: int
    generation: VllmGeneration


@attrs.frozen
class Interleaved:
    """What ``run_interleaved`` measured: every trial, the prompt ids each turn was asked with (key ``id#turn``),
    each engine's start-up time and the CPU list vLLM's threads were pinned to."""

    trials: tuple[VllmTrial, ...]
    contexts: dict[str, list[int]]
    startup_seconds: dict[str, float]
    threads_bind: str


def run_interleaved(
    jobs: Mapping[str, Job],
    conversations: Sequence[Conversation],
    tokenizer: str,
    *,
    plain: str,
    repeats: Sequence[int],
    contexts: Mapping[str, Sequence[int]] | None = None,
    warmup: int = 1,
    max_new_tokens: int = 256,
    chat_template: str | None = None,
    options: EngineOptions = EngineOptions(),
    progress: Callable[[str], None] | None = None,
    concurrency: int = 1,
) -> Interleaved:
    """Start every engine of ``jobs`` (label -> job) at once (``EngineProcesses``), warm each up on the first prompt
    (``warmup`` short generations), then decode every prompt turn with every engine in turn, for each repeat index
    in ``repeats``; the engine order rotates with the repeat and the prompt, so a machine slowing down mid-run slows
    every engine alike. ``concurrency`` > 1: the conversations go in groups of that many, and each engine gets a
    group's turn as that many requests at once (the engines need ``options.max_num_seqs`` >= ``concurrency``); each
    trial's ``decode_seconds`` is then its own request's, first token to last, as a user of a busy server sees it. Prompts go through ``tokenizer``'s chat template (``chat_template``: a Jinja file replacing
    it); a later turn follows the answer of the ``plain`` engine. ``contexts`` (``Interleaved.contexts`` of an earlier
    run) fixes the prompt ids, so a repeat measured again asks exactly what it asked before. ``progress`` gets a line
    when the engines are up and after every prompt turn."""
    from transformers import AutoTokenizer

    from specframe.data.chat import encode_prompt

    if plain not in jobs:
        raise SpecframeError(f"the plain engine '{plain}' is not among the jobs {sorted(jobs)}")
    if not 1 <= concurrency <= options.max_num_seqs:
        raise SpecframeError(f"concurrency must be between 1 and the engines' max_num_seqs ({options.max_num_seqs}), "
                             f"got {concurrency}")
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    if chat_template:
        tok.chat_template = Path(chat_template).read_text(encoding="utf-8")
    known: dict[str, list[int]] = {k: [int(t) for t in v] for k, v in (contexts or {}).items()}
    answers: dict[str, list[dict[str, str]]] = {}
    trials: list[VllmTrial] = []
    say = progress or (lambda message: None)
    started = time.perf_counter()
    with EngineProcesses(jobs, options) as engines:
        say(f"vLLM: {len(jobs)} engines up in {time.perf_counter() - started:.0f} s")
        labels = list(jobs)
        groups = [conversations[i:i + concurrency] for i in range(0, len(conversations), concurrency)]
        for repeat in repeats:
            for g_index, group in enumerate(groups):
                for turn in range(max(len(c.turns) for c in group)):
                    members = [c for c in group if turn < len(c.turns)]
                    asked = []
                    for conv in members:
                        key = f"{conv.id}#{turn}"
                        if key not in known:
                            history = answers.get(conv.id, [])
                            known[key] = encode_prompt(tok, [*history, {"role": "user", "content": conv.turns[turn]}])
                        asked.append(known[key])
                    if not trials:  # the first prompts warm every engine up, batched as they are timed
                        for label in labels:
                            for _ in range(warmup):
                                engines.generate_together(label, asked, min(max_new_tokens, 16))
                    shift = (repeat + g_index + turn) % len(labels)
                    for label in labels[shift:] + labels[:shift]:
                        generations = engines.generate_together(label, asked, max_new_tokens)
                        for conv, ids, generation in zip(members, asked, generations):
                            trials.append(VllmTrial(label, conv.id, turn, repeat, len(ids), generation))
                            if label == plain and len(answers.get(conv.id, [])) == 2 * turn:
                                answer = tok.decode(list(generation.tokens), skip_special_tokens=True).strip()
                                answers[conv.id] = [*answers.get(conv.id, []),
                                                    {"role": "user", "content": conv.turns[turn]},
                                                    {"role": "assistant", "content": answer}]
                    say(f"vLLM: repeat {repeat + 1} prompt {'+'.join(c.id for c in members)} turn {turn + 1} done")
        startup = dict(engines.startup_seconds)
    return Interleaved(tuple(trials), known, startup, options.threads_bind or cpu_binding())


@attrs.frozen
class VllmComparison:
    """Plain and speculative vLLM on the same prompts, measured in one run."""

    plain: VllmRun
    speculative: VllmRun
    metrics: AggregateMetrics
    outputs_equal: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "metrics": self.metrics.as_dict(),
            "outputs_equal": self.outputs_equal,
            "counters": self.speculative.counters.as_dict(),
            "plain_otps": aggregate([g.prompt_metrics() for g in self.plain.generations], 1).otps,
            "per_prompt": [
                {"tokens": len(g.tokens), **attrs.asdict(g.prompt_metrics())} for g in self.speculative.generations
            ],
        }


def compare_to_plain(
    target: str | os.PathLike,
    prompts: Sequence[Sequence[int]],
    speculative_config: Mapping[str, Any],
    *,
    max_new_tokens: int = 256,
    ignore_eos: bool = False,
    options: EngineOptions = EngineOptions(),
) -> VllmComparison:
    """Plain decoding, then speculative decoding, of ``prompts`` on ``target``, one engine after the other in one child process;
    speedup = OTPS(speculative) / OTPS(plain) as docs/design.md section 8 defines it."""
    plain, spec = run_jobs(
        [Job(str(target)), Job(str(target), dict(speculative_config))],
        prompts, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, options=options,
    )
    k = int(speculative_config["num_speculative_tokens"])
    return VllmComparison(
        plain=plain,
        speculative=spec,
        metrics=spec.metrics(k, baseline=plain),
        outputs_equal=[g.tokens for g in plain.generations] == [g.tokens for g in spec.generations],
    )
