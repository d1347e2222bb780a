"""Acceptance and speed suites: the preset's trained drafters against plain decoding and n-gram, reference engine.

    .venv/bin/pytest benchmarks/test_acceptance.py --preset cpu --benchmark-only -p no:cacheprovider

Every comparison goes through ``specframe.bench.compare`` (the code behind `specframe bench acceptance`): plain
decoding, n-gram and the drafters decode the same chat-templated prompts one after the other, prompt by prompt,
greedy, and each drafter's output must equal plain decoding's (asserted).

- ``test_acceptance_sweep[dataset]``: AL, per-slot and conditional acceptance at the preset's chain K values and with
  the EAGLE-2 dynamic tree, on MT-Bench (both turns), HumanEval and GSM8K (evaluation slice); one repeat, since
  greedy acceptance is deterministic (its speed figures are indicative only).
- ``test_speed_ratios``: OTPS of plain, n-gram and each drafter at the preset's K on MT-Bench over interleaved
  repeats (the order rotates every repeat): speedup over plain with a 95% interval, the P-EAGLE / EAGLE-3 ratio, and
  each drafter's own cost per round beside the target's cost per forward.

A results file (``specframe.results`` format) per test goes to the preset's results folder; one whose key (preset,
test settings, checkpoint hashes) matches is reused when a stopped run is started again.
"""

from __future__ import annotations

import attrs
import pytest

from harness import command, fingerprint, saved_metrics
from specframe import bench
from specframe.inference.engine import TreeShape
from specframe.stats import mean_text


@pytest.fixture(scope="module")
def setup(workspace, trained):
    from specframe.targets import load_target

    target = load_target(workspace.target())
    runs = {name: r["run"] for name, r in trained.items() if "refused" not in r}
    return target, runs


def _methods(target, runs, ks, tree: TreeShape | None):
    """n-gram at K 5, every drafter at each chain K, and the tree only for drafters that build trees
    (``Drafter.builds_trees``): the others' ``propose_tree`` is their chain, which the K rows already measure."""
    from specframe import plugins

    methods = [bench.plugin_method("ngram", target.config, k=5, label="ngram/k5")]
    for name, run in runs.items():
        for k in ks:
            methods.append(bench.checkpoint_method(run, target.config, k=k, label=f"{name}/k{k}"))
        if tree is not None and plugins.get("drafter", name).builds_trees:
            methods.append(bench.checkpoint_method(run, target.config, tree=tree, label=f"{name}/tree"))
    return methods


def _measure(benchmark, workspace, target, methods, name, dataset, repeats, config):
    """The summary of ``bench.compare`` on ``dataset`` (or the saved one, if this exact comparison already ran)."""
    from specframe.results import write_results

    p = workspace.preset
    prompts = bench.load_prompts(dataset, p.prompts)
    config = {"preset": p.name, "dataset": dataset, "prompts": [q.id for q in prompts], "repeats": repeats,
              "max_new_tokens": p.max_new_tokens, "verifier": "greedy", "engine": "reference", **config}
    key = fingerprint([config, [(m.label, m.checkpoint_hash) for m in methods]])
    path = workspace.results / f"{name}.json"
    saved = saved_metrics(path, key)
    if saved is not None:
        benchmark.pedantic(lambda: None, rounds=1, iterations=1)
        return saved, path
    box = {}

    def once():
        box["result"] = bench.compare(target.model, target.tokenizer, prompts, methods, bench.make_verifier("greedy"),
                                      repeats=repeats, max_new_tokens=p.max_new_tokens)

    benchmark.pedantic(once, rounds=1, iterations=1)
    summary = bench.json_safe(box["result"].summary())
    write_results(path, kind="bench.acceptance", metrics=summary, per_prompt=bench.json_safe(box["result"].per_prompt()),
                  provenance=bench.results_provenance(target, methods, command()), config={**config, "key": key})
    return summary, path


def pytest_generate_tests(metafunc):
    if "dataset" in metafunc.fixturenames:
        from presets import resolve

        metafunc.parametrize("dataset", list(resolve(metafunc.config.getoption("--preset")).datasets))


def test_acceptance_sweep(benchmark, workspace, setup, dataset):
    target, runs = setup
    p = workspace.preset
    tree = TreeShape(*p.tree)
    methods = _methods(target, runs, p.ks, tree)
    summary, path = _measure(benchmark, workspace, target, methods, f"acceptance-{dataset}", dataset, 1,
                             {"ks": list(p.ks), "tree": attrs.asdict(tree)})
    drafted = {k: v for k, v in summary["methods"].items() if k != "plain"}
    for label, m in drafted.items():
        assert m["lossless"], f"{label} changed plain decoding's greedy output on {dataset}"
        assert 1.0 <= m["acceptance_length"] <= (m["tree"]["depth"] if m["tree"] else m["k"]) + 1
    benchmark.extra_info.update({
        "dataset": dataset, "prompt_turns": summary["prompt_turns"], "results": str(path),
        "acceptance_length": {k: v["acceptance_length"] for k, v in summary["methods"].items()},
        "conditional": {k: v["conditional"] for k, v in drafted.items()},
        "speedup": {k: v["speedup"] for k, v in drafted.items()},
    })
    print(f"\n{dataset}: " + ", ".join(f"{k} AL {v['acceptance_length']:.2f}" for k, v in drafted.items()))


def test_speed_ratios(benchmark, workspace, setup):
    target, runs = setup
    p = workspace.preset
    methods = _methods(target, runs, (p.speed_k,), None)
    summary, path = _measure(benchmark, workspace, target, methods, "speed-mt-bench", "mt-bench", p.repeats,
                             {"k": p.speed_k})
    for label, m in summary["methods"].items():
        if label != "plain":
            assert m["lossless"], label
            # every repeat is counted or flagged with its reason (a noisy machine flags some: never a failure here)
            flagged = m.get("speed_flags") or []
            assert m["speedup_interval"]["repeats"] + len(flagged) == p.repeats, (label, flagged)
            assert all(flag["reasons"] for flag in flagged), label
    benchmark.extra_info.update({
        "results": str(path), "repeats": p.repeats,
        "speedup": {k: v["speedup_interval"] for k, v in summary["methods"].items() if k != "plain"},
        "acceptance_length": {k: v["acceptance_length"] for k, v in summary["methods"].items()},
        "draft_seconds_per_round": {k: v["draft_seconds_per_round"] for k, v in summary["methods"].items()},
        "target_seconds_per_forward": summary["target_seconds_per_forward"],
        "round_cost_ratio": {k: v.get("round_cost_ratio") for k, v in summary["methods"].items() if k != "plain"},
        "speed_flags": {k: v.get("speed_flags") for k, v in summary["methods"].items() if v.get("speed_flags")},
        "ratios": summary["ratios"],
    })
    print("\nspeedup over plain: " + ", ".join(
        f"{k} {mean_text(v['speedup_interval'])}" for k, v in summary["methods"].items() if k != "plain"))
