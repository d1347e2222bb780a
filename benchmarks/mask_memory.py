"""Peak memory and time of one attention call (forward + backward) per mask builder, on CPU.

Each measurement runs in a fresh child process: peak memory is the rise of the child's resident-set high-water mark
(VmHWM) over its level just before the builder is created, so it counts the mask (or the cached grid mask), the
scores and every backward temporary. Times are medians over repeats of build and of forward + backward.

    .venv/bin/python benchmarks/mask_memory.py                      # the default grid, a table on stdout
    .venv/bin/python benchmarks/mask_memory.py --lengths 256 512 --json results.json

A configuration whose estimated dense score memory exceeds --budget-gib is skipped with the estimate, so the run
never takes the machine down.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

HEADS, HEAD_DIM = 2, 64


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    # Writing 5 to clear_refs resets the high-water mark (Linux >= 4.0), so the peak is this call's own.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _elements(layout: str, seq_len: int, depth: int):
    import torch

    from specframe.drafting.elements import cod_sample, full_grid

    if layout == "grid":
        return full_grid(seq_len, depth)
    return cod_sample(torch.ones(seq_len, dtype=torch.bool), depth, generator=torch.Generator().manual_seed(0))


def child(builder_name: str, layout: str, seq_len: int, depth: int, repeats: int, chunk_size: int) -> dict:
    import torch

    from specframe import compose

    torch.set_num_threads(1)
    elements = _elements(layout, seq_len, depth)
    n = len(elements)
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, HEADS, n, HEAD_DIM, generator=g) for _ in range(4))
    options = {"chunked": {"chunk_size": chunk_size}, "precomputed": {"max_len": seq_len}}.get(builder_name, {})
    # Warm up on a tiny input first so one-off allocations (kernels, thread pools) are not charged to the builder.
    tiny = _elements("grid", 8, depth)
    t = torch.randn(1, HEADS, len(tiny), HEAD_DIM, requires_grad=True)
    compose.component("mask builder", builder_name, {}).build(tiny, tiny)(t, t, t).sum().backward()
    _reset_hwm()
    base = _hwm_bytes()
    builder = compose.component("mask builder", builder_name, options)
    build_s, call_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        attention = builder.build(elements, elements)
        t1 = time.perf_counter()
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        attention(qq, kk, vv).backward(grad)
        t2 = time.perf_counter()
        build_s.append(t1 - t0)
        call_s.append(t2 - t1)
        del attention, qq, kk, vv
    return {
        "builder": builder_name,
        "layout": layout,
        "seq_len": seq_len,
        "depth": depth,
        "elements": n,
        "peak_mib": round((_hwm_bytes() - base) / 2**20, 1),
        "build_s": round(statistics.median(build_s), 4),
        "fwd_bwd_s": round(statistics.median(call_s), 4),
    }


def _estimate_gib(builder: str, n: int, chunk_size: int) -> float:
    if builder in ("dense", "precomputed"):
        # CPU SDPA's fused kernel does not keep the scores, but the bool mask and its float copy cost about 5-6 bytes
        # per entry in this script's measurements; precomputed adds its cached grid mask (about one byte per entry).
        return n * n * 8 / 2**30
    # About four chunk-score-sized temporaries (scores, probabilities, their grads) at once.
    return chunk_size * n * 4 * 4 * HEADS / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builders", nargs="+", default=["dense", "precomputed", "chunked"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 512, 1024, 2048])
    parser.add_argument("--layouts", nargs="+", default=["grid", "cod"], choices=["grid", "cod"])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--budget-gib", type=float, default=6.0)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, layout, seq_len = args.child
        print(json.dumps(child(name, layout, int(seq_len), args.depth, args.repeats, args.chunk_size)))
        return
    rows = []
    print(f"{'builder':<12}{'layout':<7}{'L':>6}{'elements':>10}{'peak MiB':>11}{'build s':>10}{'fwd+bwd s':>11}")
    for layout in args.layouts:
        for seq_len in args.lengths:
            n = len(_elements(layout, seq_len, args.depth))
            for name in args.builders:
                need = _estimate_gib(name, n, args.chunk_size)
                if need > args.budget_gib:
                    row = {"builder": name, "layout": layout, "seq_len": seq_len, "elements": n,
                           "skipped": f"needs about {need:.1f} GiB > budget {args.budget_gib} GiB"}
                    print(f"{name:<12}{layout:<7}{seq_len:>6}{n:>10}   skipped: {row['skipped']}")
                    rows.append(row)
                    continue
                cmd = [sys.executable, __file__, "--child", name, layout, str(seq_len), "--depth", str(args.depth),
                       "--repeats", str(args.repeats), "--chunk-size", str(args.chunk_size)]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                row = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"{name:<12}{layout:<7}{seq_len:>6}{n:>10}{row['peak_mib']:>11}{row['build_s']:>10}"
                      f"{row['fwd_bwd_s']:>11}")
    if args.json:
        result = {
            "command": " ".join(sys.argv),
            "machine": f"{platform.processor() or platform.machine()}, {platform.platform()}, 1 torch thread",
            # The machine is shared: the load average says how much the times can be trusted.
            "load_average_at_end": os.getloadavg(),
            "heads": HEADS, "head_dim": HEAD_DIM, "depth": args.depth, "chunk_size": args.chunk_size,
            "results": rows,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    main()
