"""Run vLLM on a target, with or without an exported drafter, and read its speculative-decoding figures.

``VllmEngine`` starts vLLM in this process (``from vllm import LLM``): greedy generation from token ids, one prompt
at a time (as the reference engine decodes, so per-prompt timings and rounds mean the same thing). Scripts that use
it need an ``if __name__ == "__main__":`` guard, because vLLM may spawn workers that re-import the main module.
``run_jobs`` / ``compare`` run engines in a child process instead, one after the other (``VllmEngine.close``
between them): the child takes vLLM's memory and threads with it, and vLLM is imported once for all of them. That
is also how plain and speculative decoding are measured side by side in one run.

What vLLM 0.32 exposes and how it maps onto ``specframe.metrics`` (docs/design.md section 8):

- Aggregate counters (``LLM.get_metrics()``): ``vllm:spec_decode_num_drafts`` (verification steps that carried a
  draft, summed over requests), ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and the vector
  ``..._num_accepted_tokens_per_pos`` (slot i accepted, per draft). vLLM counts a step's accepted tokens *before*
  the output is cut at ``max_tokens``, and ignores decode steps that carried no draft.
- Per request, with ``per_request_spec_decode_metrics="detailed"`` (set here whenever a drafter runs):
  ``CompletionOutput.spec_decode_metrics.per_step_accepted`` / ``per_step_drafted``, one entry per verification
  step in order. These give specframe's ``Round`` s exactly: each step emits accepted + 1 tokens, the last ones cut
  at ``max_tokens`` like the reference engine's; every output token not accounted for by a drafting step came from
  a decode forward without a draft (1 token each); the prefill's token is excluded.
- Per request timings (``RequestOutput.metrics``): engine-core timestamps of the first and last token; the decode
  phase is the time between them, so OTPS = decode tokens / that time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from specframe.errors import SpecframeError
from specframe.metrics import AggregateMetrics, PromptMetrics, aggregate

# Without a KV-cache size vLLM's CPU backend claims about 90% of RAM; 1 GiB serves short prompts of small models.
DEFAULT_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


@attrs.frozen
class EngineOptions:
    """How vLLM is started. ``dtype`` float32 keeps plain and speculative greedy outputs bit-identical on CPU;
    ``kv_cache_gib`` sets ``VLLM_CPU_KVCACHE_SPACE`` unless the environment already does."""

    max_model_len: int = 2048
    dtype: str = "float32"
    seed: int = 0
    kv_cache_gib: float = 1.0
    enforce_eager: bool = True
    #: CPU ids vLLM's OpenMP threads are pinned to (``VLLM_CPU_OMP_THREADS_BIND``); None: ``cpu_binding()``
    threads_bind: str | None = None
    #: requests vLLM decodes together. 1 for timings (one prompt at a time, as the reference engine decodes); more
    #: for acceptance over whole sets (``generate(..., together=True)``), which batching does not change
    max_num_seqs: int = 1


def cpu_binding(threads: int | None = None) -> str:
    """The CPU list to pin vLLM's OpenMP threads to: the first ``threads`` CPUs this process may run on (all of them
    when None), as ``VLLM_CPU_OMP_THREADS_BIND`` spells it ("0,1").

    vLLM's own default ("auto") keeps one core per rank back for a scheduler process; specframe runs the engine in
    its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so on a 2-core machine "auto" would leave decoding one
    core and let the threads of anything else running land on the other: timings then swing by 3x."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if threads is not None:
        if threads < 1:
            raise SpecframeError(f"--threads must be positive, got {threads}")
        if threads > len(cpus):
            raise SpecframeError(f"--threads {threads}: this process may only run on {len(cpus)} CPU(s) {cpus}")
        cpus = cpus[:threads]
    return ",".join(str(c) for c in cpus)


def configure_environment(options: EngineOptions = EngineOptions()) -> None:
    """Set vLLM's environment defaults (values already set win, except an explicit ``threads_bind``); must run
    before ``vllm`` is imported."""
    env = dict(DEFAULT_ENV, VLLM_CPU_KVCACHE_SPACE=f"{options.kv_cache_gib:g}", VLLM_CPU_OMP_THREADS_BIND=cpu_binding())
    for key, value in env.items():
        os.environ.setdefault(key, value)
    if options.threads_bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = options.threads_bind


