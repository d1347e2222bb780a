"""The reference engine: speculative greedy output equals plain greedy output, token for token, for every verifier,
chains and trees; acceptance length and forward counts are honest; features reach the drafter aligned."""

from __future__ import annotations

import functools

import pytest
import torch
from tests.decoding_helpers import ModelDrafter, OracleDrafter, RandomDrafter, WrongDrafter, naive_greedy, random_llama
from hypothesis import given, settings
from hypothesis import strategies as st

from specframe import api, plugins
from specframe.errors import PluginError, UsageError
from specframe.inference import TreeShape, generate
from specframe.features import FeatureSpec
from specframe.metrics import PromptMetrics

VOCAB = 256
N_NEW = 24


def verifier(name: str, **options):
    cls = plugins.get("verifier", name)
    return cls(cls.Options(**options)) if options else cls()


GREEDY_VERIFIERS = [("greedy", {}), ("tree", {}), ("sampling", {"temperature": 0.0})]
TREE_VERIFIERS = [("greedy", {}), ("tree", {})]


@functools.lru_cache(maxsize=256)
def reference(prompt: tuple[int, ...], n: int = N_NEW) -> list[int]:
    return naive_greedy(random_llama(), list(prompt), n)


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12).map(tuple)


def run(prompt, drafter=None, name="greedy", options=None, **kw):
    kw.setdefault("max_new_tokens", N_NEW)
    kw.setdefault("eos_token_id", ())
    return generate(random_llama(), torch.tensor(prompt), verifier(name, **(options or {})), drafter, **kw)


def make_drafter(kind: str, prompt, seed: int):
    if kind == "oracle":
        return OracleDrafter(reference(prompt), VOCAB, seed)
    if kind == "wrong":
        return WrongDrafter(reference(prompt), VOCAB, seed)
    if kind == "model":
        return ModelDrafter(random_llama(layers=1, hidden=32, seed=7 + seed % 2))
    return RandomDrafter(VOCAB, seed)


def test_plain_engine_matches_cacheless_greedy():
    for prompt in [(1,), (5, 9, 200), tuple(range(40, 52))]:
        gen = run(prompt)
        assert gen.tokens == reference(prompt)
        assert gen.target_forwards == N_NEW  # prefill yields the first token, then one forward per token
        assert [r.emitted for r in gen.rounds] == [1] * (N_NEW - 1)


@settings(max_examples=25)
@given(prompt=prompts, k=st.integers(1, 6), kind=st.sampled_from(["oracle", "wrong", "random", "model"]),
       which=st.sampled_from(GREEDY_VERIFIERS), seed=st.integers(0, 3))
def test_speculative_chain_equals_plain_greedy(prompt, k, kind, which, seed):
    gen = run(prompt, make_drafter(kind, prompt, seed), which[0], which[1], k=k)
    assert gen.tokens == reference(prompt)
    assert all(0 <= r.accepted <= r.nodes <= k and 1 <= r.emitted <= r.accepted + 1 for r in gen.rounds)


@settings(max_examples=25)
@given(prompt=prompts, depth=st.integers(1, 5), top_k=st.integers(1, 4), total=st.integers(1, 16),
       kind=st.sampled_from(["oracle", "wrong", "random", "model"]), which=st.sampled_from(TREE_VERIFIERS),
       seed=st.integers(0, 3))
def test_speculative_tree_equals_plain_greedy(prompt, depth, top_k, total, kind, which, seed):
    shape = TreeShape(depth=depth, top_k=top_k, total_tokens=total)
    gen = run(prompt, make_drafter(kind, prompt, seed), which[0], which[1], tree=shape)
    assert gen.tokens == reference(prompt)
    assert all(r.nodes <= total and r.drafted <= depth and r.accepted <= r.drafted for r in gen.rounds)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("which", GREEDY_VERIFIERS)
