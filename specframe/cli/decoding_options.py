"""The decoding options ``specframe generate`` and ``specframe bench acceptance`` share (``decoding_options``: the
target, K, the verifier and its sampling, the draft tree, the length, the seed and threads) and the draft tree they
name (``tree_shape``)."""

from __future__ import annotations

import click

from specframe.inference.defaults import DEFAULT_MAX_NEW_TOKENS


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
                     help="Verifier plugin: greedy, sampling, tree (see `specframe plugins`), its options inline as "
                          "NAME:KEY=VALUE,... (sampling:temperature=0.7)."),
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
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="torch threads (default: torch's; on a busy CPU one thread can be fastest)." + (
                         " With --engine vllm: vLLM's threads are pinned to the first N CPUs (default: every CPU "
                         "this process may use; recorded in the results)." if bench else "")),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def tree_shape(verifier: str, depth: int | None, top_k: int | None, tokens: int | None):
    from specframe import compose, plugins
    from specframe.inference.engine import TreeShape

    # declared (API 6), never read from its name; the name without its inline options
    drafts_trees = plugins.get("verifier", compose.named("verifier", verifier)[0]).drafts_trees
    if not drafts_trees and depth is None and top_k is None and tokens is None:
        return None
    defaults = TreeShape()
    return TreeShape(
        depth=defaults.depth if depth is None else depth,
        top_k=defaults.top_k if top_k is None else top_k,
        total_tokens=defaults.total_tokens if tokens is None else tokens,
    )
