"""Draft trees with exact score ties: a confident drafter whose top log-probability rounds to 0.0 (fp32, sooner in
bf16) gives a child the same path score as its parent, and a flat drafter gives siblings equal scores. The dynamic
tree must still be a valid, ancestor-closed tree in topological order, and decoding with it must stay lossless for
every verifier that takes trees."""

from __future__ import annotations

import pytest
import torch
from tests.decoding_helpers import ModelDrafter, _TestDrafter, naive_greedy, random_llama
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specframe import api, plugins
from specframe.inference import TreeShape, generate

VOCAB = 64


def check_tree(draft: api.Draft, total: int, depth: int) -> None:
    """Valid (Draft's own checks passed when it was built), topological, closed under ancestors, within budget."""
    parents = draft.parent_index().tolist()
    assert len(parents) <= total
    depths: list[int] = []
    for node, parent in enumerate(parents):
        assert -1 <= parent < node, f"node {node} has parent {parent}"
        depths.append(1 if parent < 0 else depths[parent] + 1)
    assert max(depths, default=0) <= depth


def tied_rows(kind: str, n: int, vocab: int, favourite: list[int], dtype: torch.dtype) -> torch.Tensor:
    """[n, vocab] log-probs with exact ties: 'zero' puts 0.0 on a favourite token (and a rounded-away tail),
    'flat' is uniform, 'two' gives two tokens 0.0 each (a drafter returning unnormalised scores)."""
    if kind == "flat":
        rows = torch.full((n, vocab), -torch.log(torch.tensor(float(vocab))).item())
    else:
        rows = torch.full((n, vocab), -40.0)
        for i, f in enumerate(favourite):
            rows[i, f % vocab] = 0.0
            if kind == "two":
                rows[i, (f + 1) % vocab] = 0.0
    return rows.to(dtype)


@settings(max_examples=60)
@given(
    kind=st.sampled_from(["zero", "flat", "two"]),
    depth=st.integers(1, 6),
    top_k=st.integers(1, 4),
    total=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 50),
)
# a chain of 0.0 scores: every child ties its parent; the kept set must put each parent first
@example(kind="zero", depth=3, top_k=1, total=3, dtype=torch.float32, seed=0)
@example(kind="two", depth=4, top_k=2, total=7, dtype=torch.bfloat16, seed=1)
def test_dynamic_tree_with_tied_scores_is_a_valid_ancestor_closed_tree(kind, depth, top_k, total, dtype, seed):
    g = torch.Generator().manual_seed(seed)

    def expand(tree, nodes):
        favourite = [int(torch.randint(VOCAB, (1,), generator=g)) for _ in nodes]
        return tied_rows(kind, len(nodes), VOCAB, favourite, dtype)

    root = tied_rows(kind, 1, VOCAB, [seed], dtype)[0]
    draft = api.dynamic_tree(root, expand, depth=depth, top_k=top_k, total_tokens=total)
    check_tree(draft, total, depth)
    assert len(draft) == min(total, top_k + (depth - 1) * top_k * top_k)


def test_a_child_tied_with_its_parent_comes_after_it():
    """The smallest case of the bug: depth 2, one child per node, every score 0.0."""
    zero = torch.zeros(4)
    draft = api.dynamic_tree(zero, lambda tree, nodes: torch.zeros(len(nodes), 4), depth=3, top_k=1, total_tokens=3)
    assert draft.parent_index().tolist() == [-1, 0, 1]