def test_oracle_chain_reaches_k_plus_one(k, which):
    prompt = (3, 1, 4, 1, 5)
    rounds = 4
    n = 1 + rounds * (k + 1)
    gen = run(prompt, OracleDrafter(naive_greedy(random_llama(), list(prompt), n), VOCAB), which[0], which[1], k=k,
              max_new_tokens=n)
    metrics = PromptMetrics.of(gen)
    assert metrics.acceptance_length == k + 1
    assert gen.target_forwards == 1 + rounds
    assert [r.accepted for r in gen.rounds] == [k] * rounds


@pytest.mark.parametrize("which", GREEDY_VERIFIERS)
def test_always_wrong_chain_has_al_one(which):
    prompt = (3, 1, 4, 1, 5)
    gen = run(prompt, WrongDrafter(reference(prompt), VOCAB), which[0], which[1], k=4)
    assert gen.tokens == reference(prompt)
    assert PromptMetrics.of(gen).acceptance_length == 1
    assert gen.target_forwards == N_NEW
    assert [r.nodes for r in gen.rounds] == [min(4, N_NEW - 1 - i) for i in range(N_NEW - 1)]


@pytest.mark.parametrize("which", TREE_VERIFIERS)
def test_oracle_tree_reaches_depth_plus_one_and_wrong_tree_has_al_one(which):
    prompt = (2, 7, 1, 8)
    depth, top_k, rounds = 4, 3, 3
    n = 1 + rounds * (depth + 1)
    cont = naive_greedy(random_llama(), list(prompt), n)
    shape = TreeShape(depth=depth, top_k=top_k, total_tokens=depth * top_k)
    gen = run(prompt, OracleDrafter(cont, VOCAB, seed=1), which[0], which[1], tree=shape, max_new_tokens=n)
    assert gen.tokens == cont
    assert PromptMetrics.of(gen).acceptance_length == depth + 1
    assert gen.target_forwards == 1 + rounds
    wrong = run(prompt, WrongDrafter(cont, VOCAB), which[0], which[1], tree=shape, max_new_tokens=n)
    assert wrong.tokens == cont
    assert PromptMetrics.of(wrong).acceptance_length == 1
    assert max(r.drafted for r in wrong.rounds) == depth and max(r.nodes for r in wrong.rounds) == top_k + depth - 1


def test_model_drafter_with_dynamic_tree_accepts_something():
    # The target drafting for itself: the greedy path is always the most confident first child.
    prompt = (10, 20, 30)
    gen = run(prompt, ModelDrafter(random_llama()), "tree", tree=TreeShape(depth=3, top_k=2, total_tokens=8))
    assert gen.tokens == reference(prompt)
    assert PromptMetrics.of(gen).acceptance_length > 2


def test_forwards_are_counted_by_the_model_itself():
    model = random_llama()
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        for drafter, kw in [(None, {}), (RandomDrafter(VOCAB), {"k": 3}),
                            (RandomDrafter(VOCAB), {"tree": TreeShape(3, 2, 6)})]:
            calls.clear()
            gen = generate(model, torch.tensor([4, 5, 6]), verifier("greedy"), drafter, max_new_tokens=15,
                           eos_token_id=(), **kw)
            assert len(calls) == gen.target_forwards == 1 + len(gen.rounds)
    finally:
        handle.remove()


@pytest.mark.parametrize("eos_at", [0, 3, 10])
def test_eos_stops_like_plain_decoding(eos_at):
    prompt = (9, 8, 7)
    cont = reference(prompt)
    eos = cont[eos_at]
    expected = cont[: cont.index(eos) + 1]
    for drafter, kw in [(None, {}), (OracleDrafter(cont, VOCAB), {"k": 5}),
                        (OracleDrafter(cont, VOCAB), {"tree": TreeShape(4, 2, 8)})]:
        gen = run(prompt, drafter, eos_token_id=eos, **kw)
        assert gen.tokens == expected and gen.stop_reason == "eos"


