"""Peak training memory of P-EAGLE against context length: dense reference vs the efficient path.

Each point is one real training step (``specframe.memory_probe``: the real engine, drafter, mask builder,
partitioner, COD and AdamW) in a fresh child process; peak = that child's resident-set high-water mark during the
step. Drafter: SmolLM2-sized, 4 layers (H 576, 9 heads, 3 kv heads, intermediate 1536, target vocab 49152, draft
vocab 32000), K = 8. Features are synthetic (random aux / final hidden states of the right shape, as a feature cache
would hand them over; the target trunk is not in memory, its lm_head is). Paths:

- ``dense``: the dense mask builder, no checkpointing, no partitioning (the reference);
- ``efficient``: chunked mask builder + activation checkpointing + the chunked KL loss;
- ``efficient+peagle``: the same with P-EAGLE's sequence partitioner, ``--partitions`` segments (default 4). Each
  segment re-reads the depth-0 context before it, so more segments cost attention compute superlinearly; a fixed,
  small S is what the estimator's advice (``partitions_needed``) gives at long context.

A point whose estimate (``specframe.memory``) exceeds --budget is not run (the estimate is reported instead), so the
run never takes the machine down. The growth exponent is fitted on (peak - fixed part) against L, log-log. Every
measured point is printed next to the estimator's prediction; the estimator covers lengths not measured.

    .venv/bin/python benchmarks/memory_context.py --json benchmarks/results/memory_context.json
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(vocab=49152, hidden=576, heads=9, kv_heads=3, intermediate=1536, target_layers=4)
DRAFTER = {"layers": 4, "draft_vocab_size": 32000}
PATHS = {
    "dense": dict(mask_builder="dense", drafter_options=dict(DRAFTER)),
    "efficient": dict(mask_builder="chunked", drafter_options={**DRAFTER, "activation_checkpointing": True}),
    "efficient+peagle": dict(mask_builder="chunked", partitioner="peagle",
                             drafter_options={**DRAFTER, "activation_checkpointing": True}),
}


def _target_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=SHAPE["vocab"], hidden_size=SHAPE["hidden"], intermediate_size=SHAPE["intermediate"],
                       num_hidden_layers=SHAPE["target_layers"], num_attention_heads=SHAPE["heads"],
                       num_key_value_heads=SHAPE["kv_heads"], tie_word_embeddings=False)


def _spec(path: str, seq_len: int, partitions: int, threads: int = 1):
    from specframe.memory_probe import ProbeSpec

    kw = dict(PATHS[path])
    if kw.get("partitioner") == "peagle":
        kw["partitions"] = partitions
    return ProbeSpec(seq_len=seq_len, depth=8, threads=threads, **SHAPE, **kw)


def _estimate(spec):
    from specframe import memory as mem

    return mem.estimate(mem.MemoryConfig(
        drafter="peagle", target_config=_target_config(), seq_len=spec.seq_len, depth=spec.depth,
        mask_builder=spec.mask_builder, partitioner=spec.partitioner, partitions=spec.partitions,
        drafter_options=spec.drafter_options, features="synthetic",
    ))


def exponent(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of log(y) on log(L)."""
    pts = [(math.log(x), math.log(y)) for x, y in points if y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def main() -> None:
    from specframe import memory as mem
    from specframe.memory_probe import measure

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--partitions", type=int, default=4, help="segments of the efficient+peagle path")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each measured step")
    ap.add_argument("--memory-budget", dest="guard", default=None,
                    help="run each step under the engine's guard with this budget (default: no guard)")
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--estimate-lengths", nargs="+", type=int, default=[8192, 16384, 32768, 65536])
    ap.add_argument("--nice", type=int, default=10)
    ap.add_argument("--json", type=Path, help="write a specframe results file here")
    ap.add_argument("--rescore", action="store_true",
                    help="measure nothing: re-estimate the measured rows of --json with the current estimator")
    ap.add_argument("--merge", nargs="*", type=Path, help="with --rescore: add the rows of these results files")
    args = ap.parse_args()
    budget = mem.parse_size(args.budget)
    rows = []
    if args.rescore:
        from specframe.results import read_results

        sources = [read_results(f) for f in [args.json, *(args.merge or [])]]
        # rows measured by other invocations keep the commands that measured them
        args.measured_by = [c for d in sources for c in d["config"].get("measured_by", [d["provenance"]["command"]])]
        # a configuration measured again replaces its older row: the later file on the command line wins
        latest = {}
        for d in sources:
            commands = d["config"].get("measured_by", [d["provenance"]["command"]])
            for r in d["per_prompt"]:
                if len(commands) == 1:  # rows of one invocation name it: which rows were measured side by side
                    r.setdefault("measured_by", commands[0])
                latest[(r["path"], r["seq_len"], r.get("partitions"), r.get("torch_threads"))] = r
        rows = list(latest.values())
        rows.sort(key=lambda r: (list(PATHS).index(r["path"]), r["seq_len"]))
        for row in rows:
            est = _estimate(_spec(row["path"], row["seq_len"], row.get("partitions", args.partitions)))
            row.update(estimate_bytes=est.peak_bytes, fixed_bytes=est.fixed_bytes)
            if "peak_bytes" in row:
                row["estimate_error"] = est.peak_bytes / row["peak_bytes"] - 1
        print(report(args, rows, budget, final=True))
        return
    for path in args.paths:
        for seq_len in args.lengths:
            spec = _spec(path, seq_len, args.partitions, args.threads)
            if args.guard:
                spec.memory_budget, spec.skip_check = args.guard, True
            est = _estimate(spec)
            row = {"path": path, "seq_len": seq_len, "partitions": spec.partitions, "estimate_bytes": est.peak_bytes,
                   "fixed_bytes": est.fixed_bytes, "torch_threads": args.threads}
            if est.peak_bytes > budget:
                row["skipped"] = f"estimated {mem.format_size(est.peak_bytes)} > budget {args.budget}"
            else:
                t0 = time.time()
                got = measure(spec, nice=args.nice)
                row.update(peak_bytes=got["peak_bytes"], rss_before_step_bytes=got["rss_before_step_bytes"],
                           elements=got["elements"], step_seconds=got["step_seconds"][0],
                           tokens_per_second=got["tokens"] / got["step_seconds"][0],
                           estimate_error=est.peak_bytes / got["peak_bytes"] - 1, wall_seconds=time.time() - t0)
            rows.append(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            if args.json:  # after every point, so an interrupted run keeps what it measured
                report(args, rows, budget, final=False)
    print(report(args, rows, budget, final=True))


def report(args, rows: list[dict], budget: int, final: bool) -> dict:
    from specframe import memory as mem
    from specframe.results import provenance, write_results

    metrics: dict = {"budget_bytes": budget, "paths": {}}
    for path in args.paths:
        done = [r for r in rows if r["path"] == path and "peak_bytes" in r]
        fit = exponent([(r["seq_len"], r["peak_bytes"] - r["fixed_bytes"]) for r in done])
        longest_measured = max((r["seq_len"] for r in done), default=None)
        est_rows, longest = [], None
        for seq_len in args.estimate_lengths if final else []:
            e = _estimate(_spec(path, seq_len, args.partitions))
            est_rows.append({"seq_len": seq_len, "estimate_bytes": e.peak_bytes, "fits": e.peak_bytes <= budget})
        cfg = _spec(path, max(args.estimate_lengths), args.partitions)
        longest = None if not final else mem.largest_seq_len(mem.MemoryConfig(
            drafter="peagle", target_config=_target_config(), seq_len=cfg.seq_len, depth=8,
            mask_builder=cfg.mask_builder, partitioner=cfg.partitioner, partitions=cfg.partitions,
            drafter_options=cfg.drafter_options, features="synthetic"), budget, multiple=256)
        metrics["paths"][path] = {
            "growth_exponent_peak_minus_fixed": fit,
            # the local exponent between the two longest measured lengths, where constant step terms matter least
            "growth_exponent_longest_pair": exponent(
                sorted((r["seq_len"], r["peak_bytes"] - r["fixed_bytes"]) for r in done)[-2:]),
            "longest_measured": longest_measured,
            "max_abs_estimate_error": max((abs(r["estimate_error"]) for r in done), default=None),
            "estimated_longest_seq_len_in_budget": longest,
            "estimates": est_rows,
            "tokens_per_second": {r["seq_len"]: r["tokens_per_second"] for r in done},
        }
    metrics["complete"] = final
    if args.json:
        write_results(args.json, kind="memory_context", metrics=metrics, per_prompt=rows,
                      provenance=provenance(target={"id": "random SmolLM2-shaped (synthetic features)",
                                                    "weights_hash": "none (random init, seed 0)"}),
                      config={"measured_by": getattr(args, "measured_by", None) or [shlex.join(sys.argv)],
                              "shape": SHAPE, "drafter": DRAFTER, "depth": 8, "partitions": args.partitions,
                              "features": "synthetic", "torch_threads": args.threads})

    return metrics


if __name__ == "__main__":
    main()