class ConfidentDrafter(_TestDrafter):
    """Knows the target's greedy continuation and is certain of it: log-prob 0.0 for the right token (in ``dtype``),
    so every node on the right path ties its parent; the other tokens are tied with each other too."""

    def __init__(self, continuation: list[int], dtype: torch.dtype, wrong_first: bool = False) -> None:
        super().__init__()
        self.continuation, self.dtype, self.wrong_first = continuation, dtype, wrong_first

    def _row(self, path: list[int]) -> torch.Tensor:
        done = len(self.context) - self.prompt_len
        want = self.continuation[done : done + len(path) + 1]
        row = torch.full((VOCAB,), -60.0)
        if len(want) == len(path) + 1 and want[:-1] == path:
            right = want[-1]
            row[right] = 0.0
            if self.wrong_first:  # an equally confident wrong sibling, ordered before the right one by id
                row[(right - 1) % VOCAB] = 0.0
        return torch.log_softmax(row.to(self.dtype), -1) if self.dtype == torch.bfloat16 else row

    def propose(self, k, generator=None):
        path: list[int] = []
        for _ in range(k):
            path.append(int(self._row(path).float().argmax()))
        return api.Draft(tokens=torch.tensor(path, dtype=torch.long))

    def propose_tree(self, depth, top_k, total_tokens, generator=None):
        return api.dynamic_tree(
            self._row([]), lambda tree, nodes: torch.stack([self._row(tree.path_tokens(n)) for n in nodes]),
            depth=depth, top_k=top_k, total_tokens=total_tokens,
        )


class Bf16ModelDrafter(ModelDrafter):
    """A real (very peaked) model drafting in bf16: its top log-probabilities round to exactly 0.0."""

    @torch.no_grad()
    def _logprobs(self, paths):
        rows = [self.model(input_ids=torch.tensor([self.context + p])).logits[0, -1] for p in paths]
        out = torch.log_softmax(torch.stack(rows).to(torch.bfloat16), dim=-1)
        self.zero_tops = getattr(self, "zero_tops", 0) + int((out.amax(-1) == 0.0).sum())
        return out


TREE_VERIFIERS = [(name, {}) for name in ("greedy", "tree")]


def verifier(name, options):
    cls = plugins.get("verifier", name)
    return cls(cls.Options(**options))


def target():
    return random_llama(vocab=VOCAB, layers=1, hidden=32)


@pytest.mark.parametrize("which", TREE_VERIFIERS, ids=lambda w: w[0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("wrong_first", [False, True])
def test_decoding_with_tied_trees_is_lossless(which, dtype, wrong_first):
    prompt = [3, 14, 15, 9, 2]
    n = 20
    expected = naive_greedy(target(), prompt, n)
    drafter = ConfidentDrafter(expected, dtype, wrong_first)
    gen = generate(target(), torch.tensor(prompt), verifier(*which), drafter, tree=TreeShape(4, 2, 9),
                   max_new_tokens=n, eos_token_id=())
    assert gen.tokens == expected
    assert max(r.accepted for r in gen.rounds) >= 2  # the tied chain was really drafted and accepted


@pytest.mark.parametrize("which", TREE_VERIFIERS, ids=lambda w: w[0])
def test_a_bf16_model_drafter_with_rounded_zero_log_probs_is_lossless(which):
    prompt = [7, 1, 8]
    n = 16
    expected = naive_greedy(target(), prompt, n)
    drafter = Bf16ModelDrafter(random_llama(vocab=VOCAB, layers=1, hidden=32, seed=3, logit_scale=400.0))
    gen = generate(target(), torch.tensor(prompt), verifier(*which), drafter, tree=TreeShape(5, 3, 12),
                   max_new_tokens=n, eos_token_id=())
    assert gen.tokens == expected
    assert drafter.zero_tops >= 10  # the premise: bf16 rounded many top log-probs to exactly 0.0


def test_sampling_tree_verification_of_tied_trees_emits_valid_paths():
    """The tree verifier at temperature 1 takes tied trees too (losslessness in distribution is checked by
    tests/unit/test_sampling_distribution.py; here: valid rounds on trees with ties)."""
    prompt = [5, 6, 7]
    expected = naive_greedy(target(), prompt, 12)
    drafter = ConfidentDrafter(expected, torch.bfloat16, wrong_first=True)
    gen = generate(target(), torch.tensor(prompt), verifier("tree", {"temperature": 1.0}), drafter,
                   tree=TreeShape(4, 2, 9), max_new_tokens=12, eos_token_id=(), generator=torch.Generator().manual_seed(0))
    assert len(gen.tokens) == 12 and all(0 <= t < VOCAB for t in gen.tokens)
