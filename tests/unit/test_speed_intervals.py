"""Speed that travels (issue 57): intervals over prompt turns and repeats together, timed turns spread over MT-Bench's
categories, n-gram's fastest K as the bar, and the machine each figure came from."""

from __future__ import annotations

import pytest

from specframe import bench
from specframe.metrics import PromptMetrics
from specframe.results import cpu_details
from specframe.stats import two_way_ratio


def _cells(rows: list[list[float]]) -> list[list[float]]:
    return [list(map(float, r)) for r in rows]


def test_the_two_way_estimate_is_the_pooled_ratio_and_is_deterministic():
    tokens = _cells([[10, 10], [20, 20], [5, 5]])
    fast = _cells([[1, 1.2], [1, 1], [2, 2]])
    slow = _cells([[2, 2], [2, 2.5], [2, 2]])
    iv = two_way_ratio(tokens, fast, tokens, slow)
    assert iv.estimate == pytest.approx((70 / 8.2) / (70 / 12.5))
    assert iv.low <= iv.estimate <= iv.high
    assert iv.prompt_turns == 3 and iv.repeats == 2
    assert iv == two_way_ratio(tokens, fast, tokens, slow)  # seeded: the same interval every time


def test_prompt_variation_widens_the_interval_where_repeats_alone_see_none():
    # every repeat timed each turn the same (no timing noise), but turns differ a lot: one turn 3x faster, another
    # slower than plain. An interval over repeats alone is a point; over turns and repeats it is wide
    tokens = _cells([[100] * 3] * 4)
    plain = _cells([[10] * 3] * 4)
    method = _cells([[10 / 3] * 3, [12] * 3, [5] * 3, [10] * 3])
    per_repeat = bench.Interval.of([(sum(r[i] for r in tokens) / sum(r[i] for r in method))
                                    / (sum(r[i] for r in tokens) / sum(r[i] for r in plain)) for i in range(3)])
    assert per_repeat.low == pytest.approx(per_repeat.high)
    iv = two_way_ratio(tokens, method, tokens, plain)
    assert iv.high - iv.low > 0.3


def test_timing_noise_alone_is_still_covered():
    tokens = _cells([[100, 100, 100]] * 3)
    plain = _cells([[10, 10, 10]] * 3)
    method = _cells([[5, 8, 6]] * 3)  # each repeat's machine speed differs, every turn alike
    iv = two_way_ratio(tokens, method, tokens, plain)
    assert iv.low < iv.estimate < iv.high


def test_arrays_of_other_shapes_are_refused():
    with pytest.raises(ValueError, match="one shape"):
        two_way_ratio([[1, 2]], [[1, 2]], [[1]], [[1]])


def _record(prompt: str, repeat: int, tokens: int, seconds: float) -> bench.Record:
    metrics = PromptMetrics(tokens, tokens, tuple([0] * tokens), tuple([0] * tokens), seconds)
    return bench.Record(prompt, 0, repeat, 4, tuple(range(tokens)), metrics, 0.0)


def test_a_comparison_pairs_each_turns_cells_across_methods():
    # plain's records stored in another order than the method's: cells must still pair turn with turn
    plain = [_record(p, r, 10, 1.0) for r in range(2) for p in ("a", "b")]
    method = [_record(p, r, 10, s) for p, s in (("b", 2.0), ("a", 0.5)) for r in range(2)]
    c = bench.Comparison([bench.Method(bench.PLAIN), bench.Method("m/k2", None, 2)],
                         {bench.PLAIN: plain, "m/k2": method}, 2, True)
    iv = c.ratio_over_prompts("m/k2")
    assert iv.estimate == pytest.approx(c.aggregate("m/k2").speedup)
    assert iv.low < 1.0 < iv.high  # turn a is 2x faster, turn b 2x slower: resampling turns straddles 1
    summary = c.summary()["methods"]["m/k2"]
    assert summary["speedup_interval_prompts"]["estimate"] == pytest.approx(iv.estimate)
    kept = c.ratio_over_prompts("m/k2", exclude=[1])
    assert kept.repeats == 1


