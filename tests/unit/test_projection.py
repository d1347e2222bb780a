"""The projection from served acceptance (issue 57): the fit on log2 tokens, and an interval that carries each
point's AL, R and the fit's own error."""

from __future__ import annotations

import math

import pytest

from specframe.projection import REACH, Point, order_of_magnitude, project, served_curves


def line(slope=0.06, spread=0.02, tokens=(128e3, 256e3, 512e3, 1024e3), start=1.2):
    return [Point(t, start + slope * i, start + slope * i - spread, start + slope * i + spread)
            for i, t in enumerate(tokens)]


def width(p):
    return math.log(p.high) - math.log(p.low)


def test_an_exact_line_gives_the_tokens_where_it_reaches_goal_times_r():
    p = project(line(), 1.33, 1.29, 1.37, goal=1.3, k=3)
    needed = 1.3 * 1.33
    assert p.needed_al == pytest.approx(needed) and p.slope == pytest.approx(0.06)
    assert p.tokens == pytest.approx(128e3 * 2 ** ((needed - 1.2) / 0.06))
    assert p.low < p.tokens < p.high and not p.within_reach
    assert p == project(line(), 1.33, 1.29, 1.37, goal=1.3, k=3)  # seeded


def test_each_source_of_uncertainty_widens_the_interval():
    base = project(line(spread=0.0), 1.33, None, None, goal=1.0, k=3)
    with_r = project(line(spread=0.0), 1.33, 1.25, 1.41, goal=1.0, k=3)
    with_al = project(line(spread=0.03), 1.33, None, None, goal=1.0, k=3)
    assert width(with_r) > width(base) * 1.5
    assert width(with_al) > width(base) * 1.5
    # an exact line with exact R: only the fit's residual error is left, and it is none
    assert base.low == pytest.approx(base.tokens, rel=1e-6) and base.high == pytest.approx(base.tokens, rel=1e-6)
    # a curve that wanders about its line: the fit's own error widens it with nothing else uncertain
    bumpy = [Point(p.tokens, p.al + d) for p, d in zip(line(spread=0.0), (0.02, -0.02, -0.02, 0.02))]
    assert width(project(bumpy, 1.33, None, None, goal=1.0, k=3)) > 0.1


def test_a_curve_that_does_not_rise_has_no_answer_and_few_points_no_fit():
    flat = project([Point(1e5, 1.3), Point(2e5, 1.3), Point(4e5, 1.29)], 1.4, None, None, goal=1.0, k=2)
    assert flat.tokens is None and not flat.within_reach
    assert project(line()[:2], 1.3, None, None, goal=1.0, k=2) is None
    assert project([Point(1e5, 1.1), Point(1e5, 1.2), Point(2e5, 1.3)], 1.3, None, None, goal=1.0, k=2) is None


def test_reach_and_order_of_magnitude():
    near = project(line(), 1.2, None, None, goal=1.0, k=3)
    assert near.tokens < REACH * near.tokens_now and near.within_reach
    assert order_of_magnitude(1.05e8) == "10^8" and order_of_magnitude(3.3e8) == "10^9"
    assert order_of_magnitude(math.inf) == "unbounded"


def test_served_curves_join_the_kept_points_and_the_final_checkpoint():
    def doc(kind, metrics, config):
        return {"kind": kind, "metrics": metrics, "config": config}

    curve = doc("bench.acceptance.whole-set", {"methods": {
        "peagle/step90/k3": {"acceptance_length": 1.2, "acceptance_length_interval": {"low": 1.18, "high": 1.22}},
        "peagle/step180/k3": {"acceptance_length": 1.25}, "plain": {"acceptance_length": 1.0}}},
        {"drafter": "peagle", "dataset": "mt-bench", "k": 3, "points": [
            {"label": "peagle/step90/k3", "train_tokens": 128_000}, {"label": "peagle/step180/k3", "train_tokens": 255_000},
            {"label": "peagle/step200/k3", "train_tokens": 280_000}]})  # a point with no row is left out
    final = doc("bench.acceptance.whole-set", {"methods": {
        "peagle/k2": {"acceptance_length": 1.28}, "peagle/k3": {"acceptance_length": 1.31}}},
        {"drafter": "peagle", "dataset": "mt-bench"})
    job = doc("bench.job", {"drafter": "peagle", "train_tokens": 1_024_000}, {})
    (key, (k, points)), = served_curves([("a", curve), ("b", final), ("c", job)]).items()
    assert key == ("peagle", "mt-bench") and k == 3
    assert [(p.tokens, p.al) for p in points] == [(128_000, 1.2), (255_000, 1.25), (1_024_000, 1.31)]
    assert (points[0].low, points[0].high) == (1.18, 1.22)
