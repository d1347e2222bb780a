"""Acceptance length and speed of trained drafters against plain decoding and n-gram (pytest-benchmark).

    # ci scale: tiny random target, trains its own small peagle and eagle3 first; a couple of minutes on CPU
    .venv/bin/pytest benchmarks/test_acceptance.py --benchmark-only -p no:cacheprovider

    # SmolLM2-135M-Instruct with drafters trained by `specframe train --target default --output DIR/smollm2-NAME`
    SPECFRAME_BENCH_SCALE=smollm2 SPECFRAME_BENCH_CHECKPOINTS=~/.cache/specframe/bench \\
        .venv/bin/pytest benchmarks/test_acceptance.py --benchmark-only -p no:cacheprovider

Every comparison goes through ``specframe.bench.compare`` (the code behind `specframe bench acceptance`): plain
decoding, n-gram and the drafters decode the same chat-templated prompts one after the other, prompt by prompt,
greedy, and each drafter's output must equal plain decoding's (asserted).

- ``test_acceptance_sweep[dataset]``: AL, per-slot and conditional acceptance at K = 3, 5, 7 (chain) and with the
  EAGLE-2 tree, for MT-Bench (both turns), HumanEval and GSM8K (evaluation slice); one repeat, since greedy
  acceptance is deterministic (speed figures of that run are indicative only).
- ``test_speed_ratios``: OTPS of plain, n-gram and each drafter at K = 5 on MT-Bench over ``REPEATS`` (default 5)
  interleaved repeats: speedup over plain and P-EAGLE / EAGLE-3 ratios with 95% intervals, plus the drafter's own
  cost per round (wall time inside propose / accept) next to the target's cost per forward.

Figures go to ``extra_info`` and to results files ``benchmarks/results/acceptance-<scale>-<drafters>-*.json`` (the
format of ``specframe.results``). Knobs (environment): SPECFRAME_BENCH_SCALE (ci | smollm2),
SPECFRAME_BENCH_CHECKPOINTS (folder of run folders; smollm2 scale), SPECFRAME_BENCH_DRAFTERS (default peagle,eagle3),
SPECFRAME_BENCH_PROMPTS (prompts per set, default 2; MT-Bench counts questions, each two turns),
SPECFRAME_BENCH_MAX_NEW_TOKENS (default 32 at ci, 48 at smollm2), SPECFRAME_BENCH_REPEATS (default 5).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from specframe import bench
from specframe.inference.engine import TreeShape

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCALE = os.environ.get("SPECFRAME_BENCH_SCALE", "ci")
PROMPTS = int(os.environ.get("SPECFRAME_BENCH_PROMPTS", "2"))
MAX_NEW = int(os.environ.get("SPECFRAME_BENCH_MAX_NEW_TOKENS", "32" if SCALE == "ci" else "48"))
REPEATS = int(os.environ.get("SPECFRAME_BENCH_REPEATS", "5"))
DATASETS = ("mt-bench", "humaneval", "gsm8k")
KS = (3, 5, 7)
TREE = TreeShape(depth=5, top_k=4, total_tokens=16)
DRAFTERS = tuple(os.environ.get("SPECFRAME_BENCH_DRAFTERS", "peagle,eagle3").split(","))


def _train_ci(root: Path, target: Path) -> dict[str, Path]:
    """Small peagle and eagle3 on the tiny target's chat data (identical data, steps and seed)."""
    from specframe.engine import TrainConfig, train

    sys.path.insert(0, str(ROOT))
    from tests.train_fixtures import write_chat

    chat = write_chat(root / "chat.jsonl", n=24)
    options = {
        "peagle": {"layers": 2, "draft_vocab_size": 128, "k_train": 8, "k_infer": 5},
        "eagle3": {"layers": 1, "draft_vocab_size": 128, "ttt_steps": 7, "k_infer": 5},
    }
    runs = {}
    for name in DRAFTERS:
        out = root / f"ci-{name}"
        train(TrainConfig(drafter=name, output=str(out), target=str(target), data=str(chat), seq_len=64,
                          max_steps=8, batch_size=2, val_examples=2, seed=0, drafter_options=options[name]),
              progress=False)
        runs[name] = out
    return runs


