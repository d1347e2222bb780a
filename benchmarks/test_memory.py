"""Memory suite: for each drafter x mask builder x partitioner, the longest context that trains within one budget.

    .venv/bin/pytest benchmarks/test_memory.py --preset cpu --benchmark-only -p no:cacheprovider

Found by the checked estimator and confirmed by measurement, never by crashing: the estimator (``specframe.memory``)
proposes the longest length that fits (searched in steps of 64 up to the preset's cap), then one real training step
at that length runs in a fresh child process (``specframe.memory_probe``: the real engine, drafter, mask builder,
partitioner and AdamW, features as a cache hands them over) under the engine's memory guard with the same budget. A
measured overrun (the guard stops the step) steps the length down by a fifth and measures again. The ``peagle``
partitioner uses S = max(2, L // segment_len) segments, as P-EAGLE keeps the tokens per segment about constant.
For each drafter's long-context path (chunked + peagle) peak memory is also measured at a quarter and half of its
longest length, and the growth exponent of (peak - fixed part) against L fitted log-log.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from harness import command, fingerprint, target_provenance
from memory_context import exponent
from specframe.memory import parse_size
from presets import resolve

ALL_BUILDERS = ("dense", "precomputed", "chunked", "flex")
ALL_PARTITIONERS = ("none", "peagle")


def pytest_generate_tests(metafunc):
    if "combo" in metafunc.fixturenames:
        p = resolve(metafunc.config.getoption("--preset"))
        combos = [(d, b, s) for d in p.drafters for b in p.memory_builders for s in p.memory_partitioners]
        metafunc.parametrize("combo", combos, ids=["-".join(c) for c in combos])


@pytest.fixture(scope="module")
def shape(workspace):
    from transformers import AutoConfig

    from specframe.targets import target_source

    return AutoConfig.from_pretrained(target_source(workspace.target()))


def partitions(p, partitioner: str, seq_len: int) -> int:
    """P-EAGLE-style partitioning keeps the tokens per segment about constant as the context grows."""
    return max(2, seq_len // p.memory_segment_len) if partitioner == "peagle" else 1


def options(p, drafter: str) -> dict:
    return p.train_options(drafter, depth=p.memory_depth)


def estimate(p, shape, drafter, builder, partitioner, seq_len):
    from specframe import memory as mem

    return mem.estimate(mem.MemoryConfig(
        drafter=drafter, target_config=shape, seq_len=seq_len, depth=p.memory_depth, mask_builder=builder,
        partitioner=partitioner, partitions=partitions(p, partitioner, seq_len), drafter_options=options(p, drafter),
        features="synthetic", device=p.device,
    ))


def longest_estimated(p, shape, drafter, builder, partitioner) -> int | None:
    from specframe.memory import parse_size

    budget = parse_size(p.memory_budget)
    lo, hi = 0, p.memory_cap // 64
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate(p, shape, drafter, builder, partitioner, mid * 64).peak_bytes <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * 64 or None


def measure(p, shape, drafter, builder, partitioner, seq_len) -> dict:
    """One real step at ``seq_len`` under the guard: the measured figures, or ``{"over": message}``."""
    from specframe.memory_probe import ProbeSpec, measure as probe

    spec = ProbeSpec(
        seq_len=seq_len, depth=p.memory_depth, drafter=drafter, mask_builder=builder, partitioner=partitioner,
        partitions=partitions(p, partitioner, seq_len), features="synthetic", steps=1, threads=p.threads,
        vocab=shape.vocab_size, hidden=shape.hidden_size, heads=shape.num_attention_heads,
        kv_heads=shape.num_key_value_heads, intermediate=shape.intermediate_size, target_layers=4,
        drafter_options=options(p, drafter), memory_budget=p.memory_budget, skip_check=True, device=p.device,
    )
    try:
        got = probe(spec)
    except RuntimeError as exc:
        if "memory budget exceeded" not in str(exc):
            raise
        return {"seq_len": seq_len, "over": str(exc).splitlines()[-1]}
    return {"seq_len": seq_len, "peak_bytes": got["peak_bytes"], "step_seconds": got["step_seconds"][0],
            "estimate_bytes": estimate(p, shape, drafter, builder, partitioner, seq_len).peak_bytes}


def test_longest_context(benchmark, workspace, shape, combo):
    p = workspace.preset
    drafter, builder, partitioner = combo
    if builder == "flex" and p.device == "cpu":
        pytest.skip("flex attention has no backward on CPU")
    box: dict = {}

    def search():
        longest = longest_estimated(p, shape, drafter, builder, partitioner)
        points = []
        length = longest
        for _ in range(3):  # the estimate, then a fifth shorter per measured overrun
            if not length:
                break
            point = measure(p, shape, drafter, builder, partitioner, length)
            points.append(point)
            if "over" not in point:
                break
            length = (int(length * 0.8) // 64) * 64
        fits = [q for q in points if "over" not in q]
        figures = {
            "estimated_longest_seq_len": longest,
            "longest_seq_len": fits[-1]["seq_len"] if fits else None,
            "at_cap": bool(fits) and fits[-1]["seq_len"] == p.memory_cap,
            "peak_bytes": fits[-1]["peak_bytes"] if fits else None,
            "estimate_error": fits[-1]["estimate_bytes"] / fits[-1]["peak_bytes"] - 1 if fits else None,
            "step_seconds": fits[-1]["step_seconds"] if fits else None,
            "drafter": drafter, "mask_builder": builder, "partitioner": partitioner,
        }
        if fits and builder == "chunked" and partitioner == "peagle":
            top = fits[-1]["seq_len"]
            shorter = [measure(p, shape, drafter, builder, partitioner, max(64, (top // q // 64) * 64)) for q in (4, 2)]
            series = [q for q in [*shorter, fits[-1]] if "over" not in q]
            fixed = estimate(p, shape, drafter, builder, partitioner, 64).fixed_bytes
            figures["growth_exponent"] = exponent([(q["seq_len"], q["peak_bytes"] - fixed) for q in series])
            figures["points"] = [{"seq_len": q["seq_len"], "peak_bytes": q["peak_bytes"]} for q in series]
        box.update(figures=figures, measured=points)

    saved = _saved(workspace, combo)
    # only what the measurement depends on: a longer training run must not discard finished memory points
    # (and installing another drafter must not discard the others': only this drafter's options count)
    relevant = {k: v for k, v in attrs.asdict(p).items() if k.startswith("memory") or k in (
        "target", "draft_vocab", "depth", "threads", "device")}
    relevant["options"] = p.drafters[drafter]
    key = fingerprint([relevant, combo])
    if saved.exists() and json.loads(saved.read_text()).get("key") == key:
        box.update(json.loads(saved.read_text()))  # measured by an earlier run of this preset
        benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    else:
        benchmark.pedantic(search, rounds=1, iterations=1)
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps({"key": key, **box}, indent=1))
    figures = box["figures"]
    benchmark.extra_info.update(figures)
    if figures["longest_seq_len"] is not None:
        assert figures["peak_bytes"] <= parse_size(p.memory_budget)


def _saved(workspace, combo) -> Path:
    return workspace.root / "memory" / ("-".join(combo) + ".json")


def test_memory_table(benchmark, workspace):
    from specframe.results import provenance, write_results

    p = workspace.preset
    combos = [(d, b, s) for d in p.drafters for b in p.memory_builders for s in p.memory_partitioners]
    found = {"/".join(c): json.loads(_saved(workspace, c).read_text()) for c in combos if _saved(workspace, c).exists()}
    if not found:
        pytest.skip("no memory measurement in the work folder: run test_longest_context first")
    methods = {key: r["figures"] for key, r in found.items()}
    per_prompt = [{"combination": key, **point} for key, r in found.items() for point in r["measured"]]
    box = {}
    benchmark.pedantic(lambda: box.update(path=write_results(
        workspace.results / "memory.json", kind="bench.memory",
        metrics={"methods": methods, "memory_budget": p.memory_budget, "cap": p.memory_cap},
        per_prompt=per_prompt, config={"preset": attrs.asdict(p)},
        provenance=provenance(target=target_provenance(workspace.target()), command=command()),
    )), rounds=1, iterations=1)
    lines = [f"longest trainable context under {p.memory_budget} (depth {p.memory_depth}, cap {p.memory_cap})",
             "| drafter | mask builder | partitioner | longest L | estimated | peak MiB | estimate error | exponent |",
             "|---|---|---|---|---|---|---|---|"]
    for r in methods.values():
        longest, peak, err, exp = r["longest_seq_len"], r["peak_bytes"], r["estimate_error"], r.get("growth_exponent")
        shown = "none" if longest is None else (f">= {longest} (cap)" if r["at_cap"] else str(longest))
        cells = [r["drafter"], r["mask_builder"], r["partitioner"], shown, str(r["estimated_longest_seq_len"]),
                 "" if peak is None else f"{peak / 2**20:.0f}", "" if err is None else f"{err:+.1%}",
                 "" if exp is None else f"{exp:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    print("\n" + "\n".join(lines))
    benchmark.extra_info.update({"results": str(box["path"]), "table": "\n".join(lines)})