def import_llm() -> Any:
    """``vllm.LLM``, or a ``SpecframeError`` saying how to install vLLM."""
    try:
        from vllm import LLM
    except ImportError as exc:
        raise SpecframeError(
            f"vLLM is not usable here ({exc}); install it with `make setup VLLM=cpu` (CPU) or `VLLM=gpu`"
        ) from exc
    return LLM


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


class VllmEngine:
    """vLLM in this process on ``target`` (a local folder or hub id), with an optional ``speculative_config``
    (``specframe.layouts.export.speculative_config`` builds one for an exported drafter).

    ``target`` may also be a speculators-format export (EAGLE-3, P-EAGLE): vLLM then starts the verifier the folder
    names, with the folder's method and number of draft tokens; ``speculative_config`` may override fields of it
    (``{"num_speculative_tokens": k}``; ``drafter_job`` builds such jobs)."""

    def __init__(
        self,
        target: str | os.PathLike,
        speculative_config: Mapping[str, Any] | None = None,
        options: EngineOptions = EngineOptions(),
    ) -> None:
        check_job(Job(str(target), dict(speculative_config) if speculative_config else None))
        configure_environment(options)
        LLM = import_llm()
        from specframe.vllm.vllm_plugin import register

        register()  # specframe's drafter models (ParallelSpec); the vllm.general_plugins entry point does the same
        self.speculative_config = dict(speculative_config) if speculative_config else None
        kwargs: dict[str, Any] = {}
        if self.speculative_config:
            kwargs["speculative_config"] = self.speculative_config
        if self.speculative_config or _speculators_export(target):
            kwargs["per_request_spec_decode_metrics"] = "detailed"
            self.speculative_config = self.speculative_config or {}
        self.llm = LLM(
            model=str(target),
            dtype=options.dtype,
            max_model_len=options.max_model_len,
            max_num_seqs=options.max_num_seqs,
            enforce_eager=options.enforce_eager,
            seed=options.seed,
            disable_log_stats=False,
            enable_prefix_caching=False,
            **kwargs,
        )

    def counters(self) -> SpecCounters:
        return SpecCounters.from_metrics(self.llm.get_metrics())

    def close(self) -> None:
        """Release the engine so another can start in this process (vLLM keeps process-wide parallel state)."""
        import gc

        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        self.llm = None
        gc.collect()
        destroy_model_parallel()
        destroy_distributed_environment()

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 256, ignore_eos: bool = False,
        together: bool = False,
    ) -> list[VllmGeneration]:
        """Greedy generation of each prompt (token ids), one after the other; ``together``: all of them handed to
        vLLM at once, up to ``max_num_seqs`` decoding in one batch (each request's rounds are still its own, from
        its per-request counters; its timings then measure the batch, not the request)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=ignore_eos)
        groups = [list(prompts)] if together else [[ids] for ids in prompts]
        results = []
        for group in groups:
            started = time.perf_counter()
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in group], params,
                                     use_tqdm=False)
            total = time.perf_counter() - started
            if len(outs) != len(group):
                raise SpecframeError(f"vLLM answered {len(outs)} of {len(group)} requests")
            results.extend(self._generation(out, total) for out in outs)
        return results

    def _generation(self, out: Any, total: float) -> VllmGeneration:
        completion = out.outputs[0]
        tokens = tuple(int(t) for t in completion.token_ids)
        stats = completion.spec_decode_metrics
        accepted = list(stats.per_step_accepted) if stats is not None else []
        drafted = list(stats.per_step_drafted) if stats is not None else []
        if self.speculative_config is not None and stats is None and len(tokens) > 1:
            raise SpecframeError("vLLM returned no per-request spec-decode metrics; is this vLLM older than 0.32?")
        return VllmGeneration(
            tokens=tokens,
            rounds=rounds_from_steps(len(tokens), accepted, drafted),
            decode_seconds=_decode_seconds(out, total),
            total_seconds=total,
        )


def _speculators_export(target: str | os.PathLike) -> bool:
    from specframe.layouts.export import SPECULATORS, layout_of

    path = Path(target) / "config.json"
    if not path.is_file():
        return False
    try:
        return layout_of(json.loads(path.read_text())) in SPECULATORS
    except ValueError:
        return False


def _decode_seconds(out: Any, total: float) -> float:
    stats = getattr(out, "metrics", None)
    first, last = getattr(stats, "first_token_ts", 0.0), getattr(stats, "last_token_ts", 0.0)
    if first and last >= first:
        return float(last - first)
    latency = getattr(stats, "first_token_latency", 0.0) or 0.0
    return max(total - latency, 0.0)


# ----------------------------------------------------------------------------------------------- in a child process


@attrs.frozen
class Job:
    """One engine to run in a child process: a target and an optional ``speculative_config``."""

    target: str
    speculative_config: dict[str, Any] | None = None


def drafter_job(export_dir: str | os.PathLike, k: int, target: str | os.PathLike | None = None) -> Job:
    """The engine job serving the export at ``export_dir`` with ``k`` draft tokens: a speculators export (EAGLE-3,
    P-EAGLE) without ``target`` is started from the folder alone (vLLM reads verifier and method from it); otherwise
    ``target`` is started with an explicit ``speculative_config``."""
    from specframe.vllm import support
    from specframe.layouts.export import read_manifest, speculative_config

    manifest = read_manifest(export_dir)
    manifest.check_tokens(k)  # a K the drafter cannot be served at (DFlash below block_size - 1), with the reason
    support.prestart(target, export_dir)  # before minutes of engine start-up, with the reason
    if target is None:
        if not manifest.speculators:
            raise SpecframeError(f"{export_dir} is a {manifest.layout} export: vLLM needs the target beside it")
        return Job(str(Path(export_dir).resolve()), {"num_speculative_tokens": int(k)})
    return Job(str(target), speculative_config(export_dir, k))


def check_job(job: Job) -> None:
    """``specframe.vllm.support.prestart`` for an engine job: the target alone, the target with the export its
    ``speculative_config`` names, or an export folder served alone (its verifier the target)."""
    from specframe.vllm import support

    model = (job.speculative_config or {}).get("model")
    if model is not None and (Path(model) / "config.json").is_file():
        support.prestart(job.target, model)
    elif _speculators_export(job.target):
        support.prestart(None, job.target)
    else:
        support.prestart(job.target)


@attrs.frozen
class VllmRun:
    """What one engine produced for a list of prompts, plus its counters over exactly those prompts."""

    generations: tuple[VllmGeneration, ...]
    counters: SpecCounters
    startup_seconds: float

    def metrics(self, k: int, baseline: VllmRun | None = None) -> AggregateMetrics:
        """specframe's pooled metrics (``k`` draft slots); ``baseline`` (plain decoding) gives the speedup."""
        base = [g.prompt_metrics() for g in baseline.generations] if baseline is not None else None
        return aggregate([g.prompt_metrics() for g in self.generations], k, base)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VllmRun:
        return cls(
            generations=tuple(VllmGeneration.from_dict(g) for g in data["generations"]),
            counters=SpecCounters(**{k: tuple(v) if isinstance(v, list) else v for k, v in data["counters"].items()}),
            startup_seconds=data["startup_seconds"],
        )