def _found(folder: Path) -> dict[str, Path]:
    """Run folders ``smollm2-<drafter>`` (or any ``<drafter>``) under ``folder`` that hold a checkpoint."""
    runs = {}
    for name in DRAFTERS:
        for candidate in (folder / f"smollm2-{name}", folder / name):
            if (candidate / "latest").exists():
                runs[name] = candidate
                break
    return runs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from specframe.targets import load_target, tiny_target

    torch.set_num_threads(1)
    if SCALE == "ci":
        root = tmp_path_factory.mktemp("acceptance")
        folder = tiny_target(root / "tiny-target", vocab=320, layers=4, hidden=32, seed=0)
        runs = _train_ci(root, folder)
        target = load_target(folder)
    elif SCALE == "smollm2":
        where = Path(os.environ.get("SPECFRAME_BENCH_CHECKPOINTS", "~/.cache/specframe/bench")).expanduser()
        runs = _found(where)
        if not runs:
            pytest.skip(f"no smollm2-<drafter> run folders under {where}; train them with `specframe train`")
        target = load_target("default")
    else:
        raise pytest.UsageError(f"SPECFRAME_BENCH_SCALE must be ci or smollm2, got {SCALE!r}")
    return target, runs


def _methods(target, runs, ks, tree: bool):
    methods = [bench.plugin_method("ngram", target.config, k=5, label="ngram/k5")]
    for name, run in runs.items():
        for k in ks:
            methods.append(bench.checkpoint_method(run, target.config, k=k, label=f"{name}/k{k}"))
        if tree:
            methods.append(bench.checkpoint_method(run, target.config, tree=TREE, label=f"{name}/tree"))
    return methods


def _run(benchmark, target, methods, dataset, verifier, repeats):
    prompts = bench.load_prompts(dataset, PROMPTS)
    box = {}

    def once():
        box["result"] = bench.compare(target.model, target.tokenizer, prompts, methods, verifier, repeats=repeats,
                                      max_new_tokens=MAX_NEW)

    benchmark.pedantic(once, rounds=1, iterations=1)
    return prompts, box["result"]


def _drafter_tag(methods) -> str:
    return "-".join(dict.fromkeys(m.drafter.name for m in methods if m.checkpoint)) or "baselines"


def _write(name, target, methods, result, config):
    from specframe.results import write_results

    summary = result.summary()
    return summary, write_results(
        RESULTS / f"acceptance-{SCALE}-{_drafter_tag(methods)}-{name}.json", kind="bench.acceptance",
        metrics=bench.json_safe(summary),
        per_prompt=bench.json_safe(result.per_prompt()), provenance=bench.results_provenance(target, methods),
        config={"scale": SCALE, "max_new_tokens": MAX_NEW, "verifier": "greedy", **config},
    )


@pytest.mark.parametrize("dataset", DATASETS)
def test_acceptance_sweep(benchmark, setup, dataset):
    target, runs = setup
    methods = _methods(target, runs, KS, tree=True)
    prompts, result = _run(benchmark, target, methods, dataset, bench.make_verifier("greedy"), 1)
    summary, path = _write(f"sweep-{dataset}", target, methods, result,
                           {"dataset": dataset, "prompts": [p.id for p in prompts], "ks": list(KS),
                            "tree": {"depth": TREE.depth, "top_k": TREE.top_k, "total_tokens": TREE.total_tokens}})
    drafted = {k: v for k, v in summary["methods"].items() if k != "plain"}
    for label, m in drafted.items():
        assert m["lossless"], f"{label} changed plain decoding's greedy output on {dataset}"
        assert 1.0 <= m["acceptance_length"] <= (m["tree"]["depth"] if m["tree"] else m["k"]) + 1
    benchmark.extra_info.update({
        "dataset": dataset, "prompt_turns": summary["prompt_turns"], "results": str(path),
        "acceptance_length": {k: v["acceptance_length"] for k, v in summary["methods"].items()},
        "conditional": {k: v["conditional"] for k, v in drafted.items()},
        "per_slot": {k: v["per_slot"] for k, v in drafted.items()},
        "speedup": {k: v["speedup"] for k, v in drafted.items()},
        "draft_seconds_per_round": {k: v["draft_seconds_per_round"] for k, v in drafted.items()},
    })


def test_speed_ratios(benchmark, setup):
    target, runs = setup
    methods = _methods(target, runs, (5,), tree=False)
    prompts, result = _run(benchmark, target, methods, "mt-bench", bench.make_verifier("greedy"), REPEATS)
    summary, path = _write("speed-mt-bench", target, methods, result,
                           {"dataset": "mt-bench", "prompts": [p.id for p in prompts], "repeats": REPEATS})
    for label, m in summary["methods"].items():
        if label != "plain":
            assert m["lossless"], label
            assert m["speedup_interval"]["repeats"] == REPEATS
    benchmark.extra_info.update({
        "results": str(path),
        "repeats": REPEATS,
        "speedup": {k: v["speedup_interval"] for k, v in summary["methods"].items() if k != "plain"},
        "acceptance_length": {k: v["acceptance_length"] for k, v in summary["methods"].items()},
        "draft_seconds_per_round": {k: v["draft_seconds_per_round"] for k, v in summary["methods"].items()},
        "target_seconds_per_forward": summary["target_seconds_per_forward"],
        "ratios": summary["ratios"],
    })
