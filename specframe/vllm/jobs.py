"""vLLM engines in child processes: ``run_jobs`` runs engine ``Job`` s one after the other in one child
(``python -m specframe.vllm._worker``; each engine closed before the next starts) and ``EngineProcesses`` keeps
engines alive in children (``_serve``, started by ``multiprocessing`` with spawn), driven from this process. A child
takes vLLM's memory and threads with it, and imports vLLM once for all its engines; every job is checked here
(``check_job``) before the first child starts. ``VllmRun`` is what one engine produced for a list of prompts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from specframe.errors import SpecframeError
from specframe.metrics import AggregateMetrics, aggregate
from specframe.vllm.counters import SpecCounters, VllmGeneration
from specframe.vllm.engine import EngineOptions, VllmEngine, check_engine


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
    from specframe.layouts.export import manifest_of, read_config

    config = read_config(Path(export_dir))  # read once: the manifest, the check and the job all come from it
    manifest = manifest_of(config, export_dir)
    manifest.check_tokens(k)  # a K the drafter cannot be served at (DFlash below block_size - 1), with the reason
    support.prestart(target, export_dir, config=config)  # before minutes of engine start-up, with the reason
    if target is None:
        if not manifest.speculators:
            raise SpecframeError(f"{export_dir} is a {manifest.layout} export: vLLM needs the target beside it")
        return Job(str(Path(export_dir).resolve()), {"num_speculative_tokens": int(k)})
    return Job(str(target), manifest.speculative_config(export_dir, k))


def check_job(job: Job) -> None:
    """``specframe.vllm.engine.check_engine`` for an engine job, here, before a child starts: one line instead of a
    child's traceback."""
    check_engine(job.target, job.speculative_config)


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
