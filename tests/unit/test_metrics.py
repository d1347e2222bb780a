"""The metric definitions (docs/design.md section 8) on hand-computed cases and on real engine runs."""

from __future__ import annotations

import math

import pytest
import torch
from tests.decoding_helpers import OracleDrafter, RandomDrafter, naive_greedy, random_llama

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
    model = random_llama()
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


def test_chain_acceptance_is_the_mean_accepted_chain_not_the_product_of_accuracies():
    from specframe.metrics import chain_acceptance

    # anchor 0 hits depth 0 only, anchor 1 depth 1 only: both depths are right half the time, so the product formula
    # says 1 + 0.5 + 0.25 = 1.75, but greedy decoding accepts 1 token at anchor 0 and none at anchor 1: AL 1.5
    hits = torch.tensor([[1, 0], [0, 1]], dtype=torch.bool)
    c = chain_acceptance(hits)
    assert expected_acceptance_length([0.5, 0.5]) == 1.75
    assert c.acceptance_length == 1.5 and c.anchors == 2
    assert c.reached == (2, 1) and c.accepted == (1, 0) and c.conditional == [0.5, 0.0]
    # rows without a full chain (-1: a depth with no verdict) are left out; a chain stops at its first miss
    partial = torch.tensor([[1, 1, 0], [1, -1, 1], [0, 1, 1], [-1, -1, -1]])
    c = chain_acceptance(partial)
    assert c.anchors == 2 and c.acceptance_length == 1 + (2 + 0) / 2
    assert math.isnan(chain_acceptance(torch.full((3, 2), -1)).acceptance_length)


@pytest.mark.parametrize("name", ["peagle", "eagle3"])
def test_validation_chain_al_is_what_decoding_accepts_on_the_targets_own_continuation(tmp_path_factory, name):
    """Teacher-forced validation on the target's own greedy continuation: at every round's anchor the chain the
    engine's ``evaluate`` counts (consecutive depth-0.. hits) is exactly the number of draft tokens greedy decoding
    accepts there, so the validation AL over those anchors equals the measured AL."""
    from specframe import api
    from specframe.drafting.elements import full_grid
    from specframe.engine.segments import record_hits
    from specframe.metrics import chain_acceptance
    from tests.drafter_helpers import SMALL, features, overfit
    from tests.drafter_helpers import sharp_tiny_target as sharp_target

    torch.set_num_threads(1)
    target = sharp_target(tmp_path_factory.mktemp("chain"))
    greedy = plugins.get("verifier", "greedy")()
    prompt = torch.randint(7, target.config.vocab_size, (6,), generator=torch.Generator().manual_seed(1))
    new = 24
    plain = generate(target.model, prompt, greedy, max_new_tokens=new, eos_token_id=())
    ids = torch.cat([prompt, torch.tensor(plain.tokens)])
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[len(prompt):] = True
    doc = torch.zeros(len(ids), dtype=torch.long)
    torch.manual_seed(0)
    cls = plugins.get("drafter", name)
    drafter = cls(target.config, cls.Options(**SMALL[name]))
    drafter.prepare(target, [api.TrainingExample(ids, mask, doc)])
    example = api.TrainingExample(ids, mask, doc, features(target, ids, drafter))
    k = 4
    overfit(drafter, example, k, steps=40, lr=1e-2)  # hits at some anchors, misses at others
    drafter.module().eval()

    sup = drafter.supervision(example)
    elems = full_grid(sup.shape[0], k)
    segment = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
    builder = plugins.get("mask builder", "dense")()
    with torch.no_grad():
        terms = drafter.loss(example, elems, segment, api.SegmentAttention.build(builder, elems))
        spec = generate(target.model, prompt, greedy, drafter, k=k, max_new_tokens=new, eos_token_id=())
    assert spec.tokens == plain.tokens
    hits = record_hits(torch.full((elems.seq_len, k), -1, dtype=torch.long), elems, segment, sup, terms.hit)
    # drafter position a reads token a + 1 and its depth d predicts token a + d + 2 (docs/design.md section 8): the
    # round whose last committed token sits at index t drafts from anchor t - 1
    last = len(prompt)  # the prefill's token
    rounds = []
    for r in spec.rounds:
        row = hits[last - 1]
        if r.drafted == k and bool((row >= 0).all()):
            rounds.append((last - 1, r.accepted))
        last += r.emitted
    assert len(rounds) >= 4
    chain = {a: int(hits[a].clamp(min=0).cumprod(0).sum()) for a, _ in rounds}
    assert [chain[a] for a, _ in rounds] == [acc for _, acc in rounds]
    assert any(acc > 0 for _, acc in rounds) and any(acc < k for _, acc in rounds)
    visited = chain_acceptance(hits[[a for a, _ in rounds]])
    assert visited.acceptance_length == pytest.approx(1 + sum(acc for _, acc in rounds) / len(rounds))
