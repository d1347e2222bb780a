"""``specframe generate``: decode one prompt with a trained drafter, an untrained one (ngram) or none (plain)."""

from __future__ import annotations

import json

import click

from specframe.cli.decoding_options import decoding_options, tree_shape
from specframe.cli.target_options import target_loading


@click.command("generate")
@click.option("--checkpoint", default=None, type=click.Path(file_okay=False),
              help="A training checkpoint, or a run's output folder (its latest checkpoint).")
@click.option("--drafter", default=None,
              help="An untrained drafter plugin instead of a checkpoint (ngram: prompt lookup), its options inline as "
                   "NAME:KEY=VALUE,... (ngram:n_max=4). Neither: plain decoding.")
@click.option("--prompt", required=True, help="The user message (rendered through the target's chat template).")
@decoding_options
@click.option("--json", "as_json", is_flag=True,
              help="Print JSON: text, tokens, acceptance length, target forwards, rounds, OTPS, timings.")
@target_loading
def generate(
    checkpoint: str | None, drafter: str | None, prompt: str, target: str | None, k: int | None, verifier: str,
    tree_depth: int | None, tree_top_k: int | None, tree_tokens: int | None, max_new_tokens: int,
    temperature: float | None, top_k: int | None, top_p: float | None, seed: int, threads: int | None,
    as_json: bool, loading,
) -> None:
    """Generate an answer to one prompt, speculatively when a drafter is given.

    Under a greedy verifier the text equals plain decoding's, token for token; the figures show what the drafter
    bought: acceptance length (tokens per target verification forward), target forwards and output tokens per
    second of the decode phase.
    """
    import torch

    from specframe import bench
    from specframe.errors import UsageError
    from specframe.metrics import PromptMetrics

    if checkpoint is not None and drafter is not None:
        raise UsageError("give --checkpoint (a trained drafter) or --drafter (an untrained plugin), not both")
    if k is not None and k < 1:
        raise UsageError(f"--k must be positive, got {k}")
    if threads is not None:
        torch.set_num_threads(threads)
    tree = tree_shape(verifier, tree_depth, tree_top_k, tree_tokens)
    verify = bench.make_verifier(verifier, temperature=temperature, top_k=top_k, top_p=top_p)
    if target is None:
        target = (bench.first_recorded_target([checkpoint]) if checkpoint else None) or "default"
    tgt = loading.load(target)
    if checkpoint is not None:
        method = bench.checkpoint_method(checkpoint, tgt.config, k=k, tree=tree)
    elif drafter is not None:
        method = bench.plugin_method(drafter, tgt.config, k=5 if k is None else k, tree=tree)
    else:
        if tree is not None:
            raise UsageError("a draft tree needs a drafter: give --checkpoint or --drafter")
        method = bench.Method(bench.PLAIN)
    ids = bench.chat_ids(tgt.tokenizer, [{"role": "user", "content": prompt}])
    trial = bench.decode(tgt.model, ids, verify, method, max_new_tokens=max_new_tokens, seed=seed)
    gen = trial.generation
    metrics = PromptMetrics.of(gen)
    text = tgt.tokenizer.decode(gen.tokens, skip_special_tokens=True)
    result = {
        "text": text,
        "tokens": gen.tokens,
        "prompt_tokens": len(ids),
        "new_tokens": len(gen.tokens),
        "acceptance_length": metrics.acceptance_length,
        "target_forwards": gen.target_forwards,
        "rounds": metrics.forwards,
        "accepted": sum(metrics.accepted),
        "otps": metrics.otps,
        "decode_seconds": gen.decode_seconds,
        "prefill_seconds": gen.prefill_seconds,
        "draft_seconds": trial.draft_seconds,
        "stop_reason": gen.stop_reason,
        "drafter": getattr(method.drafter, "name", None),
        "checkpoint": method.checkpoint,
        "k": method.k if method.drafter is not None else 0,
        "tree": None if tree is None else {"depth": tree.depth, "top_k": tree.top_k, "total_tokens": tree.total_tokens},
        "verifier": verifier,
        "target": tgt.id,
    }
    if as_json:
        click.echo(json.dumps(result, indent=1))
        return
    click.echo(text)
    who = f"{result['drafter']} k={result['k']}" if method.drafter is not None else "plain decoding"
    click.echo(
        f"[{who}] {len(gen.tokens)} tokens, AL {metrics.acceptance_length:.2f}, {gen.target_forwards} target "
        f"forwards (prefill included), {metrics.otps:.1f} tok/s decode",
        err=True,
    )