class FeatureDrafter(RandomDrafter):
    def feature_spec(self):
        return FeatureSpec(aux_layers=(0, 1), final_hidden=True)


@pytest.mark.parametrize("tree", [None, TreeShape(3, 3, 9)])
def test_drafter_gets_target_features_aligned_with_emitted_tokens(tree):
    model = random_llama()
    prompt = [11, 12, 13, 14]
    drafter = FeatureDrafter(VOCAB, seed=5)
    gen = generate(model, torch.tensor(prompt), verifier("greedy"), drafter, k=3, tree=tree, max_new_tokens=20,
                   eos_token_id=())
    seq = prompt + gen.tokens
    with torch.no_grad():
        out = model(input_ids=torch.tensor([seq]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[0][0], out.hidden_states[1][0]], dim=-1)
    final = out.hidden_states[-1][0]
    torch.testing.assert_close(model.lm_head(final), out.logits[0])  # "final hidden" is after the norm
    # the first accept pairs the prefill's token with the last prompt position; each later token with its predecessor
    position = len(prompt) - 1
    for emitted, features in drafter.calls:
        rows = list(range(position, position + len(emitted)))
        assert set(features) == {"aux_hidden", "final_hidden"}
        torch.testing.assert_close(features["aux_hidden"], aux[rows], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(features["final_hidden"], final[rows], atol=1e-4, rtol=1e-4)
        position += len(emitted)
    # no accept after the round that ends the run
    assert sum(len(e) for e, _ in drafter.calls) == len(gen.tokens) - gen.rounds[-1].emitted


def test_ngram_drafter_is_lossless_and_accepts_on_repetition():
    ngram = plugins.get("drafter", "ngram")
    # Random tiny models fall into loops under greedy decoding, which prompt lookup then predicts.
    prompt = tuple(range(30, 40)) * 2
    n = 60
    cont = naive_greedy(random_llama(), list(prompt), n)
    gen = run(prompt, ngram(None), k=4, max_new_tokens=n)
    assert gen.tokens == cont
    assert PromptMetrics.of(gen).acceptance_length > 1.5
    tree = run(prompt, ngram(None), "tree", tree=TreeShape(4, 2, 8), max_new_tokens=n)
    assert tree.tokens == cont


def test_ngram_lookup_and_refuses_training():
    from specframe_plugins.ngram import NgramOptions, lookup

    assert lookup([1, 2, 3, 9, 1, 2, 3], 3, 3, 1) == [9, 1, 2]
    assert lookup([5, 1, 2, 7, 7, 1, 2], 2, 3, 1) == [7, 7]  # the 2-gram [1, 2] wins over the 1-gram [2]
    assert lookup([4, 2, 6, 2, 8, 2], 1, 1, 1) == [8]  # the latest occurrence
    assert lookup([1, 2, 3], 4, 3, 1) == []
    assert lookup([1, 2, 3], 4, 3, 2) == []
    with pytest.raises(UsageError):
        NgramOptions(n_max=1, n_min=2)
    drafter = plugins.get("drafter", "ngram")(None)
    assert drafter.feature_spec() is None and not list(drafter.module().parameters())
    with pytest.raises(api.SpecframeError, match="cannot be trained"):
        drafter.supervision(None)


def test_sampling_runs_are_reproducible_and_plain_sampling_matches_the_verifier_law():
    a = run((1, 2, 3), RandomDrafter(VOCAB, 1), "sampling", k=3, generator=torch.Generator().manual_seed(3))
    b = run((1, 2, 3), RandomDrafter(VOCAB, 1), "sampling", k=3, generator=torch.Generator().manual_seed(3))
    assert a.tokens == b.tokens
    c = run((1, 2, 3), None, "sampling", generator=torch.Generator().manual_seed(4))
    assert c.tokens != reference((1, 2, 3))  # temperature 1 over a near-uniform random model is not greedy


def test_engine_refuses_bad_inputs():
    with pytest.raises(UsageError, match="cannot verify trees"):
        run((1,), RandomDrafter(VOCAB), "sampling", tree=TreeShape(2, 2, 4))

    class Greedy(RandomDrafter):
        def propose(self, k, generator=None):
            return api.Draft(tokens=torch.arange(k + 2))

    with pytest.raises(PluginError, match="more than"):
        run((1,), Greedy(VOCAB), k=2)

    class BadTree(RandomDrafter):
        def propose_tree(self, depth, top_k, total_tokens, generator=None):
            return api.Draft(tokens=torch.arange(2), parents=torch.tensor([1, -1]))

    with pytest.raises(PluginError, match="drafter '.*': malformed draft: node 0 has parent 1"):
        run((1,), BadTree(VOCAB), tree=TreeShape(2, 2, 4))

    class OutOfVocab(RandomDrafter):
        def propose(self, k, generator=None):
            return api.Draft(tokens=torch.full((k,), VOCAB + 3))

    with pytest.raises(PluginError, match=f"proposed token {VOCAB + 3}, outside the target's {VOCAB}-token"):
        run((1,), OutOfVocab(VOCAB), k=2)

    class FloatTokens(RandomDrafter):
        def propose(self, k, generator=None):
            return api.Draft(tokens=torch.zeros(k))

    with pytest.raises(PluginError, match="tokens must be a 1-D integer tensor"):
        run((1,), FloatTokens(VOCAB), k=2)

    class Crashes(RandomDrafter):
        def propose(self, k, generator=None):
            return [][0]

    with pytest.raises(PluginError, match="raised IndexError in propose"):
        run((1,), Crashes(VOCAB), k=2)


@pytest.mark.parametrize("lie", ["off-path", "wrong-token", "too-many"])
def test_a_lying_verifier_is_caught_before_anything_is_emitted(monkeypatch, lie):
    """A verifier plugin whose Verification contradicts the draft (a silent wrong output otherwise) is named."""
    base = plugins.get("verifier", "greedy")

    class Liar(base):
        def verify(self, logits, draft, generator=None):
            good = super().verify(logits, draft, generator)
            if len(draft) < 2:  # the prefill's verification has no draft to lie about
                return good
            if lie == "off-path":
                return api.Verification(torch.tensor([1]), torch.tensor([int(draft.tokens[1]), 0]))
            if lie == "wrong-token":
                return api.Verification(torch.tensor([0]), torch.tensor([int(draft.tokens[0]) + 1, 0]))
            return api.Verification(good.accepted, torch.cat([good.emitted, good.emitted[-1:]]))

    verifier = Liar(Liar.Options())
    expected = {"off-path": "not a path from the root", "wrong-token": "whose draft token is",
                "too-many": "tokens for"}[lie]
    with pytest.raises(PluginError, match=f"verifier 'greedy' .*{expected}"):
        generate(random_llama(), torch.tensor([1, 2]), verifier, RandomDrafter(VOCAB), k=3, max_new_tokens=8,
                 eos_token_id=())


def test_default_propose_tree_is_the_chain():
    drafter = OracleDrafter(reference((5, 6)), VOCAB)
    drafter.start(torch.tensor([5, 6]), {})
    chain = drafter.propose(3)
    assert api.Drafter.propose_tree(drafter, 3, 4, 10).tokens.tolist() == chain.tokens.tolist()


# every learned drafter decoding losslessly through the engine: the drafter contract, tests/contract/test_contract.py


def test_the_tree_kv_path_copy_indexes_each_cache_on_its_own_device(monkeypatch):
    """GPU-path review item 6: under ``--device-map`` each layer's cache lives on its layer's GPU, not on
    ``model.device``. The KV path copy must build its row index where each cache tensor is: here ``model.device``
    says 'meta' while the caches are on the CPU (an index on 'meta' made index_select fail)."""
    from specframe.inference.target import TargetSession

    model = random_llama()
    session = TargetSession(model)
    session.prefill(torch.tensor([5, 6, 7]))
    base = session.length
    # root children 0 and 1, node 2 under node 1; the accepted path 1 -> 2 is not a prefix of the rows: a path copy
    session.verify(9, torch.tensor([11, 12, 13]), torch.tensor([-1, -1, 1]))
    rows = [base, base + 2, base + 3]
    want = [(layer.keys[:, :, rows].clone(), layer.values[:, :, rows].clone()) for layer in session.cache.layers]
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("meta")))
    session.keep([1, 2])
    assert session.length == base + 3
    for layer, (keys, values) in zip(session.cache.layers, want, strict=True):
        assert layer.keys.device.type == "cpu"
        assert torch.equal(layer.keys[:, :, base:], keys) and torch.equal(layer.values[:, :, base:], values)


