"""``specframe bench``: measured comparisons. ``bench acceptance``: acceptance and speed of drafters on evaluation
prompts against plain decoding (and n-gram), interleaved in one run (``specframe.bench``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click

from specframe.cli.decoding_options import decoding_options, tree_shape
from specframe.cli.target_options import target_loading

KIND = "bench.acceptance"


@click.group("bench")
def bench() -> None:
    """Benchmark drafters (see `specframe bench acceptance --help`)."""


@bench.command("acceptance")
@click.option("--checkpoint", "checkpoints", multiple=True, type=click.Path(file_okay=False),
              help="A trained drafter's checkpoint or run folder; repeat to compare drafters in the same run.")
@click.option("--drafter", "drafters", multiple=True,
              help="An untrained drafter plugin to measure (ngram), its options inline as NAME:KEY=VALUE,... "
                   "(ngram:n_max=4); repeatable.")
@click.option("--baseline", "baselines", multiple=True, type=click.Choice(["ngram"]),
              help="Add a baseline method (plain decoding is always measured).")
@click.option("--dataset", required=True,
              help="mt-bench (both turns), humaneval, gsm8k (evaluation slice), or a JSON/JSONL file of records "
                   "with 'messages'.")
@click.option("--num-prompts", type=int, default=10, show_default=True, help="The first N prompts by id (MT-Bench: N questions, two turns each).")
@click.option("--repeats", type=int, default=1, show_default=True,
              help="Interleaved repeats; with 2 or more, ratios get a 95% interval.")
@click.option("--engine", type=click.Choice(["reference", "vllm"]), default="reference", show_default=True,
              help="reference: specframe's decoding engine; vllm: export the checkpoints and serve them (and the ngram "
                   "baseline) with vLLM, greedy, every engine started once and the prompts interleaved across them.")
@click.option("--concurrency", type=int, default=1, show_default=True,
              help="--engine vllm: conversations sent to each engine at once (their turns decode in one batch); "
                   "OTPS is then each request's own, as one of that many concurrent users sees it.")
@click.option("--warmup", type=int, default=1, show_default=True,
              help="Untimed short decodes of the first prompt by every method before measuring.")
@click.option("--detail", is_flag=True,
              help="Also print per-slot and conditional acceptance and the drafter's time per round.")
@click.option("--also-verifier", "also_verifiers", multiple=True,
              help="Reference engine: measure every --checkpoint again under this verifier, NAME or "
                   "NAME:KEY=VALUE,.. (its options; values as JSON), labelled '<label>+NAME..', interleaved with the "
                   "rest: one drafter under two verifiers side by side, e.g. DSpark's block verified whole (--verifier "
                   "greedy) and through its confidence schedule (--also-verifier scheduled, --also-verifier "
                   "scheduled:skip_drafting=true). Repeatable.")
@decoding_options(bench=True)
@click.option("--output", "-o", default=None, type=click.Path(dir_okay=False),
              help="Write the results file (JSON with metrics, per-prompt figures and provenance).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of a table.")
@target_loading
def acceptance(
    checkpoints: tuple[str, ...], drafters: tuple[str, ...], baselines: tuple[str, ...], dataset: str,
    num_prompts: int, repeats: int, engine: str, concurrency: int, warmup: int, detail: bool,
    also_verifiers: tuple[str, ...], target: str | None,
    k: tuple[int, ...], verifier: str,
    tree_depth: int | None, tree_top_k: int | None, tree_tokens: int | None, max_new_tokens: int,
    temperature: float | None, top_k: int | None, top_p: float | None, seed: int, threads: int | None,
    output: str | None, as_json: bool, loading,
) -> None:
    """Acceptance length, per-position acceptance, OTPS and speedup over plain decoding.

    Every prompt turn is decoded by plain decoding and by each drafter (at each --k), one after the other (order
    rotating per repeat), so speedups are measured side by side. Under a greedy verifier each drafter's output must
    equal plain decoding's (reported as 'lossless').
    """
    import torch

    from specframe import bench as core
    from specframe.errors import UsageError

    if not checkpoints and not drafters:
        raise UsageError("give --checkpoint DIR (a trained drafter) or --drafter NAME (e.g. ngram)")
    for value in k:
        if value < 1:
            raise UsageError(f"--k must be positive, got {value}")
    if len(set(k)) != len(k):
        raise UsageError(f"--k repeats a value: {', '.join(map(str, k))}")
    if warmup < 0:
        raise UsageError(f"--warmup must be 0 or more, got {warmup}")
    if repeats < 1:
        raise UsageError(f"--repeats must be positive, got {repeats}")
    if concurrency < 1:
        raise UsageError(f"--concurrency must be positive, got {concurrency}")
    if concurrency > 1 and engine != "vllm":
        raise UsageError("--concurrency needs --engine vllm (the reference engine decodes one request at a time)")
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    if threads is not None and engine == "reference":
        torch.set_num_threads(threads)
    tree = tree_shape(verifier, tree_depth, tree_top_k, tree_tokens)
    verify = core.make_verifier(verifier, temperature=temperature, top_k=top_k, top_p=top_p)
    prompts = core.load_prompts(dataset, num_prompts)
    if target is None:
        target = core.first_recorded_target(checkpoints) or "default"

    progress = None if as_json else (lambda msg: click.echo(f"  {msg}", err=True))
    if engine == "vllm":
        if tree is not None or not core.is_greedy(verify):
            raise UsageError("--engine vllm runs greedy chain drafting only: drop --tree-* and sampling options")
        if also_verifiers:
            raise UsageError("--also-verifier runs on the reference engine: vLLM verifies with its own rule")
    if also_verifiers and not checkpoints:
        raise UsageError("--also-verifier measures trained drafters again: give --checkpoint DIR")
    others = dict(core.verifier_spec(text) for text in dict.fromkeys(also_verifiers))
    # on the vLLM engine the target loaded here only gives the config and the weights' hash for provenance
    tgt = loading.load(target)
    methods = []
    for ks in (k or (None,)):
        methods += [core.checkpoint_method(c, tgt.config, k=ks, tree=tree) for c in checkpoints]
        for name in (*drafters, *baselines):
            methods.append(core.plugin_method(name, tgt.config, k=5 if ks is None else ks, tree=tree))
    _label(methods)
    import attrs

    methods += [attrs.evolve(m, label=f"{m.label}+{name}", verifier=other)
                for name, other in others.items() for m in list(methods) if m.checkpoint is not None]
    if engine == "vllm":
        result = core.compare_vllm(target, prompts, methods, repeats=repeats, max_new_tokens=max_new_tokens,
                                   warmup=warmup, threads=threads, chat_template=loading.chat_template,
                                   progress=progress, concurrency=concurrency)
    else:
        result = core.compare(tgt.model, tgt.tokenizer, prompts, methods, verify, repeats=repeats,
                              max_new_tokens=max_new_tokens, seed=seed, progress=progress, warmup=warmup)
    summary, per_prompt, tgt_info = result.summary(), result.per_prompt(), tgt
    summary["dataset"] = dataset
    summary["verifier"] = verifier
    summary["engine"] = engine
    if output is not None:
        from specframe.results import write_results

        config = {
            "dataset": dataset, "num_prompts": num_prompts, "prompts": [p.id for p in prompts], "repeats": repeats,
            "engine": engine, "concurrency": concurrency, "warmup": warmup, "verifier": verifier,
            "verifier_options": _options(verify), "k": list(k) or None,
            "tree": None if tree is None else {"depth": tree.depth, "top_k": tree.top_k,
                                               "total_tokens": tree.total_tokens},
            "max_new_tokens": max_new_tokens, "seed": seed, "threads": threads, "checkpoints": list(checkpoints),
            "drafters": list(drafters), "baselines": list(baselines), "also_verifiers": list(others),
            # read after the run: a verifier bound to the target (API 10) may have measured options (a cost curve)
            "also_verifier_options": {name: _options(other) for name, other in others.items()},
            "token_budget_rule": "recorded tokens, else steps x batch_size x seq_len (an upper bound)",
        }
        prov = core.results_provenance(tgt_info, methods, command_line(click.get_current_context()))
        write_results(Path(output), kind=KIND, metrics=core.json_safe(summary),
                      per_prompt=core.json_safe(per_prompt), provenance=prov, config=config)
    if as_json:
        click.echo(json.dumps(core.json_safe(summary), indent=1))
    else:
        _table(summary, detail)
        if output is not None:
            click.echo(f"results written to {output}")


def command_line(ctx: click.Context) -> list[str]:
    """The command as it would be typed, rebuilt from the parsed options (so it is right whatever ran click: the
    console script, ``python -m specframe`` or a test runner); options left at their defaults are omitted."""
    words = ["specframe", *ctx.command_path.split()[1:]]
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name not in ctx.params:
            continue
        value = ctx.params[param.name]
        if value in (None, False, ()) or value == param.default:
            continue
        flag = max(param.opts, key=len)
        if param.is_flag:
            words.append(flag)
        else:
            for item in value if param.multiple else (value,):
                words += [flag, str(item)]
    return words


def _label(methods: list[Any]) -> None:
    """Distinct labels: a drafter name, with its k / tree, and an index when the same drafter appears twice."""
    for m in methods:
        m.label = f"{m.label}/tree" if m.tree is not None else f"{m.label}/k{m.k}"
    seen: dict[str, int] = {}
    for m in methods:
        seen[m.label] = seen.get(m.label, 0) + 1
        if seen[m.label] > 1:
            m.label = f"{m.label}#{seen[m.label]}"


def _options(verifier: Any) -> dict[str, Any]:
    import attrs

    return attrs.asdict(verifier.options) if attrs.has(type(verifier.options)) else {}


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def _speedup(m: dict[str, Any]) -> str:
    interval = m.get("speedup_interval")
    if interval is None:
        return "1.00"
    if interval.get("low") is None:
        return _fmt(interval["mean"]) + "x"
    return f"{_fmt(interval['mean'])}x [{_fmt(interval['low'])}, {_fmt(interval['high'])}]"


def _table(summary: dict[str, Any], detail: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (f"{summary['dataset']}: {summary['prompt_turns']} prompt turns x {summary['repeats']} repeat(s), "
             f"verifier {summary['verifier']}, engine {summary['engine']}")
    if summary.get("vllm_threads_bind"):
        title += f" (threads on CPUs {summary['vllm_threads_bind']})"
    table = Table(title=title)
    columns = ["method", "K", "AL", "tokens/s", "speedup [95%]", "R (break-even AL)", "lossless"]
    if detail:
        columns[3:3] = ["per-slot acc.", "conditional acc."]
        columns.insert(-1, "draft ms/round")
    for column in columns:
        table.add_column(column, justify="left" if column == "method" else "right", no_wrap=column == "method")
    for label, m in summary["methods"].items():
        cells = {
            "method": label,
            "K": str(m["k"]) if m.get("k") else "-",
            "AL": _fmt(m["acceptance_length"]),
            "per-slot acc.": " ".join(_fmt(x) for x in m["per_slot"]) or "-",
            "conditional acc.": " ".join(_fmt(x) for x in m["conditional"]) or "-",
            "tokens/s": _fmt(m["otps"], ".1f"),
            "speedup [95%]": _speedup(m) + (" (flagged)" if m.get("speed_flags") else ""),
            "R (break-even AL)": _fmt(m.get("round_cost_ratio")),
            "draft ms/round": _fmt(m["draft_seconds_per_round"] * 1000
                                   if m.get("draft_seconds_per_round") is not None else None, ".1f"),
            "lossless": {True: "yes", False: "NO", None: "-"}[m.get("lossless")],
        }
        table.add_row(*(cells[c] for c in columns))
    console = Console(width=max(Console().width, 150 if detail else 110))
    console.print(table)
    console.print("R: a speculative round's time over a plain step's; speedup ~ AL / R, so a drafter wins where AL > R.")
    best = best_method(summary)
    if best is not None:
        label, m = best
        if m["speedup_interval"]["mean"] > 1.0:
            console.print(f"fastest: {label}, {_speedup(m)} plain decoding's speed (AL {_fmt(m['acceptance_length'])})")
        else:
            console.print(f"no method beats plain decoding here; the closest: {label} at {_speedup(m)} (AL "
                          f"{_fmt(m['acceptance_length'])}, break-even AL {_fmt(m.get('round_cost_ratio'))})")
    for label, m in summary["methods"].items():
        for flag in m.get("speed_flags") or []:
            console.print(f"{label}: repeat {flag['repeat'] + 1} left out of the speedup after re-measuring: "
                          f"{'; '.join(flag['reasons'])}")
    if detail:
        for name, ratio in summary.get("ratios", {}).items():
            otps = ratio["otps"]
            band = "" if otps.get("low") is None else f" [{_fmt(otps['low'], '.3f')}, {_fmt(otps['high'], '.3f')}]"
            console.print(f"{name}: OTPS ratio {_fmt(otps['mean'], '.3f')}{band}, AL ratio "
                          f"{_fmt(ratio['acceptance_length'], '.3f')}")


def best_method(summary: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The drafting method with the highest speedup over plain decoding (geometric mean over repeats), among those
    that were lossless where losslessness was checked; None without one."""
    candidates = [(label, m) for label, m in summary["methods"].items()
                  if m.get("speedup_interval") and m.get("lossless") is not False
                  and isinstance(m["speedup_interval"].get("mean"), float)
                  and math.isfinite(m["speedup_interval"]["mean"])]
    return max(candidates, key=lambda item: item[1]["speedup_interval"]["mean"], default=None)
