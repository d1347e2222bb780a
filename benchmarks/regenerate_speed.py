"""Self-distillation throughput: `specframe regenerate` with the transformers engine against the vLLM engine, on the
same prompts, in one run (issue #29, item 1).

    .venv/bin/python benchmarks/regenerate_speed.py [--prompts 64 --max-new-tokens 128 --repeats 2]

Each measurement is a fresh `specframe regenerate` child process on the first ``--prompts`` prompts of the large
set's plan (``large-prompts``, a mix of ShareGPT and GSM8K), with the default target, fp32, greedy, ``--threads``
CPU threads, into a scratch folder. The engines alternate (the order flipping every repeat) so the machine's load
falls on both; each child's answer tokens per second come from its own provenance (generation time only, the
engine's start-up excluded), and the load other processes put beside it is recorded (``harness.beside_cores``).
Writes ``benchmarks/results/regenerate_cpu.json``: per run the tokens/s, answer tokens and load beside; per engine
the median; the vLLM / transformers ratio per repeat; the share of answers identical between the engines; threads
and this command.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, run_cli  # noqa: E402

ENGINES = {"transformers": ["--engine", "transformers"], "vllm": ["--engine", "vllm", "--kv-cache-gib", "2"]}


def measure(engine: str, args, scratch: Path, repeat: int) -> dict:
    out = scratch / f"{engine}-{repeat}" / "answers.jsonl.gz"
    prompts = scratch / "prompts.jsonl"
    cmd = ["regenerate", "--data", str(prompts), "--output", str(out), "--provenance", str(out.parent / "prov.json"),
           "--batch-size", str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens), "--threads",
           str(args.threads), *ENGINES[engine]]
    child = run_cli(cmd, threads=args.threads, log=scratch / f"{engine}-{repeat}.log")
    if child.exit != 0:
        raise SystemExit(f"{engine} run failed; see {scratch / f'{engine}-{repeat}.log'}")
    prov = json.loads((out.parent / "prov.json").read_text())
    run = prov["runs"][-1]
    with gzip.open(out, "rt", encoding="utf-8") as f:
        answers = {(r["source"], r["id"]): r["answer"] for r in map(json.loads, f)}
    return {"engine": engine, "repeat": repeat, "tokens_per_second": run["tokens_per_second"],
            "answer_tokens": run["answer_tokens"], "generation_seconds": run["seconds"],
            "wall_seconds": child.seconds, "beside_cores": child.beside_cores, "answers": answers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=64, help="prompts per batch, both engines")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "regenerate_cpu.json")
    args = ap.parse_args()
    from specframe.data.large import large_prompt_records
    from specframe.results import provenance, write_results
    from specframe.targets import load_target

    plan = large_prompt_records()
    # ShareGPT and GSM8K alike: alternate between the two sources
    by = {s: [r for r in plan if r["source"] == s] for s in ("sharegpt", "gsm8k")}
    chosen = [r for pair in zip(by["sharegpt"], by["gsm8k"]) for r in pair][: args.prompts]
    runs = []
    with tempfile.TemporaryDirectory(prefix="sf-regen-") as tmp:
        scratch = Path(tmp)
        (scratch / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chosen))
        for repeat in range(args.repeats):
            order = list(ENGINES) if repeat % 2 == 0 else list(reversed(ENGINES))
            for engine in order:
                runs.append(measure(engine, args, scratch, repeat))
                print(f"repeat {repeat} {engine}: {runs[-1]['tokens_per_second']:.1f} answer tokens/s "
                      f"(beside {runs[-1]['beside_cores']})", flush=True)
    first = {r["engine"]: r["answers"] for r in runs if r["repeat"] == 0}
    same = sum(first["vllm"][k] == first["transformers"].get(k) for k in first["vllm"]) / len(first["vllm"])
    median = {e: statistics.median(r["tokens_per_second"] for r in runs if r["engine"] == e) for e in ENGINES}
    ratios = [next(r for r in runs if r["engine"] == "vllm" and r["repeat"] == i)["tokens_per_second"]
              / next(r for r in runs if r["engine"] == "transformers" and r["repeat"] == i)["tokens_per_second"]
              for i in range(args.repeats)]
    target = load_target("default", weights=False)
    metrics = {"median_tokens_per_second": median, "vllm_over_transformers": ratios, "identical_answers": same,
               "prompts": len(chosen), "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
               "threads": args.threads}
    rows = [{k: v for k, v in r.items() if k != "answers"} for r in runs]
    write_results(args.out, kind="bench.regenerate", metrics=metrics, per_prompt=rows,
                  provenance=provenance(target={"id": target.id, "weights_hash": target.weights_hash},
                                        command=["python", *sys.argv]),
                  config=vars(args) | {"out": str(args.out)})
    print(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
