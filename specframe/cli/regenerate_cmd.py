"""``specframe regenerate``: answer prompts with the target (self-distilled training data)."""

from __future__ import annotations

import datetime as _dt
import gzip
import json
import os
import platform
import sys
import time
from pathlib import Path

import click

from specframe.cli.target_options import target_loading
from specframe.cli.vllm_options import engine_options
from specframe.devices import TARGET_ENGINES


def _batch_done(prog, task, i, n, out, keep_dir) -> None:
    """After each finished batch: the progress bar, and the kept copy of the progress (--keep)."""
    prog.update(task, completed=i, total=n)
    if keep_dir:
        from specframe.data.progress import keep

        keep(out, keep_dir)


@click.command("regenerate")
@click.option("--target", default="default", show_default=True, help="Target: 'default', a model folder or a hub id.")
@click.option(
    "--data",
    "data",
    multiple=True,
    required=True,
    help="Prompt source (repeatable): sharegpt, gsm8k, gsm8k-eval, mt-bench, humaneval, a JSONL file or a hub id; "
    "'default-prompts' / 'large-prompts' = the prompts of the committed default / large set. The first user turn of "
    "each record is answered.",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Use only the first N records of each --data source.")
@click.option(
    "--output",
    required=True,
    type=click.Path(dir_okay=False),
    help="Final answers file (.jsonl or .jsonl.gz, sorted by source and id). Work in progress goes to OUTPUT.part, "
    "which a rerun resumes.",
)
@click.option("--provenance", type=click.Path(dir_okay=False), default=None, help="Write a provenance JSON here.")
@click.option("--batch-size", type=int, default=16, show_default=True, help="Prompts per generate() call.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True, help="Answer length cap (tokens).")
@click.option(
    "--max-prompt-tokens", type=click.IntRange(min=1), default=512, show_default=True, help="Skip prompts longer than this (tokens)."
)
@click.option(
    "--shard",
    default="0/1",
    show_default=True,
    help="K/W: run as worker K of W parallel processes (each takes every W-th batch and writes OUTPUT.part-K-of-W); "
    "any worker finishing last writes the merged OUTPUT.",
)
@click.option(
    "--finalize-only",
    is_flag=True,
    help="Generate nothing: merge the part files finished so far into OUTPUT and write the provenance "
    "(for a run stopped early; the provenance then counts what exists).",
)
@click.option("--keep", "keep_dir", type=click.Path(file_okay=False), default=None,
              help="A folder (in the checkout, to commit) that holds a copy of the run's progress, updated after every "
              "finished batch; a rerun whose work folder has less (lost with its machine) resumes from it.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads: torch's (transformers engine) or vLLM's pinned OpenMP threads (default: all).")
@click.option("--engine", type=click.Choice(TARGET_ENGINES), default="transformers", show_default=True,
              help="What answers: transformers' generate() on one padded batch (the reference), or vLLM's offline "
              "engine with every prompt of a batch in flight (continuous batching; use a large --batch-size).")
@engine_options(max_num_seqs="vLLM: requests decoded together (default: --batch-size).")
@click.option("--capture", "capture", type=click.Path(file_okay=False), default=None,
              help="--engine vllm: also write the answered conversations' feature cache to this folder, the states "
              "taken from the answering pass (prefix caching: only each conversation's closing tail is computed "
              "again); the same cache `specframe prepare` writes, parity gate included. Resumable with the answers.")
@click.option("--aux-layers", default="default", show_default=True,
              help="--capture: aux layer ids, as `specframe prepare --aux-layers`.")
@click.option("--storage-dtype", type=click.Choice(["float16", "bfloat16", "float32"]), default="float16",
              show_default=True, help="--capture: dtype the cache stores the states in.")
@click.option("--draft-vocab", type=int, default=16384, show_default=True,
              help="--capture: as prepare's --draft-vocab, the N most frequent assistant tokens and their "
              "coverage, saved beside the cache for inspection (0 = none); a drafter's vocabulary is its "
              "draft_vocab_size option.")
@click.option("--teacher-top-k", type=int, default=0, show_default=True,
              help="--capture: also store the target's K most likely next tokens, as `specframe prepare`.")
@click.option("--gate-sequences", type=int, default=4, show_default=True,
              help="--capture: conversations recomputed with transformers and compared layer by layer before the cache "
              "is written (at least 1).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@target_loading
def regenerate(data, limit, target, output, provenance, batch_size, max_new_tokens, max_prompt_tokens, shard, finalize_only,
               keep_dir, threads, engine, capture, aux_layers, storage_dtype, draft_vocab, teacher_top_k, gate_sequences,
               as_json, loading, vllm):
    """Answer prompts greedily with the target; resumable (rerun the same command after a kill)."""
    import torch
    from rich.progress import Progress

    from specframe.data.regenerate import regenerate as run_regenerate
    from specframe.data.specs import load_data
    from specframe.errors import UsageError

    if batch_size < 1 or max_new_tokens < 1:
        raise UsageError("--batch-size and --max-new-tokens must be positive")
    if engine == "vllm" and loading.device_map is not None:
        raise UsageError("--device-map places a transformers model; vLLM spreads a target with "
                         "--tensor-parallel-size / --pipeline-parallel-size")
    if capture is not None:
        if engine != "vllm":
            raise UsageError("--capture takes the states from vLLM's answering pass: use it with --engine vllm "
                             "(with transformers, 'specframe prepare' computes them)")
        if shard != "0/1":
            raise UsageError("--capture runs as one process (--shard 0/1): the cache is written from every answer; "
                             "spread a large target with --tensor-parallel-size / --pipeline-parallel-size")
        if gate_sequences < 1:
            raise UsageError(f"--gate-sequences must be at least 1, got {gate_sequences}: a cache from vLLM is never "
                             "accepted unchecked")
    if threads and (engine == "transformers" or capture is not None):
        torch.set_num_threads(threads)
    # the prompts first: a --data that names nothing is refused before a target is loaded or an engine starts
    records = []
    for d in data:
        if d == "default-prompts":
            from specframe.data.default import default_prompt_records

            records.extend(default_prompt_records())
        elif d == "large-prompts":
            from specframe.data.large import large_prompt_records

            records.extend(large_prompt_records())
        else:
            records.extend(load_data(d, limit=limit))
    try:
        k, w = (int(x) for x in shard.split("/"))
        assert 0 <= k < w
    except (ValueError, AssertionError):
        raise UsageError(f"--shard must be K/W with 0 <= K < W, not '{shard}'") from None
    # vLLM reads the weights itself: only the tokenizer (prompt ids, decoding) and the weights' hash are needed here,
    # unless a cache is captured (its gate's reference forward, final norm and teacher are the target's own)
    tgt = loading.load(target, weights=engine == "transformers" or capture is not None)
    from specframe.data.regenerate import TransformersAnswerer

    answerer = TransformersAnswerer(tgt) if engine == "transformers" else None
    spec = staged = None
    if capture is not None:
        from specframe.cache import capture_spec
        from specframe.cli.feature_options import feature_spec
        from specframe.feature_engines import engine_layer_ids
        from specframe.vllm.capture import CLOSING_TOKENS, StagedStates, staging_folder

        spec = feature_spec(aux_layers, tgt.num_layers)
        capture_length = max_prompt_tokens + max_new_tokens + CLOSING_TOKENS
        staged = StagedStates(staging_folder(capture),
                              engine_layer_ids(capture_spec(spec, teacher_top_k), tgt.num_layers))
    if engine == "vllm" and not finalize_only:
        from specframe.vllm.answer import VllmAnswerer

        options = vllm.answer_options(dtype=loading.dtype, max_model_len=max_prompt_tokens + max_new_tokens,
                                      max_num_seqs=batch_size, threads=threads)
        if capture is None:
            answerer = VllmAnswerer(str(tgt.path), options)
        else:
            import attrs

            from specframe.vllm.capture import VllmCapture
            from specframe.vllm.states import model_len

            answerer = VllmCapture(tgt.path, staged.layer_ids, attrs.evolve(
                options, max_model_len=model_len(tgt.config, capture_length, "--max-prompt-tokens + --max-new-tokens")),
                tokenizer=tgt.tokenizer, max_length=capture_length, staging=staged)
            staged.fallback = answerer
    out = Path(output)
    if keep_dir:
        from specframe.data.progress import restore

        for p in restore(keep_dir, out):
            click.echo(f"restored {p.name} from {keep_dir}", err=True)
    part = out.with_name(out.name + (".part" if w == 1 else f".part-{k}-of-{w}"))
    parts = sorted(q for q in out.parent.glob(out.name + ".part*") if q.suffix != ".log")
    t0 = time.time()
    from specframe.data.regenerate import RegenerateReport

    with Progress(transient=True, disable=as_json or not sys.stderr.isatty()) as prog:
        task = prog.add_task("regenerate", total=None)
        rep = RegenerateReport(total=len(records)) if finalize_only else run_regenerate(
            tgt,
            records,
            part,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            max_prompt_tokens=max_prompt_tokens,
            progress=lambda i, n: _batch_done(prog, task, i, n, out, keep_dir),
            shard=(k, w),
            also_done=parts,
            answerer=answerer,
            on_batch=answerer.capture if staged is not None and answerer is not None else None,
        )
    runs_log = out.with_name(out.name + ".runs.jsonl")
    with open(runs_log, "a", encoding="utf-8") if not finalize_only else open(os.devnull, "w") as f:
        f.write(json.dumps({"shard": shard, "engine": engine, "threads": threads or torch.get_num_threads(),
                            **rep.as_dict()}) + "\n")
    if keep_dir and not finalize_only:  # the runs log too, written only now
        from specframe.data.progress import keep

        keep(out, keep_dir)
    seen: dict = {}
    batch_log = []
    for p in sorted(out.parent.glob(out.name + ".part*.log")):
        batch_log += [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]
    for p in sorted(q for q in out.parent.glob(out.name + ".part*") if q.suffix != ".log"):
        for line in p.read_text(encoding="utf-8").splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            seen.setdefault((r["source"], r["id"]), r)
    rows = list(seen.values())
    rows.sort(key=lambda r: (r["source"], _natural(r["id"])))
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if out.suffix == ".gz":
        with open(tmp, "wb") as fb, gzip.GzipFile(fileobj=fb, mode="wb", mtime=0, filename="") as f:
            f.write(text.encode("utf-8"))
    else:
        tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    captured = None
    if capture is not None:
        from specframe.vllm.capture import write_captured_cache

        captured = write_captured_cache(tgt, records, rows, capture, staged, spec, data_name=f"regenerate:{out.name}",
                                        max_length=capture_length, dtype=storage_dtype,
                                        draft_vocab=draft_vocab or None, teacher_top_k=teacher_top_k,
                                        gate_sequences=gate_sequences)
    if answerer is not None and hasattr(answerer, "close"):
        answerer.close()
    summary = rep.as_dict() | {
        "output": str(out),
        "records": len(rows),
        "bytes": out.stat().st_size,
        "wall_seconds": round(time.time() - t0, 1),
    } | ({"capture": captured} if captured is not None else {})
    if provenance:
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["source"]] = counts.get(r["source"], 0) + 1
        from specframe.home import specframe_home

        command = ("specframe regenerate " + " ".join(sys.argv[sys.argv.index("regenerate") + 1 :])
                   if "regenerate" in sys.argv else "specframe regenerate")
        prov = {
            # a work folder under the specframe home is named as such: the same on every machine
            "command": command.replace(str(specframe_home()), "$SPECFRAME_HOME"),
            "target_id": tgt.id,
            "target_weights_hash": tgt.weights_hash,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "generation": {"greedy": True, "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens,
                           "batch_size": batch_size, "threads": threads or torch.get_num_threads(), "dtype": loading.dtype,
                           **(answerer.describe() if answerer is not None else {"engine": engine})},
            "counts": {"records": len(rows), "by_source": counts,
                       "finished_before_cap": sum(1 for r in rows if r["finished"]),
                       "answer_tokens": sum(r["answer_tokens"] for r in rows)},
            "generation_seconds_total": round(sum(b["seconds"] for b in batch_log), 1),
            "batches_logged": len(batch_log),
            "runs": [json.loads(x) for x in runs_log.read_text(encoding="utf-8").splitlines() if x.strip()]
            if runs_log.exists() else [],
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
            "note": "answers only; prompts are joined from their sources by specframe.data.default.load_default",
        }
        Path(provenance).write_text(json.dumps(prov, indent=1) + "\n", encoding="utf-8")
    if as_json:
        click.echo(json.dumps(summary, indent=1))
    else:
        click.echo(
            f"{summary['records']} answers in {out} ({summary['bytes']} bytes); this run generated {rep.generated} "
            f"({rep.answer_tokens} tokens in {rep.seconds:.0f} s), {rep.already_done} already done, "
            f"{rep.skipped_long} prompts over --max-prompt-tokens, {rep.skipped_empty} empty"
        )
        if captured is not None:
            click.echo(captured["line"])


def _natural(s: str):
    return (0, int(s), "") if s.isdigit() else (1, 0, s)
