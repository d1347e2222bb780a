"""Training throughput, old code against new, every drafter, in one interleaved run (issue #17, item 1).

    .venv/bin/python benchmarks/throughput.py --old /tmp/sf-old [--steps 2 --repeats 2]

``--old`` is a checkout of the commit to compare against (``git worktree add /tmp/sf-old <commit>``); each
measurement is a fresh process with ``PYTHONPATH`` set to the old checkout or to this one, one torch thread, the cpu
preset's training settings (SmolLM2 target, seq-len 512, depth 7, batch 2, its drafter architectures and draft
vocabulary, no packing, seed 0) on one shared feature cache, so both sides train on the same batches. The mask builder
is left to the engine's default, which for the old code is chunked, the committed run's builder. Runs alternate
old / new (the order flipping every repeat) so the machine's load falls on both; a run's first step is a warm-up and
is not timed. Writes ``benchmarks/results/throughput_cpu.json`` after every old / new pair (a stopped run keeps its
complete pairs): tokens/s per run, per drafter the median and the range of the paired new / old ratios, the commits,
threads and this command. ``--from-log LOG`` rebuilds the file from the per-run lines a stopped run printed.

``--preset NAME`` takes another preset's training settings (seq-len, depth, batch, lr, packing, drafter options; the
default is ``cpu``); ``--drafters`` may name a plugin package's drafter (``dspark``, ``dflash``): each side runs its own
checkout's ``packages/specframe-*`` ahead of the installed ones, and the child reports the drafter module it imported,
so a side that ran the other's plugin is refused. With ``--cache`` an existing feature cache (a job's) is used as it
is: no ``prepare``.

``--as-cli`` hands the engine the run resolved as ``specframe train`` resolves it before the engine starts
(``run_config.resolve_run``, the mask builder's name written in) instead of the bare ``TrainConfig`` a Python caller
passes: the path the benchmark jobs train on, which a checkout without ``resolve_run`` cannot take (refused).

``--teacher-top-k K`` gives the new side a second cache of the same conversations prepared with ``--teacher-top-k K``
(the compact teacher): with ``--old`` a checkout of the same commit, the pair measures what the compact teacher
saves against the head-computed one, every other setting equal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRAFTERS = ("peagle", "eagle3", "pard", "parallelspec")


def child(spec: dict) -> None:
    """One measurement in this process (the specframe on PYTHONPATH): warm-up step, then ``steps`` timed steps."""
    import torch

    torch.set_num_threads(spec["threads"])
    import specframe
    from specframe.engine.config import TrainConfig
    from specframe.engine.loop import Trainer

    out = tempfile.mkdtemp(prefix="sf-throughput-")
    cfg = TrainConfig(drafter=spec["drafter"], output=out + "/run", target=spec["target"], data=None,
                      cache=spec["cache"], seq_len=spec["seq_len"], depth=spec["depth"], max_steps=spec["steps"] + 1,
                      batch_size=spec["batch_size"], lr=spec["lr"], val_examples=1, max_examples=spec["examples"],
                      pack=spec.get("pack", False), seed=0, device="cpu", drafter_options=spec["options"])
    if spec.get("as_cli"):
        from specframe.engine import run_config

        cfg = run_config.resolve_run(cfg)  # an old checkout without it fails here, named in measure's error
    trainer = Trainer(cfg, log=lambda *a: None)
    try:
        trainer.train_step()  # warm-up: first-step plugin checks, allocator and kernel caches
        tokens, seconds = 0, 0.0
        for _ in range(spec["steps"]):
            started = time.perf_counter()
            entry = trainer.train_step()
            seconds += time.perf_counter() - started
            tokens += int(entry["tokens"])
    finally:
        trainer.close()
    print(json.dumps({"tokens": tokens, "seconds": seconds, "threads": torch.get_num_threads(),
                      "specframe": specframe.__file__,
                      "drafter_module": sys.modules[type(trainer.drafter).__module__].__file__,
                      "builder": trainer.resolved.mask_builder,
                      # the new engine sizes attention when no builder is named (specframe.engine.attention)
                      "attention": type(getattr(trainer, "attention_builder", trainer.builder)).__name__}))


def commit(path: Path) -> str:
    return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def measure(root: Path, spec: dict) -> dict:
    # the old checkout's plugins must shadow this checkout's editable install; before 2026-12-06 the folder was named
    # plugins/ (mapped to specframe_plugins by pyproject's package-dir), so an old checkout gets a link of that name
    link = root / "specframe_plugins"
    if root != ROOT and not link.exists():
        link.symlink_to("plugins")
    # a plugin package's drafter (DSpark, DFlash) is imported from the side's own checkout, ahead of the editable
    # install of this one's
    path = [str(root), *(str(d) for d in sorted((root / "packages").glob("specframe-*")) if d.is_dir())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": str(spec["threads"])}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)], env=env,
                          capture_output=True, text=True, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise RuntimeError(f"measurement failed under {root}: {proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for module in ("specframe", "drafter_module"):
        if not result[module].startswith(str(root)):
            raise RuntimeError(f"the run under {root} imported {result[module]}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--old", type=Path, help="checkout of the commit to compare against")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "sf-throughput-cache")
    parser.add_argument("--preset", default="cpu", help="the preset whose training settings both sides use")
    parser.add_argument("--as-cli", action="store_true",
                        help="train the run as specframe train resolves it (not a Python caller's TrainConfig)")
    parser.add_argument("--examples", type=int, default=24, help="conversations in the shared cache")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run (after one warm-up step)")
    parser.add_argument("--repeats", type=int, default=2, help="old / new pairs per drafter")
    parser.add_argument("--drafters", default=",".join(DRAFTERS))
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "throughput_cpu.json")
    parser.add_argument("--teacher-top-k", type=int, default=0,
                        help="the new side trains from a cache with this compact teacher (0: the shared cache)")
    parser.add_argument("--from-log", type=Path, default=None,
                        help="summarise the per-run lines an earlier (stopped) run printed instead of measuring")
    args = parser.parse_args()
    if args.child is not None:
        child(json.loads(args.child))
        return
    if args.old is None:
        parser.error("--old is required")
    sys.path.insert(0, str(ROOT))
    from benchmarks.presets import PRESETS

    preset = PRESETS[args.preset].with_installed()  # a plugin package's drafter at the preset's settings for it
    threads = 1
    roots = {"old": args.old.resolve(), "new": ROOT}
    runs: dict[str, dict[str, list]] = {}
    if args.from_log is not None:  # a run stopped early: its printed measurements, complete pairs only
        lines = [line for line in args.from_log.read_text().splitlines() if " tokens/s (" in line]
        for line in lines:
            drafter, side, rate = line.split()[0], line.split()[1].rstrip(":"), float(line.split()[2])
            runs.setdefault(drafter, {"old": [], "new": []})[side].append(
                {"tokens": rate, "seconds": 1.0, "attention": line.split("(")[-1].rstrip(")")})
        write(args, roots, runs, threads, log_lines=lines)
        return
    caches = {"old": args.cache, "new": args.cache}
    if args.teacher_top_k:
        caches["new"] = args.cache.with_name(f"{args.cache.name}-top{args.teacher_top_k}")
    for side, cache in caches.items():
        if (cache / "manifest.json").exists():
            continue
        extra = ["--teacher-top-k", str(args.teacher_top_k)] if cache != args.cache else []
        subprocess.run([str(Path(sys.executable).with_name("specframe")), "prepare", "--target", preset.target,
                        "--data", preset.data, "--limit", str(args.examples), "--draft-vocab", str(preset.draft_vocab),
                        "--max-length", str(max(2048, preset.seq_len)), "--threads", str(threads), "--output",
                        str(cache), *extra], check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    for repeat in range(args.repeats):
        for drafter in args.drafters.split(","):
            spec = {"drafter": drafter, "target": preset.target, "seq_len": preset.seq_len,
                    "depth": preset.depth, "batch_size": preset.batch_size, "lr": preset.lr,
                    "examples": args.examples, "options": preset.train_options(drafter), "steps": args.steps,
                    "threads": threads, "pack": preset.pack, "as_cli": args.as_cli}
            order = ("old", "new") if repeat % 2 == 0 else ("new", "old")
            for side in order:
                r = measure(roots[side], {**spec, "cache": str(caches[side])})
                runs.setdefault(drafter, {"old": [], "new": []})[side].append(r)
                print(f"{drafter} {side}: {r['tokens'] / r['seconds']:.1f} tokens/s ({r['attention']})", flush=True)
            write(args, roots, runs, threads)  # after every pair: a stopped run keeps what it measured


def write(args: argparse.Namespace, roots: dict[str, Path], runs: dict[str, dict[str, list]], threads: int,
          log_lines: list[str] | None = None) -> None:
    result = {"command": " ".join([Path(sys.executable).name, *_portable(sys.argv)]), "threads": threads,
              "commits": {side: commit(root) for side, root in roots.items()},
              # the last commit that changed what training runs (later ones touched other files)
              "new_training_code": subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%H", "--",
                                                   "specframe", "specframe_plugins", "packages"],
                                                  capture_output=True,
                                                  text=True).stdout.strip(),
              "worktree_dirty": bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--",
                                                     "specframe", "specframe_plugins", "packages"],
                                                    capture_output=True,
                                                    text=True).stdout.strip()),
              "teacher_top_k": {"old": 0, "new": args.teacher_top_k},
              "preset": args.preset, "steps_per_run": args.steps, "repeats_asked": args.repeats,
              "examples": args.examples, "as_cli": args.as_cli,
              "note": "machine shared with other work while measuring (2 cores, other processes running); runs "
                      "interleaved old/new so load falls on both", "drafters": {}}
    for drafter, sides in runs.items():
        pairs = min(len(sides["old"]), len(sides["new"]))
        if not pairs:
            continue
        rate = {side: [r["tokens"] / r["seconds"] for r in sides[side][:pairs]] for side in sides}
        ratios = [n / o for n, o in zip(rate["new"], rate["old"], strict=True)]
        result["drafters"][drafter] = {
            "old_tokens_per_second": rate["old"], "new_tokens_per_second": rate["new"],
            "attention": {side: sides[side][0]["attention"] for side in sides},
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "pairs": pairs,
        }
    if log_lines is not None:
        result["from_log"] = log_lines
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({d: round(v["ratio_median"], 2) for d, v in result["drafters"].items()}))


def _portable(argv: list[str]) -> list[str]:
    """The command line with paths outside the repository named by their role (results stay portable: the old
    checkout is recorded by its commit elsewhere in the file)."""
    root = Path(__file__).resolve().parents[1]
    out = []
    for word in argv:
        path = Path(word)
        if path.is_absolute():
            try:
                word = str(path.resolve().relative_to(root))
            except ValueError:
                word = f"<{path.name}>"
        out.append(word)
    return out


if __name__ == "__main__":
    main()