class Budgeting(type(verifier("greedy"))):
    """A greedy verifier that drafts by a fixed budget pattern (API 11) and records what the engine reports."""

    def __init__(self, budgets, k):
        super().__init__()
        self.budgets, self.k, self.asked, self.seen = list(budgets), k, 0, []

    def draft_budget(self, k):
        assert k == self.k
        n = self.budgets[self.asked % len(self.budgets)]
        self.asked += 1
        return n

    def observe(self, cost):
        self.seen.append(cost)


class Counting(OracleDrafter):
    def __init__(self, *args):
        super().__init__(*args)
        self.proposed = []

    def propose(self, k, generator=None):
        self.proposed.append(k)
        return super().propose(k, generator)


@pytest.mark.parametrize("kind", ["oracle", "random"])
def test_a_budget_of_zero_is_a_plain_step_and_every_round_is_reported(kind):
    """API 11: ``draft_budget`` 0 runs the round without drafting (no ``propose``; the target's forward over the
    pending token alone), a smaller budget asks the drafter for that many, the output stays plain greedy decoding's,
    and ``observe`` hears of every round with what the ``Round`` records. Fails when the engine drafts anyway, ignores
    the budget, skips a report or mixes up its fields."""
    prompt = (5, 9, 200, 7)
    reference_ = reference(prompt)
    drafter = Counting(reference_, VOCAB) if kind == "oracle" else RandomDrafter(VOCAB, 3)
    budgets = [0, 4, 0, 0, 2]
    v = Budgeting(budgets, 4)
    gen = generate(random_llama(), torch.tensor(prompt), v, drafter, k=4, max_new_tokens=N_NEW, eos_token_id=())
    assert gen.tokens == reference_
    planned = [budgets[i % len(budgets)] for i in range(len(gen.rounds))]
    assert all(r.nodes <= b for r, b in zip(gen.rounds, planned))
    assert any(r.nodes == 0 for r in gen.rounds) and any(r.nodes for r in gen.rounds)
    assert len(v.seen) == len(gen.rounds) == v.asked
    for cost, r, b in zip(v.seen, gen.rounds, planned):
        assert (cost.verified, cost.accepted) == (r.nodes, r.accepted) or r is gen.rounds[-1]
        assert cost.drafted <= b and cost.target_seconds > 0
        assert (cost.draft_seconds == 0.0) == (b == 0)
    if kind == "oracle":
        assert drafter.proposed == [b for b in planned if b]
        assert [r.nodes for r in gen.rounds[:-1]] == planned[:-1]  # the oracle drafts what it is asked for


@pytest.mark.parametrize("lie", [5, -1, True, 2.0, None])
def test_a_budget_outside_0_to_k_is_refused_naming_the_verifier(lie):
    v = Budgeting([lie], 4)
    with pytest.raises(PluginError, match=rf"verifier 'greedy' budgeted {lie!r} draft tokens for a round of at most 4"):
        generate(random_llama(), torch.tensor((1, 2, 3)), v, RandomDrafter(VOCAB, 0), k=4, max_new_tokens=4,
                 eos_token_id=())
