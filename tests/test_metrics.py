"""The metric definitions (DESIGN.md section 8) on hand-computed cases and on real engine runs."""

from __future__ import annotations

import math

import pytest
import torch
from decoding_helpers import OracleDrafter, RandomDrafter, naive_greedy, tiny_target

from specframe import plugins
from specframe.inference import generate
from specframe.metrics import (
    PromptMetrics,
    aggregate,
    conditional_acceptance,
    expected_acceptance_length,
    per_slot_acceptance,
)


def prompt_metrics(accepted, drafted, seconds=1.0, emitted=None):
    emitted = sum(a + 1 for a in accepted) if emitted is None else emitted
    return PromptMetrics(emitted, len(accepted), tuple(accepted), tuple(drafted), seconds)


def test_acceptance_length_counts_the_bonus_token():
    m = prompt_metrics([3, 0, 1, 3], [3, 3, 3, 3])
    assert m.acceptance_length == (4 + 1 + 2 + 4) / 4
    assert 1 <= m.acceptance_length <= 3 + 1
    assert m.otps == 11.0


def test_per_slot_and_conditional_acceptance_differ_as_defined():
    accepted, drafted = [3, 0, 1, 2], [3, 3, 3, 3]
    # per slot: rounds accepting slot i / all drafting rounds
    assert per_slot_acceptance(accepted, drafted, 3) == [3 / 4, 2 / 4, 1 / 4]
    # conditional: rounds accepting slot i / rounds that accepted every slot before i
    assert conditional_acceptance(accepted, drafted, 3) == [3 / 4, 2 / 3, 1 / 2]
    # rounds that drafted nothing (prompt lookup without a match) or fewer slots are not counted against a slot
    assert per_slot_acceptance([1, 0], [2, 0], 2) == [1.0, 0.0]
    assert conditional_acceptance([1, 0], [1, 0], 2)[0] == 1.0 and math.isnan(conditional_acceptance([1], [1], 2)[1])


def test_aggregate_pools_and_computes_speedup():
    spec = [prompt_metrics([2, 2], [2, 2], seconds=1.0), prompt_metrics([0, 1], [2, 2], seconds=1.0)]
    plain = [prompt_metrics([0] * 5, [0] * 5, seconds=2.0), prompt_metrics([0] * 3, [0] * 3, seconds=2.0)]
    agg = aggregate(spec, k=2, baseline=plain)
    assert agg.emitted == 9 and agg.forwards == 4 and agg.acceptance_length == 9 / 4  # pooled, not a mean of ratios
    assert agg.per_slot == (3 / 4, 2 / 4)
    assert agg.otps == 4.5 and agg.speedup == pytest.approx(4.5 / (8 / 4.0))
    assert aggregate(spec, k=2).speedup is None
    assert set(agg.as_dict()) >= {"acceptance_length", "per_slot", "conditional", "otps", "speedup"}


def test_expected_acceptance_length():
    assert expected_acceptance_length([]) == 1.0
    assert expected_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert expected_acceptance_length([0.5, 0.5]) == 1 + 0.5 + 0.25
    assert expected_acceptance_length([0.0, 1.0]) == 1.0
    with pytest.raises(ValueError):
        expected_acceptance_length([1.5])


def test_metrics_of_engine_runs():
    model = tiny_target()
    prompt = [7, 8, 9]
    k, rounds = 3, 5
    n = 1 + rounds * (k + 1)
    greedy = plugins.get("verifier", "greedy")()
    oracle = generate(model, torch.tensor(prompt), greedy, OracleDrafter(naive_greedy(model, prompt, n), 256), k=k,
                      max_new_tokens=n, eos_token_id=())
    m = PromptMetrics.of(oracle)
    assert m.emitted == n - 1 and m.forwards == rounds and m.acceptance_length == k + 1
    assert per_slot_acceptance(m.accepted, m.drafted, k) == [1.0] * k
    plain = PromptMetrics.of(generate(model, torch.tensor(prompt), greedy, max_new_tokens=n, eos_token_id=()))
    assert plain.acceptance_length == 1 and plain.forwards == n - 1
    rnd = PromptMetrics.of(generate(model, torch.tensor(prompt), greedy, RandomDrafter(256), k=k, max_new_tokens=n,
                                    eos_token_id=()))
    assert 1 <= rnd.acceptance_length <= k + 1 and rnd.decode_seconds > 0
    assert aggregate([m], k=k, baseline=[plain]).speedup > 0