def test_timed_turns_are_spread_over_mt_benchs_categories():
    prompts = bench.load_prompts("mt-bench")
    chosen = bench.spread_over_categories(prompts, 16)
    categories = [p.category for p in chosen]
    assert len(set(categories)) == 8 and all(categories.count(c) == 2 for c in set(categories))
    assert chosen[0].id == prompts[0].id and len({p.id for p in chosen}) == 16
    assert bench.spread_over_categories(prompts, 3) == chosen[:3]
    # a set without categories keeps its order; asking for more than there are gives them all
    gsm = bench.load_prompts("gsm8k", 4)
    assert bench.spread_over_categories(gsm, 10) == gsm


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
cpu MHz\t\t: 2596.148
cache size\t: 1024 KB
flags\t\t: fpu sse4_2 avx2 avx512f avx512_bf16 amx_tile nx

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
flags\t\t: fpu avx2
"""


def test_the_machine_record_tells_cpus_of_one_model_name_apart():
    cpu = cpu_details(CPUINFO)
    assert cpu["vendor"] == "AuthenticAMD" and cpu["family"] == "25" and cpu["model"] == "17"
    assert cpu["kernel_flags"] == ["amx_tile", "avx2", "avx512_bf16", "avx512f", "sse4_2"]
    assert cpu_details("") == {}


def test_the_speed_table_names_the_fastest_ngram_the_two_way_interval_and_the_machine():
    from specframe.report.jobs import _speed_table

    def ngram(k, mean):
        return {"acceptance_length": 1.3, "drafter": "ngram", "checkpoint": None,
                "speedup_interval": {"mean": mean, "low": mean - 0.05, "high": mean + 0.05}}

    document = {"kind": "bench.speed", "config": {"drafter": "peagle"},
                "provenance": {"machine": {"processor": "AMD EPYC", "cpu_count": 2, "cpu": {"family": "25",
                                                                                            "model": "17"}}},
                "metrics": {"quiet": True, "target_seconds_per_forward": 0.0174, "methods": {
                    "plain": {"acceptance_length": 1.0},
                    "ngram/k2": ngram(2, 1.3), "ngram/k3": ngram(3, 1.5), "ngram/k5": ngram(5, 1.4),
                    "peagle/k3": {"acceptance_length": 1.4, "drafter": "peagle", "checkpoint": "x",
                                  "speedup_interval": {"mean": 0.99, "low": 0.98, "high": 1.0},
                                  "speedup_interval_prompts": {"estimate": 0.99, "low": 0.9, "high": 1.08}}},
                    "ratios": {"peagle/k3 / ngram/k3": {"otps": {"mean": 0.66, "low": 0.6, "high": 0.7}},
                               "peagle/k3 / ngram/k2": {"otps": {"mean": 0.76, "low": 0.7, "high": 0.8}}}}}
    text = "\n".join(_speed_table([("peagle/speed-batch1.json", document)], 1))
    row = next(line for line in text.splitlines() if line.startswith("| peagle | peagle/k3"))
    assert "[0.90, 1.08]" in row  # the interval over turns and repeats, not the repeats' [0.98, 1.00]
    assert "0.66" in row  # against n-gram's fastest K (k3), not the first listed
    assert all(f"ngram/k{k}" in text for k in (2, 3, 5))
    assert "AMD EPYC, family 25 model 17, 2 cores; plain vLLM step 17.4 ms" in text


def test_an_interval_with_no_plausible_repeat_prints_no_number():
    """Every repeat flagged (a noisy machine): the interval has no mean, and printing it (the suites print every
    interval) says so instead of failing on a missing number or showing NaN; a saved file holds that mean as null."""
    from specframe.stats import Interval

    empty = Interval.of([])
    assert str(empty) == "n/a (no repeat kept)"
    saved = Interval(**{**empty.as_dict(), "mean": None, "median": None})
    assert str(saved) == "n/a (no repeat kept)"
    assert str(Interval(None, None, None, None, 3, ())) == "n/a (none of 3 repeats plausible)"
    assert str(Interval.of([1.2])) == "1.200"
    assert str(Interval.of([1.0, 1.21])).startswith("1.100 [")


def test_a_saved_mean_is_shown_or_said_missing():
    from specframe.stats import mean_text

    assert mean_text({"mean": 1.234}) == "1.23x"
    assert mean_text({"mean": None}) == "n/a"
    assert mean_text({"mean": float("nan")}) == "n/a"
    assert mean_text(None) == "n/a"
