"""The target's features from transformers against vLLM (``specframe prepare --engine``), on the same conversations,
in one run (issue #33): sequences/s of both engines, and how far apart their states are per dtype, which is what
``specframe.feature_gate.BOUNDS`` must allow and what a wrong layer must not pass.

    .venv/bin/python benchmarks/feature_engines.py [--conversations 32 --max-length 1024 --repeats 2 --threads 2]

Each measurement is a fresh ``specframe prepare --json`` child process on the first ``--conversations`` of the
committed default set with the default target (SmolLM2-135M-Instruct), into a scratch cache stored in float32 (so
the comparison sees the engines, not the storage rounding), per dtype (fp32, bf16). Engines alternate, the order
flipping every repeat, so the machine's load falls on both; a child's sequences/s come from its own report (the
capture loop only: loading the target and starting vLLM are excluded and recorded as wall time), the load beside it
from ``harness.beside_cores``. Then, per dtype, the vLLM cache is compared with the transformers cache of the same
repeat on every conversation and every stored state (``feature_gate.compare_features``: min cosine per position,
max-abs error over the reference's largest value), and, as the margin a bound must keep, the transformers states of
each aux layer against its neighbour's (the off-by-one that has hit others).
Writes ``benchmarks/results/feature_engines_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, run_cli

ENGINES = ("transformers", "vllm")
DTYPES = ("fp32", "bf16")


def measure(engine: str, dtype: str, args, scratch: Path, repeat: int) -> dict:
    out = scratch / f"{engine}-{dtype}-{repeat}"
    cmd = ["prepare", "--data", "default", "--limit", str(args.conversations), "--output", str(out), "--dtype", dtype,
           "--storage-dtype", "float32", "--max-length", str(args.max_length), "--shard-size",
           str(args.conversations), "--draft-vocab", "0", "--threads", str(args.threads), "--device", "cpu",
           "--engine", engine, "--json"]
    if engine == "vllm":
        cmd += ["--kv-cache-gib", "2"]
    log = scratch / f"{engine}-{dtype}-{repeat}.log"
    child = run_cli(cmd, threads=args.threads, log=log)
    if child.exit != 0:
        raise SystemExit(f"{engine} {dtype} run failed; see {log}:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    rep = json.loads(text[text.rindex("\n{") + 1: text.rindex("}") + 1])
    return {"engine": engine, "dtype": dtype, "repeat": repeat, "cache": out,
            "sequences_per_second": rep["examples"] / (rep["tokens"] / rep["tokens_per_second"]),
            "tokens_per_second": rep["tokens_per_second"], "tokens": rep["tokens"], "sequences": rep["examples"],
            "wall_seconds": child.seconds, "peak_rss_bytes": child.peak_rss_bytes,
            "beside_cores": child.beside_cores, "gate": rep.get("gate")}


def distance(ref_cache: Path, got_cache: Path, dtype: str) -> dict:
    from specframe.cache import FeatureCache
    from specframe.feature_gate import compare_features

    ref, got = FeatureCache(ref_cache), FeatureCache(got_cache)
    rep = compare_features([{"aux": x.aux_hidden, "final": x.final_hidden} for x in ref],
                           [{"aux": x.aux_hidden, "final": x.final_hidden} for x in got], ref.aux_layers, dtype)
    return rep.as_dict()


def neighbours(conversations: int, max_length: int) -> dict:
    """The transformers (fp32) states of each default aux layer against the next layer's, over the same conversations
    (at most 8): the figures a layer id off by one would give the gate."""
    import torch

    from specframe.data.chat import encode_dataset
    from specframe.data.specs import load_data
    from specframe.feature_gate import compare_features
    from specframe.features import FeatureSpec, capture_features, low_mid_high_layers
    from specframe.targets import load_target

    target = load_target("default", dtype="fp32", device=torch.device("cpu"))
    aux = low_mid_high_layers(target.num_layers)
    examples = list(encode_dataset(target.tokenizer, load_data("default", limit=min(conversations, 8)),
                                   max_length=max_length))
    spec = FeatureSpec(aux_layers=aux + tuple(a + 1 for a in aux), final_hidden=False)
    here, there = [], []
    for e in examples:
        f = capture_features(target, torch.tensor([e.input_ids]), spec).aux[0].unflatten(-1, (2 * len(aux), -1))
        here.append({"aux": f[:, : len(aux)].flatten(-2)})
        there.append({"aux": f[:, len(aux):].flatten(-2)})
    return compare_features(here, there, aux, "fp32").as_dict() | {"compared": [[a, a + 1] for a in aux]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "feature_engines_cpu.json")
    args = ap.parse_args()
    from specframe.results import provenance, write_results
    from specframe.targets import load_target

    runs = []
    with tempfile.TemporaryDirectory(prefix="sf-features-") as tmp:
        scratch = Path(tmp)
        for repeat in range(args.repeats):
            for dtype in DTYPES:
                for engine in ENGINES if repeat % 2 == 0 else tuple(reversed(ENGINES)):
                    runs.append(measure(engine, dtype, args, scratch, repeat))
                    r = runs[-1]
                    print(f"repeat {repeat} {dtype} {engine}: {r['sequences_per_second']:.2f} sequences/s "
                          f"({r['tokens_per_second']:.0f} tokens/s; wall {r['wall_seconds']:.0f} s; beside "
                          f"{r['beside_cores']})", flush=True)
        pick = {(r["engine"], r["dtype"], r["repeat"]): r for r in runs}
        parity = {d: distance(pick["transformers", d, 0]["cache"], pick["vllm", d, 0]["cache"], d) for d in DTYPES}
        # bf16 of either engine against the fp32 reference: what rounding alone does to the states
        parity["bf16_transformers_vs_fp32"] = distance(pick["transformers", "fp32", 0]["cache"],
                                                       pick["transformers", "bf16", 0]["cache"], "bf16")
    margin = neighbours(args.conversations, args.max_length)
    metrics: dict = {"engines": {}, "parity": parity, "neighbour_layers": margin}
    for dtype in DTYPES:
        ratios = [pick["vllm", dtype, i]["sequences_per_second"] / pick["transformers", dtype, i]["sequences_per_second"]
                  for i in range(args.repeats)]
        metrics["engines"][dtype] = {
            e: {"median_sequences_per_second": statistics.median(r["sequences_per_second"] for r in runs
                                                                 if r["engine"] == e and r["dtype"] == dtype),
                "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs if r["engine"] == e and r["dtype"] == dtype)}
            for e in ENGINES} | {"vllm_over_transformers": ratios}
        print(f"{dtype}: vLLM / transformers sequences/s per repeat {[round(x, 2) for x in ratios]}; parity "
              f"{'passed' if parity[dtype]['passed'] else 'FAILED'}, min cosine "
              f"{min(c['min_cosine'] for c in parity[dtype]['layers']):.6f}, max rel error "
              f"{max(c['rel_error'] for c in parity[dtype]['layers']):.3g}")
    from specframe.feature_gate import BOUNDS

    for c in margin["layers"]:  # each neighbour must fail every dtype's bound, or an off-by-one id would pass
        caught = {d: c["min_cosine"] < b.min_cosine or c["rel_error"] > b.max_rel_error for d, b in BOUNDS.items()}
        print(f"{c['layer']} against the next layer (fp32 transformers): min cosine {c['min_cosine']:.4f}, rel error "
              f"{c['rel_error']:.3g}; caught by the bound of {', '.join(d for d, v in caught.items() if v) or 'none'}")
    metrics["neighbour_layers"]["caught_by"] = {
        c["layer"]: [d for d, b in BOUNDS.items() if c["min_cosine"] < b.min_cosine or c["rel_error"] > b.max_rel_error]
        for c in margin["layers"]}
    target = load_target("default", weights=False)
    rows = [{k: (v if k != "cache" else None) for k, v in r.items() if k != "cache"} for r in runs]
    write_results(args.out, kind="bench.feature_engines", metrics=metrics, per_prompt=rows,
                  provenance=provenance(target={"id": target.id, "weights_hash": target.weights_hash},
                                        command=["python", *sys.argv]),
                  config=vars(args) | {"out": str(args.out)})


if __name__ == "__main__":
    main()
