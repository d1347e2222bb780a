"""Training step time and peak memory in bf16 against fp32, every drafter, side by side in one run.

Each measurement is a fresh child process (``specframe.memory_probe``) running real engine steps of one drafter on
SmolLM2-shaped synthetic features (what a feature cache hands the engine) with the default CPU mask builder; the
first step is a warm-up and the rest are timed. fp32 and bf16 alternate within every repeat, and the drafters rotate,
so a machine that gets busier mid-run moves both sides of a ratio alike. The ratio reported per drafter is the
median over repeats of (fp32 step seconds / bf16 step seconds), with the repeats' range.

    python benchmarks/precision.py --seq-len 512 --steps 3 --repeats 3 --threads 2 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DRAFTERS = ("peagle", "eagle3", "pard", "parallelspec")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafters", nargs="+", default=list(DRAFTERS))
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--depth", type=int, default=None, help="training depth (default: each drafter's own k_train)")
    ap.add_argument("--steps", type=int, default=3, help="engine steps per measurement (the first is a warm-up)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (one warm-up, then timed steps)")

    from specframe.memory_probe import ProbeSpec, measure
    from specframe.results import git_commit, machine

    rows: dict[str, dict[str, list]] = {d: {"fp32": [], "bf16": [], "peak_fp32": [], "peak_bf16": []}
                                        for d in args.drafters}
    for r in range(args.repeats):
        order = args.drafters[r % len(args.drafters):] + args.drafters[: r % len(args.drafters)]
        for drafter in order:
            for dtype in (("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32")):
                spec = ProbeSpec(seq_len=args.seq_len, depth=args.depth, drafter=drafter, steps=args.steps,
                                 threads=args.threads, device=args.device, dtype=dtype,
                                 mask_builder="chunked" if args.device == "cpu" else "flex")
                out = measure(spec, timeout=3600)
                timed = out["step_seconds"][1:]
                rows[drafter][dtype].append(statistics.median(timed))
                rows[drafter][f"peak_{dtype}"].append(out["peak_bytes"])
                print(f"repeat {r + 1} {drafter:13s} {dtype}: {statistics.median(timed):.2f} s/step, "
                      f"peak {out['peak_bytes'] / 2**20:.0f} MiB", flush=True)
    metrics = {}
    for drafter, row in rows.items():
        ratios = [a / b for a, b in zip(row["fp32"], row["bf16"], strict=True)]
        metrics[drafter] = {
            "fp32_step_seconds": statistics.median(row["fp32"]), "bf16_step_seconds": statistics.median(row["bf16"]),
            "speedup_bf16_over_fp32": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)],
            "peak_fp32_bytes": max(row["peak_fp32"]), "peak_bf16_bytes": max(row["peak_bf16"]),
            "repeats": {"fp32": row["fp32"], "bf16": row["bf16"]},
        }
        print(f"{drafter:13s} fp32 {metrics[drafter]['fp32_step_seconds']:.2f} s  bf16 "
              f"{metrics[drafter]['bf16_step_seconds']:.2f} s  fp32/bf16 {metrics[drafter]['speedup_bf16_over_fp32']:.2f}x "
              f"[{min(ratios):.2f}, {max(ratios):.2f}]")
    if args.json:
        document = {
            "kind": "precision", "metrics": metrics,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "provenance": {"command": ["python", "benchmarks/precision.py", *(argv if argv is not None else sys.argv[1:])],
                           "git_commit": git_commit(ROOT), "machine": machine(),
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "features": "synthetic (SmolLM2 shape), memory_probe child per measurement"},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
