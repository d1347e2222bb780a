"""Speculative sampling is lossless: the joint law of the first three emitted tokens equals the target's.

A small-vocabulary random Llama (sharpened so its distributions are far from uniform) is the target at temperature
1; its exact joint law over three tokens is enumerated. A stochastic drafter with q != p drafts chains or trees; the
empirical joint from speculative sampling must pass a chi-square test against the exact law (fixed seeds, cells with
small expectation pooled), and the same check must *fail* when the verifier's residual rule is deliberately broken,
so the test has the power to see a lossy rule.

Most checks drive the verifiers directly over a table of the target's logits (exact for every context that can
occur), which makes tens of thousands of samples cheap; one slow check runs the full engine with its KV cache.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from tests.decoding_helpers import random_llama

from specframe import api, plugins
from specframe.inference import TreeShape, generate
from specframe.testing.verifiers import chi_square_pvalue

VOCAB = 8
PROMPT = (1, 5, 2)
N_TOKENS = 3
THRESHOLD = 1e-3


def target_model():
    return random_llama(vocab=VOCAB, layers=2, hidden=32, seed=3, logit_scale=15.0)


@functools.lru_cache(maxsize=1)
def logit_table(max_len: int = 5) -> dict[tuple[int, ...], torch.Tensor]:
    """Target logits after PROMPT + s for every continuation s of length < max_len (batched, computed once)."""
    model = target_model()
    table = {}
    with torch.no_grad():
        for n in range(max_len):
            conts = list(itertools.product(range(VOCAB), repeat=n))
            ids = torch.tensor([PROMPT + c for c in conts])
            logits = model(input_ids=ids).logits[:, -1].float()
            table.update({c: row for c, row in zip(conts, logits)})
    return table


def exact_joint() -> torch.Tensor:
    table = logit_table()
    p = torch.zeros((VOCAB,) * N_TOKENS, dtype=torch.float64)
    for seq in itertools.product(range(VOCAB), repeat=N_TOKENS):
        prob = 1.0
        for i in range(N_TOKENS):
            prob *= torch.softmax(table[seq[:i]].double(), -1)[seq[i]].item()
        p[seq] = prob
    return p


@functools.lru_cache(maxsize=None)
def draft_probs(context: tuple[int, ...]) -> torch.Tensor:
    """The drafter's q after PROMPT + ``context``: a fixed random law per context, unrelated to the target's p."""
    g = torch.Generator().manual_seed(hash(context) % (2**31))
    return torch.softmax(2.0 * torch.randn(VOCAB, generator=g), -1)


def chain_draft(context, k, g):
    tokens, probs, ctx = [], [], tuple(context)
    for _ in range(k):
        q = draft_probs(ctx)
        t = int(torch.multinomial(q, 1, generator=g))
        tokens.append(t)
        probs.append(q)
        ctx += (t,)
    return api.Draft(tokens=torch.tensor(tokens), probs=torch.stack(probs))


def stochastic_tree(context, depth, width, g):
    """Every node gets ``width`` children drawn independently from its q (duplicates allowed)."""
    tokens, parents, probs, paths = [], [], [], {-1: tuple(context)}
    level = [-1]
    for _ in range(depth):
        nxt = []
        for parent in level:
            q = draft_probs(paths[parent])
            for t in torch.multinomial(q, width, replacement=True, generator=g).tolist():
                tokens.append(t)
                parents.append(parent)
                probs.append(q)
                paths[len(tokens) - 1] = paths[parent] + (t,)
                nxt.append(len(tokens) - 1)
        level = nxt
    return api.Draft(tokens=torch.tensor(tokens), parents=torch.tensor(parents), probs=torch.stack(probs))


@functools.lru_cache(maxsize=None)
def topk_tree(context, depth, width):
    """A deterministic EAGLE-2 tree from q (probs None: one-hot drafts)."""

    def expand(tree, nodes):
        return torch.stack([draft_probs(tuple(context) + tuple(tree.path_tokens(n))).log() for n in nodes])

    return api.dynamic_tree(draft_probs(tuple(context)).log(), expand, depth=depth, top_k=width, total_tokens=6)


def speculative_samples(verifier, propose, n: int, seed: int) -> list[tuple[int, ...]]:
    """What a speculative run over the logit table emits first (drafting from the prompt on)."""
    table = logit_table()
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        seq: tuple[int, ...] = ()
        while len(seq) < N_TOKENS:
            draft = propose(seq, g)
            parents = draft.parent_index().tolist()
            paths: list[tuple[int, ...]] = []
            for node, parent in enumerate(parents):
                paths.append((paths[parent] if parent >= 0 else seq) + (int(draft.tokens[node]),))
            logits = torch.stack([table[seq]] + [table[p] for p in paths])
            seq += tuple(verifier.verify(logits, draft, g).emitted.tolist())
        out.append(seq[:N_TOKENS])
    return out


class BrokenSampling(plugins.get("verifier", "sampling")):
    """The classic bug: after a rejection, resample from p instead of the residual."""

    @staticmethod
    def residual(p, q):
        return p


class BrokenTree(plugins.get("verifier", "tree")):
    """After a rejected sibling, keep p unchanged (neither residual nor zeroing)."""

    @staticmethod
    def residual(p, q):
        return p


def tree_sampling(cls=None):
    cls = cls or plugins.get("verifier", "tree")
    return cls(cls.Options(temperature=1.0))


# A broken rule gives p-values below 1e-100 at this size; the sound ones are deterministic under fixed seeds.
N = 3000


def test_target_is_far_from_uniform_and_q_differs_from_p():
    table = logit_table()
    p = torch.softmax(table[()], -1)
    assert p.max() > 0.25  # the closer to uniform, the less a lossy rule shows
    assert (p - draft_probs(())).abs().sum() > 0.5


def test_chain_speculative_sampling_matches_target_joint():
    verifier = plugins.get("verifier", "sampling")()
    samples = speculative_samples(verifier, lambda s, g: chain_draft(s, 2, g), N, seed=0)
    assert chi_square_pvalue(samples, exact_joint()) > THRESHOLD


def test_chain_with_broken_residual_fails_the_same_check():
    samples = speculative_samples(BrokenSampling(), lambda s, g: chain_draft(s, 2, g), N, seed=0)
    assert chi_square_pvalue(samples, exact_joint()) < THRESHOLD


def test_tree_sampling_with_stochastic_siblings_matches_target_joint():
    samples = speculative_samples(tree_sampling(), lambda s, g: stochastic_tree(s, 2, 2, g), N, seed=1)
    assert chi_square_pvalue(samples, exact_joint()) > THRESHOLD
    broken = speculative_samples(tree_sampling(BrokenTree), lambda s, g: stochastic_tree(s, 2, 2, g), N, seed=1)
    assert chi_square_pvalue(broken, exact_joint()) < THRESHOLD


def test_tree_sampling_with_deterministic_topk_tree_matches_target_joint():
    samples = speculative_samples(tree_sampling(), lambda s, g: topk_tree(tuple(s), 2, 3), N, seed=2)
    assert chi_square_pvalue(samples, exact_joint()) > THRESHOLD
    broken = speculative_samples(tree_sampling(BrokenTree), lambda s, g: topk_tree(tuple(s), 2, 3), N, seed=2)
    assert chi_square_pvalue(broken, exact_joint()) < THRESHOLD


class StochasticDrafter(api.Drafter):
    """Drafts from q (``draft_probs``) through the engine's drafter interface."""

    name = "stochastic-test"

    def feature_spec(self):
        return None

    def module(self):
        return torch.nn.Module()

    def supervision(self, example):
        raise NotImplementedError

    def loss(self, example, elements, segment, attention):
        raise NotImplementedError

    def start(self, prompt_ids, features):
        self.seq: tuple[int, ...] = ()

    def accept(self, emitted, features):
        self.seq += tuple(emitted.tolist())

    def propose(self, k, generator=None):
        return chain_draft(self.seq, k, generator)

    def propose_tree(self, depth, top_k, total_tokens, generator=None):
        return stochastic_tree(self.seq, depth, top_k, generator)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_engine_speculative_sampling_matches_target_joint(mode):
    model = target_model()
    verifier = plugins.get("verifier", "sampling")() if mode == "chain" else tree_sampling()
    g = torch.Generator().manual_seed(11)
    samples = []
    for _ in range(3000):
        kw = {"k": 2} if mode == "chain" else {"tree": TreeShape(depth=2, top_k=2, total_tokens=6)}
        gen = generate(model, torch.tensor(PROMPT), verifier, StochasticDrafter(None), max_new_tokens=N_TOKENS,
                       eos_token_id=(), generator=g, **kw)
        samples.append(tuple(gen.tokens))
    assert chi_square_pvalue(samples, exact_joint()) > THRESHOLD
