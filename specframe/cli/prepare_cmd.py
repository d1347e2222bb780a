"""``specframe prepare``: build (or resume) the feature cache every drafter trains on."""

from __future__ import annotations

import json
import os
import signal
import sys

import click

from specframe.cli.feature_options import feature_spec
from specframe.cli.target_options import target_loading
from specframe.cli.vllm_options import engine_options
from specframe.devices import TARGET_ENGINES


@click.command("prepare")
@click.option("--target", default="default", show_default=True, help="Target: 'default', a model folder or a hub id.")
@click.option(
    "--data",
    default="default",
    show_default=True,
    help="Conversations: default (committed self-distilled set), sharegpt, gsm8k, a JSONL file of "
    "{messages: [{role, content}]} records, or a hub dataset id.",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Use only the first N records of --data.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Cache folder (created; resumed if it exists).")
@click.option(
    "--aux-layers",
    default="default",
    show_default=True,
    help="Comma-separated aux layer ids (id i = hidden state entering decoder layer i, 0 = embeddings), "
    "'default' = vLLM's (2, L//2, L-3), or 'none'.",
)
@click.option("--no-final-hidden", is_flag=True, help="Do not store the final (post-norm) hidden state.")
@click.option("--storage-dtype", type=click.Choice(["float16", "bfloat16", "float32"]), default="float16", show_default=True,
              help="Dtype the hidden states are stored in (the target computes them in --dtype).")
@target_loading
@click.option("--max-length", type=int, default=2048, show_default=True, help="Skip conversations longer than this (tokens).")
@click.option("--shard-size", type=int, default=64, show_default=True, help="Conversations per shard file.")
@click.option("--max-batch-tokens", type=int, default=4096, show_default=True, help="Padded tokens per target forward.")
@click.option("--draft-vocab", type=int, default=16384, show_default=True,
              help="The N most frequent assistant tokens and the share of assistant tokens they cover, printed and "
              "saved as vocab.safetensors beside the cache for inspection (0 = none). A drafter picks its own "
              "vocabulary from its draft_vocab_size option, never from this.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch CPU threads (default: torch's choice).")
@click.option("--teacher-top-k", type=int, default=0, show_default=True,
              help="Also store the target's K most likely next tokens and their log-probabilities per token: a "
                   "compact teacher, so drafters that learn the target's distribution (eagle3, peagle, "
                   "parallelspec) train without running its head. Exact where the target's mass over the draft "
                   "vocabulary lies in its top K; the summary reports the mass kept. 0: none.")
@click.option("--data-workers", type=int, default=None,
              help="Processes that tokenise the conversations (datasets' map). Default: 1 below 2,048 "
                   "conversations, else up to 8.")
@click.option("--skip-bad-lines", is_flag=True, help="Skip (and count) malformed JSONL lines instead of stopping.")
@click.option("--engine", type=click.Choice(TARGET_ENGINES), default="transformers", show_default=True,
              help="Where the hidden states come from: the target's transformers forward (the reference), or vLLM's "
                   "offline engine (extract_hidden_states: tensor / pipeline parallel, every conversation of a shard "
                   "in flight). A vLLM cache must first pass a parity gate against transformers (--gate-sequences).")
@click.option("--gate-sequences", type=int, default=4, show_default=True,
              help="--engine vllm: conversations recomputed with transformers and compared layer by layer before "
                   "anything is written (at least 1).")
@engine_options(max_num_seqs="vLLM: requests in flight (default: --shard-size).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def prepare(target, data, limit, output, aux_layers, no_final_hidden, storage_dtype, max_length, shard_size, max_batch_tokens,
            draft_vocab, threads, teacher_top_k, data_workers, skip_bad_lines, engine, gate_sequences, as_json, loading,
            vllm):
    """Run the target over conversations and cache token ids, assistant-only loss masks and hidden states.

    Rerunning the same command after an interruption resumes: finished shards are kept. A cache folder made for
    another target, data or configuration is refused.
    """
    import torch
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from specframe.cache import capture_spec, prepare_cache
    from specframe.data.specs import load_data
    from specframe.errors import UsageError
    from specframe.feature_engines import engine_layer_ids

    # with --engine vllm the target is still loaded here (--device / --device-map place it): the parity gate's
    # reference forward, the final norm and the teacher's head are its own
    if engine == "vllm" and gate_sequences < 1:
        raise UsageError(f"--gate-sequences must be at least 1, got {gate_sequences}: a cache from vLLM is never "
                         "accepted unchecked")
    if threads:
        torch.set_num_threads(threads)
    # the conversations first: a --data that names nothing is refused before the target is loaded
    load_stats: dict = {"bad_lines": 0}
    records = load_data(data, limit=limit, skip_bad_lines=skip_bad_lines, stats=load_stats)
    tgt = loading.load(target)
    spec = feature_spec(aux_layers, tgt.num_layers, final_hidden=not no_final_hidden)
    aux = spec.aux_layers
    kill_after = os.environ.get("SPECFRAME_TEST_KILL_AFTER_SHARD")  # test hook: SIGKILL ourselves after shard N

    def after_shard(k: int) -> None:
        if kill_after is not None and k == int(kill_after):
            os.kill(os.getpid(), signal.SIGKILL)

    states = None
    if engine == "vllm":  # started before the cache folder is touched: an unusable vLLM is refused with nothing written
        from specframe.vllm.states import VllmStates, model_len

        # each conversation is a prompt of at most --max-length tokens and one generated token, never used
        states = VllmStates(tgt.path, engine_layer_ids(capture_spec(spec, teacher_top_k), tgt.num_layers),
                            vllm.answer_options(dtype=loading.dtype,
                                                max_model_len=model_len(tgt.config, max_length, "--max-length"),
                                                max_num_seqs=shard_size, threads=threads))
    console = Console(stderr=True)
    try:
        with Progress(TextColumn("prepare"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=console,
                      transient=True, disable=as_json or not console.is_terminal) as prog:
            task = prog.add_task("shards", total=None)
            rep = prepare_cache(
                tgt, records, output, spec=spec, dtype=storage_dtype, max_length=max_length, shard_size=shard_size,
                max_batch_tokens=max_batch_tokens, draft_vocab=draft_vocab or None,
                data_name=f"{data}" + (f"[:{limit}]" if limit else ""),
                progress=lambda i, n: prog.update(task, completed=i, total=n), workers=data_workers,
                teacher_top_k=teacher_top_k, engine=states, gate_sequences=gate_sequences, _after_shard=after_shard,
            )
    finally:
        if states is not None:
            states.close()
    d = rep.as_dict() | {"bad_lines_skipped": load_stats["bad_lines"], "output": str(output), "target": tgt.id, "aux_layers": list(aux or []), "dtype": storage_dtype, "target_dtype": loading.dtype}
    if as_json:
        click.echo(json.dumps(d, indent=1))
    else:
        click.echo(
            f"cache {output}: {rep.examples} conversations, {rep.tokens} tokens, {rep.shards} shards "
            f"({rep.shards_reused} reused), {rep.bytes / 2**20:.1f} MiB in {rep.seconds:.1f} s "
            f"({rep.tokens_per_second:.0f} tokens/s captured); data: {rep.encode.summary()}, "
            f"{load_stats['bad_lines']} malformed lines skipped; draft vocab "
            f"{rep.draft_vocab_size} covers {rep.draft_vocab_coverage:.2%} of assistant tokens"
            + (f"; teacher top-{rep.teacher_top_k} holds {rep.teacher_mass:.2%} of the target's probability mass"
               if rep.teacher_top_k else "")
            + (f"; features from {states.name}, {rep.gate.summary()}" if rep.gate is not None else "")
        )
    sys.stdout.flush()