def run_jobs(
    jobs: Sequence[Job],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 256,
    ignore_eos: bool = False,
    options: EngineOptions = EngineOptions(),
    timeout: float = 1800,
    together: bool = False,
) -> list[VllmRun]:
    """Run ``jobs`` one after the other in one child process (vLLM is imported once; each engine is closed before
    the next starts) on the same ``prompts``, and return one ``VllmRun`` per job. ``together``: each engine gets
    every prompt at once (``VllmEngine.generate``), ``options.max_num_seqs`` of them in flight."""
    for job in jobs:  # here, before the child starts: one line instead of a child's traceback
        check_job(job)
    request = {
        "jobs": [attrs.asdict(j) for j in jobs],
        "prompts": [[int(t) for t in p] for p in prompts],
        "max_new_tokens": max_new_tokens,
        "ignore_eos": ignore_eos,
        "options": attrs.asdict(options),
        "together": together,
    }
    data = _run_worker(request, timeout)
    return [VllmRun.from_dict(r) for r in data["runs"]]


def run_in_subprocess(
    target: str | os.PathLike,
    prompts: Sequence[Sequence[int]],
    speculative_config: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> VllmRun:
    """``run_jobs`` for a single engine."""
    job = Job(str(target), dict(speculative_config) if speculative_config else None)
    return run_jobs([job], prompts, **kwargs)[0]


@attrs.frozen
class Conversation:
    """One evaluation item for ``run_interleaved``: user ``turns``; turn i > 0 is asked after plain decoding's
    answer to the turns before it."""

    id: str
    turns: tuple[str, ...]


@attrs.frozen
class Trial:
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

    trials: tuple[Trial, ...]
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
    trials: list[Trial] = []
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
                            trials.append(Trial(label, conv.id, turn, repeat, len(ids), generation))
                            if label == plain and len(answers.get(conv.id, [])) == 2 * turn:
                                answer = tok.decode(list(generation.tokens), skip_special_tokens=True).strip()
                                answers[conv.id] = [*answers.get(conv.id, []),
                                                    {"role": "user", "content": conv.turns[turn]},
                                                    {"role": "assistant", "content": answer}]
                    say(f"vLLM: repeat {repeat + 1} prompt {'+'.join(c.id for c in members)} turn {turn + 1} done")
        startup = dict(engines.startup_seconds)
    return Interleaved(tuple(trials), known, startup, options.threads_bind or cpu_binding())


def _needs_own_process(job: Job) -> bool:
    """vLLM's n-gram proposer imports numba; once llvmlite is loaded, starting another engine in that process fails
    (vLLM 0.32's Triton kernel override scan trips over llvmlite's wrappers). So an n-gram engine is started last in
    a process, and a second one gets a process of its own."""
    return bool(job.speculative_config) and job.speculative_config.get("method") == "ngram"


def process_groups(jobs: Mapping[str, Job]) -> list[dict[str, Job]]:
    """Jobs by child process, each process's engines in start order: every engine that can share the first process
    does, an n-gram engine goes last in it, each further n-gram engine gets a process of its own."""
    shared = {label: j for label, j in jobs.items() if not _needs_own_process(j)}
    groups = [shared]
    for label, j in jobs.items():
        if _needs_own_process(j):
            if any(_needs_own_process(x) for x in groups[0].values()):
                groups.append({label: j})
            else:
                groups[0][label] = j
    return [g for g in groups if g]


class EngineProcesses:
    """Engines kept alive in child processes, driven from this one: ``generate(label, ids, max_new_tokens)`` runs
    one prompt on one engine, ``generate_together`` several at once. Every engine that can share a process does (vLLM is imported once); what vLLM cannot
    start after it (see ``_needs_own_process``) goes last or into a process of its own. Each child's vLLM log goes
    to a temporary file whose tail is shown if it fails."""

    def __init__(self, jobs: Mapping[str, Job], options: EngineOptions = EngineOptions(), timeout: float = 1800):
        import multiprocessing

        for job in jobs.values():  # every engine, before the first child starts (``check_job``)
            check_job(job)
        self.timeout = timeout
        groups = process_groups(jobs)
        self._tmp = tempfile.TemporaryDirectory(prefix="specframe-vllm-")
        context = multiprocessing.get_context("spawn")  # vLLM must not inherit a forked torch state
        self._children: list[tuple[Any, Any, Path]] = []
        self._owner: dict[str, Any] = {}
        self.startup_seconds: dict[str, float] = {}
        try:
            for i, group in enumerate(groups):
                log = Path(self._tmp.name) / f"vllm-{i}.log"
                parent, child = context.Pipe()
                process = context.Process(
                    target=_serve, args=(child, {k: attrs.asdict(v) for k, v in group.items()},
                                         attrs.asdict(options), str(log)), daemon=True)
                process.start()
                child.close()
                self._children.append((process, parent, log))
                for label in group:
                    self._owner[label] = parent
            for process, conn, log in self._children:
                self.startup_seconds.update(self._receive(conn, log, process))
        except BaseException:
            self.close()
            raise

    def _receive(self, conn: Any, log: Path, process: Any) -> Any:
        if not conn.poll(self.timeout):
            raise SpecframeError(f"vLLM did not answer within {self.timeout:.0f} s:\n{_tail(_read(log))}")
        try:
            message = conn.recv()
        except EOFError:
            process.join(5)
            raise SpecframeError(f"vLLM failed (exit {process.exitcode}):\n{_tail(_read(log))}") from None
        if isinstance(message, dict) and "error" in message:
            raise SpecframeError(f"vLLM failed: {message['error']}\n{_tail(_read(log))}")
        return message

    def generate(self, label: str, ids: Sequence[int], max_new_tokens: int) -> VllmGeneration:
        (generation,) = self.generate_together(label, [ids], max_new_tokens)
        return generation

    def generate_together(self, label: str, prompts: Sequence[Sequence[int]], max_new_tokens: int
                          ) -> list[VllmGeneration]:
        """``prompts`` handed to one engine at once (``VllmEngine.generate(..., together=True)``): up to the engine's
        ``max_num_seqs`` decode in one batch, as concurrent requests to a server do."""
        conn = self._owner[label]
        conn.send((label, [[int(t) for t in ids] for ids in prompts], int(max_new_tokens)))
        process, _, log = next(c for c in self._children if c[1] is conn)
        return [VllmGeneration.from_dict(g) for g in self._receive(conn, log, process)]

    def close(self) -> None:
        for process, conn, _ in self._children:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()
        self._children = []
        self._tmp.cleanup()

    def __enter__(self) -> EngineProcesses:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _serve(conn: Any, jobs: dict[str, dict[str, Any]], options: dict[str, Any], log: str) -> None:
    """A child of ``EngineProcesses``: start the engines in order, report their start-up times, then answer
    ``(label, prompts, max_new_tokens)`` requests (the prompts decoded together) with their generations until
    ``None`` arrives."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)  # vLLM logs to stdout: keep the user's terminal for specframe's own output
    os.dup2(fd, 2)
    try:
        engines, startup = {}, {}
        for label, job in jobs.items():
            started = time.perf_counter()
            engines[label] = VllmEngine(job["target"], job["speculative_config"], EngineOptions(**options))
            startup[label] = time.perf_counter() - started
        conn.send(startup)
        while (request := conn.recv()) is not None:
            label, prompts, max_new = request
            generations = engines[label].generate(prompts, max_new, together=True)
            conn.send([g.as_dict() for g in generations])
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it as a SpecframeError
        import traceback

        traceback.print_exc()
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # vLLM's in-process engine leaves non-daemon threads behind


@attrs.frozen
class Comparison:
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


def compare(
    target: str | os.PathLike,
    prompts: Sequence[Sequence[int]],
    speculative_config: Mapping[str, Any],
    *,
    max_new_tokens: int = 256,
    ignore_eos: bool = False,
    options: EngineOptions = EngineOptions(),
) -> Comparison:
    """Plain decoding, then speculative decoding, of ``prompts`` on ``target``, one engine after the other in one child process;
    speedup = OTPS(speculative) / OTPS(plain) as docs/design.md section 8 defines it."""
    plain, spec = run_jobs(
        [Job(str(target)), Job(str(target), dict(speculative_config))],
        prompts, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, options=options,
    )
    k = int(speculative_config["num_speculative_tokens"])
    return Comparison(
        plain=plain,
        speculative=spec,
        metrics=spec.metrics(k, baseline=plain),
        outputs_equal=[g.tokens for g in plain.generations] == [g.tokens for g in spec.generations],
    )


def _run_worker(request: Mapping[str, Any], timeout: float) -> dict[str, Any]:
    """Run ``specframe.vllm._worker`` on ``request`` in a child process and return its result."""
    with tempfile.TemporaryDirectory(prefix="specframe-vllm-") as tmp:
        req_path, out_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req_path.write_text(json.dumps(request))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "specframe.vllm._worker", str(req_path), str(out_path)],
                capture_output=True, text=True, timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise SpecframeError(f"vLLM did not finish within {timeout:.0f} s") from exc
        if proc.returncode != 0 or not out_path.exists():
            raise SpecframeError(f"vLLM failed (exit {proc.returncode}):\n{_tail(proc.stderr)}")
        data = json.loads(out_path.read_text())
    if "error" in data:
        raise SpecframeError(data["error"])
    return data


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
