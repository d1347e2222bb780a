"""What P-EAGLE's default head costs a served round (deviations row 6): the family's drafters draft over the target's
whole vocabulary by default since P-EAGLE's ablations (the references' choice), where the presets keep 8,192 rows.
On a small target the head is a large share of the drafter (SmolLM2-135M: 49,152 x 576, about 28M multiply-adds a
drafted token, against about 14M for each of P-EAGLE's four decoder layers), and vLLM runs it on every drafted
token, so the round cost R (a speculative round's time over a plain step's; speedup ~ AL / R) may move.

    .venv/bin/python benchmarks/vocab_head_cost.py [--steps 20 --prompts 8 --k 2 --k 3 --repeats 3]

Two P-EAGLE drafters at their defaults (four layers), the same seed, data and steps, that differ only in
``draft_vocab_size`` (8,192; null: the whole vocabulary), trained briefly: the question is the round's cost, not
acceptance. Then one ``specframe bench acceptance --engine vllm`` run serves plain decoding and both drafters at each
K, interleaved, on MT-Bench questions spread over its eight categories (both turns of each), with ``--detail``. Time
it on a quiet machine: the file records the load beside it, the machine and the plain step (issue 57). Writes
``benchmarks/results/vocab_head_cpu.json`` (the bench results file, with the two trainings' commands and this
script's settings in ``config.vocab_head``) and prints each drafter's R and its tokens/s against the 8,192 head's.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, run_cli

#: the two heads: the presets' shared size and the default (None: the target's whole vocabulary)
HEADS = {"v8192": 8192, "whole": None}


def recipe(path: Path, vocab: int | None, steps: int) -> Path:
    """A run file: P-EAGLE at its defaults but ``draft_vocab_size`` and a short schedule (the demo recipe's)."""
    lines = ['drafter = "peagle"', 'target = "default"', 'data = "default"', "lr = 1e-3", "depth = 4",
             "seq_len = 256", "batch_size = 2", f"max_steps = {steps}", "seed = 0", "", "[drafter_options]"]
    if vocab is not None:  # absent: the option's default, the whole vocabulary
        lines.append(f"draft_vocab_size = {vocab}")
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8, help="MT-Bench questions, spread over its categories")
    parser.add_argument("--k", type=int, action="append", help="draft tokens per round (repeatable; default 2, 3)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "vocab_head_cpu.json")
    parser.add_argument("--scratch", type=Path, default=None, help="folder for the drafters (default: a temporary one)")
    args = parser.parse_args()
    ks = args.k or [2, 3]

    from specframe import bench
    from specframe.engine.checkpoint import step_name
    from specframe.home import specframe_home
    from specframe.results import portable

    with tempfile.TemporaryDirectory(prefix="vocab-head-") as tmp:
        scratch = args.scratch or Path(tmp)
        scratch.mkdir(parents=True, exist_ok=True)
        log = scratch / "log.txt"
        runs, commands = {}, {}
        for name, vocab in HEADS.items():
            out = scratch / name
            train = ["train", "--config", str(recipe(scratch / f"{name}.toml", vocab, args.steps)),
                     "--output", str(out), "--device", "cpu"]
            # recorded with the scratch folder left out: the run file's text is what decides the drafter
            commands[name] = {"command": shlex.join(["specframe", "train", "--config", f"{name}.toml", "--output",
                                                     name, "--device", "cpu"]),
                              "run_file": (scratch / f"{name}.toml").read_text()}
            if not (out / step_name(args.steps)).is_dir():  # a finished run is reused; a part of one is not
                shutil.rmtree(out, ignore_errors=True)
                done = run_cli(train, threads=args.threads, log=log)
                if done.exit != 0:
                    sys.exit(f"training the {name} drafter failed (exit {done.exit}); see {log}")
            runs[name] = out
        # both turns of one question per category: speed over the set's kinds of text, not one kind
        prompts = bench.spread_over_categories(bench.load_prompts("mt-bench"), args.prompts)
        subset = scratch / "mt-bench-spread.jsonl"
        subset.write_text("".join(json.dumps({"id": str(p.id), "messages": [
            {"role": "user", "content": turn} for turn in p.turns]}) + "\n" for p in prompts))
        raw = scratch / "bench.json"
        measure = ["bench", "acceptance", "--engine", "vllm", "--dataset", str(subset), "--num-prompts",
                   str(len(prompts)), "--repeats", str(args.repeats), "--max-new-tokens", str(args.max_new_tokens),
                   "--threads", str(args.threads), "--detail", "--output", str(raw),
                   *[a for name in HEADS for a in ("--checkpoint", str(runs[name]))],
                   *[a for k in ks for a in ("--k", str(k))]]
        done = run_cli(measure, threads=args.threads, log=log)
        if done.exit != 0:
            sys.exit(f"the vLLM measurement failed (exit {done.exit}); see {log}")
        document = json.loads(raw.read_text())
        document.setdefault("config", {})["vocab_head"] = {
            "heads": HEADS, "steps": args.steps, "trainings": commands, "prompts": [str(p.id) for p in prompts],
            "categories": [p.category for p in prompts], "command": shlex.join([
                "python", "benchmarks/vocab_head_cost.py", *sys.argv[1:]]),
            "beside_cores": done.beside_cores,
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = args.output.with_suffix(".tmp")
        # the scratch folder as $SPECFRAME_HOME/... (or relative to the checkout): no machine's paths committed
        document = portable(document, ROOT, home=specframe_home())
        tmp_out.write_text(json.dumps(document, indent=1) + "\n")
        tmp_out.replace(args.output)
    print("\n".join(summary(document)))
    print(f"written {args.output}")


def head_of(method: dict) -> str | None:
    """Which of ``HEADS`` a results file's method served (its checkpoint lies in the head's folder); None: plain."""
    folder = Path(str(method.get("checkpoint") or "")).parent.name
    return folder if folder in HEADS else None


def summary(document: dict) -> list[str]:
    """A line per method: which head (by its checkpoint's folder), AL, tokens/s, R and the speedup over plain with
    its interval over prompt turns and repeats."""
    nan = float("nan")
    lines = []
    for label, m in document["metrics"]["methods"].items():
        head = head_of(m) or "plain"
        speedup = m.get("speedup_interval_prompts") or {}
        lines.append(f"{head:6} {label}: K {m.get('k') or '-'}, AL {m['acceptance_length']:.3f}, tokens/s "
                     f"{m['otps']:.1f}, R {m.get('round_cost_ratio') or nan:.3f}, speedup "
                     f"{speedup.get('estimate') or 1.0:.3f} [{speedup.get('low') or nan:.3f}, "
                     f"{speedup.get('high') or nan:.3f}], lossless {m.get('lossless')}")
    return lines


if __name__ == "__main__":
    main()
