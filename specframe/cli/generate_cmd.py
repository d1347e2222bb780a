"""``specframe generate``: decode one prompt with a trained drafter, an untrained one (ngram) or none (plain)."""

from __future__ import annotations

import json

import click

from specframe.cli.target_options import target_loading

from specframe.inference.engine import DEFAULT_MAX_NEW_TOKENS


def decoding_options(fn=None, *, bench: bool = False):
    """Options ``generate`` and ``bench acceptance`` share. ``bench``: ``--k`` may be repeated (a tuple, empty when
    not given: each method is measured at every K) and ``--threads`` also pins vLLM's threads."""
    many_k = bench
    if fn is None:
        return lambda f: decoding_options(f, bench=bench)
    k_help = ("Draft tokens per round (chain); repeat to measure every method at several K (--k 2 --k 3). Default: "
              "the drafter's own k_infer, else 5.") if many_k else ("Draft tokens per round (chain). Default: the "
                                                                     "drafter's own k_infer, else 5.")
    options = [
        click.option("--target", default=None, help="Target model: 'default' (embedded SmolLM2-135M-Instruct), a "
                     "folder or a hub id. Default: the target the checkpoint trained against, else 'default'."),
        click.option("--k", "k", type=int, multiple=many_k, default=() if many_k else None, help=k_help),
        click.option("--verifier", default="greedy", show_default=True,
                     help="Verifier plugin: greedy, sampling, tree (see `specframe plugins`)."),
        click.option("--tree-depth", type=int, default=None, help="Draft a tree of this many levels (EAGLE-2). "
                     "Any --tree-* option (or --verifier tree) drafts trees; unset ones take 6 / 10 / 60."),
        click.option("--tree-top-k", type=int, default=None, help="Children expanded per tree node."),
        click.option("--tree-tokens", type=int, default=None, help="Draft tree nodes in total."),
        click.option("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, show_default=True,
                     help="Stop after this many new tokens (or at the end-of-turn token)."),
        click.option("--temperature", type=float, default=None,
                     help="Sampling temperature (sampling and tree verifiers; 0 is greedy)."),
        click.option("--top-k", "top_k", type=int, default=None, help="Sample from the k most likely tokens only."),
        click.option("--top-p", type=float, default=None, help="Nucleus sampling mass."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of every random draw."),
        click.option("--threads", type=int, default=None,
                     help="torch threads (default: torch's; on a busy CPU one thread can be fastest)." + (
                         " With --engine vllm: vLLM's threads are pinned to the first N CPUs (default: every CPU "
                         "this process may use; recorded in the results)." if bench else "")),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def tree_shape(verifier: str, depth: int | None, top_k: int | None, tokens: int | None):
    from specframe.inference.engine import TreeShape

    from specframe import plugins

    drafts_trees = plugins.get("verifier", verifier).drafts_trees  # declared (API 6), never read from its name
    if not drafts_trees and depth is None and top_k is None and tokens is None:
        return None
    defaults = TreeShape()
    return TreeShape(
        depth=defaults.depth if depth is None else depth,
        top_k=defaults.top_k if top_k is None else top_k,
        total_tokens=defaults.total_tokens if tokens is None else tokens,
    )


@click.command("generate")
@click.option("--checkpoint", default=None, type=click.Path(file_okay=False),
              help="A training checkpoint, or a run's output folder (its latest checkpoint).")
@click.option("--drafter", default=None,
              help="An untrained drafter plugin instead of a checkpoint (ngram: prompt lookup). Neither: plain "
                   "decoding.")
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
