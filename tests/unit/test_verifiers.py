"""Verifiers on hand-made logits, the target sampling law, and the EAGLE-2 dynamic tree construction."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specframe import api, plugins
from specframe.drafting.draft_tree import ancestor_mask, node_depths

V = 6


def make(name, **options):
    cls = plugins.get("verifier", name)
    return cls(cls.Options(**options)) if options else cls()


def logits_with_argmax(best: list[int]) -> torch.Tensor:
    out = torch.zeros(len(best), V)
    out[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return out


@pytest.mark.parametrize("name,options", [("greedy", {}), ("tree", {}), ("sampling", {"temperature": 0.0})])
def test_greedy_chain_acceptance(name, options):
    v = make(name, **options)
    logits = logits_with_argmax([1, 2, 3, 4])
    full = v.verify(logits, api.Draft(torch.tensor([1, 2, 3])))
    assert full.accepted.tolist() == [0, 1, 2] and full.emitted.tolist() == [1, 2, 3, 4]  # bonus token
    partial = v.verify(logits, api.Draft(torch.tensor([1, 5, 3])))
    assert partial.accepted.tolist() == [0] and partial.emitted.tolist() == [1, 2]  # correction
    none = v.verify(logits[:1], api.Draft(torch.zeros(0, dtype=torch.long)))
    assert none.accepted.tolist() == [] and none.emitted.tolist() == [1]


@pytest.mark.parametrize("name", ["greedy", "tree"])
def test_greedy_tree_follows_the_matching_branch(name):
    # root -> {0: 4, 1: 1}; 1 -> {2: 0, 3: 2}; 3 -> {4: 5}
    draft = api.Draft(torch.tensor([4, 1, 0, 2, 5]), parents=torch.tensor([-1, -1, 1, 1, 3]))
    logits = logits_with_argmax([1, 9 % V, 2, 3, 2, 0])  # rows: root, node0..node4
    out = make(name).verify(logits, draft)
    assert out.accepted.tolist() == [1, 3] and out.emitted.tolist() == [1, 2, 2]


random_trees = st.integers(1, 12).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, V - 1), min_size=n, max_size=n),
        st.tuples(*[st.integers(-1, i - 1) for i in range(n)]),
        st.integers(0, 2**31 - 1),
    )
)


@settings(max_examples=100)
@given(random_trees)
def test_tree_verifier_agrees_with_greedy_verifier_on_random_trees(case):
    tokens, parents, seed = case
    draft = api.Draft(torch.tensor(tokens), parents=torch.tensor(parents))
    logits = torch.randn(len(tokens) + 1, V, generator=torch.Generator().manual_seed(seed))
    a, b = make("greedy").verify(logits, draft), make("tree").verify(logits, draft)
    assert a.accepted.tolist() == b.accepted.tolist() and a.emitted.tolist() == b.emitted.tolist()
    # the accepted nodes form a root-to-node path and every accepted token is the argmax of its parent's row
    prev = -1
    for node in a.accepted.tolist():
        assert parents[node] == prev and tokens[node] == int(logits[prev + 1].argmax())
        prev = node
    assert a.emitted[-1] == int(logits[prev + 1].argmax())


@settings(max_examples=60)
@given(random_trees, st.booleans())
def test_sampling_tree_verifier_emits_a_path_plus_one_token(case, stochastic):
    tokens, parents, seed = case
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(len(tokens), V, generator=g), -1) if stochastic else None
    draft = api.Draft(torch.tensor(tokens), parents=torch.tensor(parents), probs=probs)
    out = make("tree", temperature=1.0).verify(torch.randn(len(tokens) + 1, V, generator=g), draft, g)
    prev = -1
    for node in out.accepted.tolist():
        assert parents[node] == prev
        prev = node
    assert out.emitted[:-1].tolist() == [tokens[i] for i in out.accepted.tolist()]


def test_sampling_accepts_always_when_q_equals_p_and_never_where_p_is_zero():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g)
    p = torch.softmax(logits, -1)
    v = make("sampling")
    for _ in range(50):
        tokens = torch.stack([torch.multinomial(p[i], 1, generator=g)[0] for i in range(3)])
        out = v.verify(logits, api.Draft(tokens, probs=p[:3]), g)
        assert out.accepted.tolist() == [0, 1, 2]
    masked = logits.clone()
    masked[0, 2] = float("-inf")  # p(2) = 0 at the first slot
    q = torch.zeros(1, V)
    q[0, 2] = 1.0
    for _ in range(50):
        out = v.verify(masked, api.Draft(torch.tensor([2]), probs=q), g)
        assert out.accepted.tolist() == [] and out.emitted.item() != 2


def test_sampling_verifier_refuses_trees():
    with pytest.raises(api.UsageError, match="chains"):
        make("sampling").verify(torch.zeros(3, V), api.Draft(torch.tensor([1, 2]), parents=torch.tensor([-1, -1])))


def test_sampling_is_reproducible_with_a_seeded_generator():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    draft = api.Draft(torch.tensor([1, 2, 3, 4, 5]))
    runs = [make("sampling").verify(logits, draft, torch.Generator().manual_seed(7)).emitted.tolist() for _ in range(2)]
    assert runs[0] == runs[1]


def test_residual_rule():
    residual = plugins.get("verifier", "sampling").residual
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    torch.testing.assert_close(residual(p, q), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual(p, torch.tensor([0.0, 1.0, 0.0])), torch.tensor([5 / 7, 0.0, 2 / 7]))
    torch.testing.assert_close(residual(p, p), p)  # measure-zero case: fall back to p


def test_sampling_distribution_filters():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    torch.testing.assert_close(api.sampling_distribution(logits), torch.softmax(logits, -1))
    torch.testing.assert_close(api.sampling_distribution(logits, 0.0), torch.tensor([0.0, 0.0, 0.0, 1.0]))
    torch.testing.assert_close(api.sampling_distribution(logits, 2.0), torch.softmax(logits / 2, -1))
    top2 = api.sampling_distribution(logits, 1.0, top_k=2)
    torch.testing.assert_close(top2, torch.tensor([0.0, 0.0, 1.0, math.e]) / (1 + math.e))
    nucleus = api.sampling_distribution(logits, 1.0, top_p=0.7)  # 0.64 alone is short of 0.7; 0.64 + 0.24 is not
    assert nucleus.nonzero().flatten().tolist() == [2, 3]
    torch.testing.assert_close(nucleus.sum(), torch.tensor(1.0))
    with pytest.raises(api.UsageError):
        api.sampling_distribution(logits, -1.0)


def test_ancestor_mask_and_depths():
    parents = torch.tensor([-1, -1, 0, 2, 1])
    assert node_depths(parents).tolist() == [1, 1, 2, 3, 2]
    mask = ancestor_mask(parents)
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 3, 4]  # node 3: root, 0, 2, itself
    assert mask[5].nonzero().flatten().tolist() == [0, 2, 5]
    with pytest.raises(ValueError):
        node_depths(torch.tensor([1, -1]))


def fixed_expander(seed: int, vocab: int = 12):
    """Per-path log-probs from a seeded table, so a brute-force reference can recompute every path score."""

    def logprobs(path: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((seed,) + path) % (2**31))
        return torch.log_softmax(3 * torch.randn(vocab, generator=g), -1)

    calls = []

    def expand(tree, nodes):
        calls.append(list(nodes))
        return torch.stack([logprobs(tuple(tree.path_tokens(n))) for n in nodes])

    return logprobs, expand, calls


def brute_force_eagle2(logprobs, depth, top_k, total):
    """EAGLE-2 written out level by level over explicit paths (scores as sums of log-probs)."""
    first = logprobs(())
    v, t = first.topk(top_k)
    nodes = [((int(tok),), float(val)) for val, tok in zip(v, t)]
    frontier = list(nodes)
    for _ in range(depth - 1):
        frontier = sorted(frontier, key=lambda n: -n[1])[:top_k]
        children = []
        for path, score in frontier:
            v, t = logprobs(path).topk(top_k)
            children += [(path + (int(tok),), score + float(val)) for val, tok in zip(v, t)]
        nodes += children
        frontier = sorted(children, key=lambda n: -n[1])[:top_k]
    return {path for path, _ in sorted(nodes, key=lambda n: (-n[1], len(n[0])))[:total]}


@settings(max_examples=40)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 30), st.integers(0, 1000))
def test_dynamic_tree_matches_brute_force_eagle2(depth, top_k, total, seed):
    logprobs, expand, calls = fixed_expander(seed)
    draft = api.dynamic_tree(logprobs(()), expand, depth=depth, top_k=top_k, total_tokens=total)
    parents = draft.parent_index().tolist()
    assert all(-1 <= p < i for i, p in enumerate(parents))  # topological, closed under ancestors
    assert len(calls) == depth - 1 and all(len(c) <= top_k for c in calls)
    assert draft.probs is None and len(draft) <= total
    paths = []
    for node, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (int(draft.tokens[node]),))
    assert set(paths) == brute_force_eagle2(logprobs, depth, top_k, total)
    scores = [sum(float(logprobs(p[:i])[p[i]]) for i in range(len(p))) for p in paths]
    assert all(a >= b - 1e-5 for a, b in zip(scores, scores[1:]))  # siblings (and all nodes) by confidence
    full = top_k + (depth - 1) * top_k * top_k
    assert len(draft) == min(total, full)


SAMPLERS = [name for name in ("sampling", "tree", "scheduled") if name in plugins.load().names("verifier")]


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("option,value,rule", [
    ("temperature", -0.5, "a number >= 0"), ("temperature", float("inf"), "a number >= 0"),
    ("temperature", True, "a number >= 0"), ("top_k", -1, "an integer >= 0"), ("top_k", 2.5, "an integer >= 0"),
    ("top_p", 0.0, r"in \(0, 1\]"), ("top_p", 1.5, r"in \(0, 1\]"), ("top_p", "0.5", r"in \(0, 1\]"),
])
def test_sampling_options_are_refused_when_the_verifier_is_built(name, option, value, rule):
    """``api.SamplingFields`` (API 15): what ``sampling_distribution`` would refuse at the first verification (after
    the target has loaded) is refused when the options are built, naming the verifier and the option."""
    options = plugins.get("verifier", name).Options
    with pytest.raises(api.UsageError, match=rf"{name} option '{option}' must be {rule}"):
        options(**{option: value})
    options(temperature=0.0, top_k=5, top_p=1.0)  # the edges are kept


@pytest.mark.parametrize("name", SAMPLERS)
def test_a_sampling_verifiers_law_is_the_targets(name):
    verifier = make(name, temperature=0.7, top_k=5, top_p=0.9)
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(verifier.target(logits), api.sampling_distribution(logits, 0.7, 5, 0.9))
