"""The verifier contract, ``VerifierContract``: what the core relies on from every verifier, as pytest tests a
verifier's author subclasses (tests/contract/test_verifier_contract.py runs it on every registered one):

    from specframe.testing import VerifierContract

    class TestMyVerifier(VerifierContract):
        verifier = "mine"               # a registered name, or the class itself
        options = {"temperature": 1.0}

A verifier must not change the target's output (docs/design.md section 5): a greedy one (``Verifier.greedy``) emits
exactly plain greedy decoding's tokens, checked through the reference engine with drafts that are often right and
often wrong, chains and (where it verifies them) trees; a sampling one emits the target's law, checked by a
chi-square test of the first tokens' joint law, enumerated exactly on a tiny 8-token target, against speculative runs
with sampled drafts, argmax drafts, trees and no drafts at all. The runs call it as the engine does: ``bind`` at the
start of a decode, ``draft_budget`` before drafting, ``schedule`` before the target's forward, ``verify`` through
``api.verify`` (which checks the result against the draft), ``observe`` after the round; every random draw from one
seeded generator, so a run repeats.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, ClassVar

import pytest
import torch

from specframe import api
from specframe.testing.components import build_component, component_class

VOCAB = 8
PROMPT = (1, 5, 2)
N_TOKENS = 3  # the joint law checked: the first three emitted tokens (8^3 cells)
TABLE_DEPTH = 4  # contexts a run reads: up to two emitted tokens and a two-token draft


class TinyTarget:
    """A seeded random Llama of ``VOCAB`` tokens (2 layers, width 32), its lm_head sharpened so its laws are far from
    uniform (a rule that is slightly off shows), and its next-token logits after any prompt, computed once each
    (every continuation of ``PROMPT`` up to ``TABLE_DEPTH`` tokens in a few batched forwards up front)."""

    def __init__(self) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
                             tie_word_embeddings=False)
        with torch.random.fork_rng():  # leaves the caller's global generator as it was
            torch.manual_seed(3)
            self.model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            self.model.lm_head.weight.mul_(15.0)
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}
        with torch.no_grad():
            for n in range(TABLE_DEPTH + 1):
                continuations = list(itertools.product(range(VOCAB), repeat=n))
                ids = torch.tensor([PROMPT + c for c in continuations])
                rows = self.model(input_ids=ids).logits[:, -1].float()
                self._logits.update({PROMPT + c: row for c, row in zip(continuations, rows)})

    def logits(self, ids: tuple[int, ...]) -> torch.Tensor:
        """The target's logits [VOCAB] for the token after ``ids``."""
        if ids not in self._logits:
            with torch.no_grad():
                self._logits[ids] = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        return self._logits[ids]

    def greedy(self, prompt: tuple[int, ...], n: int) -> list[int]:
        """Plain greedy decoding of ``n`` tokens, one forward over the whole sequence per token (no cache)."""
        seq = tuple(prompt)
        for _ in range(n):
            seq += (int(self.logits(seq).argmax()),)
        return list(seq[len(prompt):])


@functools.lru_cache(maxsize=1)
def tiny_target() -> TinyTarget:
    return TinyTarget()


class TableDrafter(api.Drafter):
    """Drafts from a law q per context that is often right and often wrong: half the target's argmax there, half a
    fixed random law of the context. ``sampled``: tokens drawn from q, ``Draft.probs`` = q; else q's argmax (always the
    target's: a draft greedy verification accepts) with ``probs`` None. ``confidence[i]`` is q's largest probability at
    slot i, known before token i is drawn (what a scheduling verifier may read)."""

    name = "contract-table-drafter"

    def __init__(self, target: TinyTarget, sampled: bool = True) -> None:
        super().__init__(None)
        self.target, self.sampled = target, sampled
        self.prompt: tuple[int, ...] = PROMPT
        self.seq: tuple[int, ...] = ()
        self._laws: dict[tuple[int, ...], torch.Tensor] = {}

    def law(self, context: tuple[int, ...]) -> torch.Tensor:
        """q after ``context`` (the whole sequence so far, prompt included), the same every time it is asked."""
        if context not in self._laws:
            seed = sum(t * VOCAB**i for i, t in enumerate(context)) + VOCAB ** len(context)
            noise = torch.softmax(2.0 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)), -1)
            best = torch.nn.functional.one_hot(self.target.logits(context).argmax(), VOCAB).float()
            self._laws[context] = 0.5 * best + 0.5 * noise
        return self._laws[context]

    def _draw(self, q: torch.Tensor, n: int, generator: torch.Generator | None) -> list[int]:
        if self.sampled:
            return torch.multinomial(q, n, replacement=True, generator=generator).tolist()
        return q.topk(n).indices.tolist()  # distinct siblings, most likely first

    def chain(self, context: tuple[int, ...], k: int, generator: torch.Generator | None) -> api.Draft:
        tokens, probs, confidence = [], [], []
        for _ in range(k):
            q = self.law(context)
            (token,) = self._draw(q, 1, generator)
            tokens.append(token)
            probs.append(q)
            confidence.append(float(q.max()))
            context += (token,)
        return api.Draft(tokens=torch.tensor(tokens, dtype=torch.long),
                         probs=torch.stack(probs) if self.sampled else None,
                         confidence=torch.tensor(confidence))

    def tree(self, context: tuple[int, ...], depth: int, width: int, generator: torch.Generator | None) -> api.Draft:
        """``width`` children per node, ``depth`` levels: independent draws from q (sampled) or q's top ``width``."""
        tokens, parents, probs, paths, level = [], [], [], {-1: context}, [-1]
        for _ in range(depth):
            following = []
            for parent in level:
                q = self.law(paths[parent])
                for token in self._draw(q, width, generator):
                    tokens.append(token)
                    parents.append(parent)
                    probs.append(q)
                    paths[len(tokens) - 1] = paths[parent] + (token,)
                    following.append(len(tokens) - 1)
            level = following
        return api.Draft(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents),
                         probs=torch.stack(probs) if self.sampled else None)

    # -- the engine's drafter protocol (``specframe.inference.engine.generate``)
    def feature_spec(self):
        return None

    def module(self) -> torch.nn.Module:
        return torch.nn.Module()

    def supervision(self, example):
        raise NotImplementedError("a drafting stand-in: it never trains")

    def loss(self, example, elements, segment, attention):
        raise NotImplementedError("a drafting stand-in: it never trains")

    def start(self, prompt_ids: torch.Tensor, features) -> None:
        self.prompt, self.seq = tuple(prompt_ids.tolist()), ()

    def accept(self, emitted: torch.Tensor, features) -> None:
        self.seq += tuple(emitted.tolist())

    def propose(self, k: int, generator: torch.Generator | None = None) -> api.Draft:
        return self.chain(self.prompt + self.seq, k, generator)

    def propose_tree(self, depth: int, top_k: int, total_tokens: int, generator: torch.Generator | None = None):
        return self.tree(self.prompt + self.seq, depth, top_k, generator)


def chi_square_pvalue(samples: list[tuple[int, ...]], exact: torch.Tensor) -> float:
    """The p-value of ``samples`` under the law ``exact`` (one cell per outcome), cells expecting fewer than 5 draws
    pooled into one."""
    counts = torch.zeros_like(exact)
    for s in samples:
        counts[s] += 1
    expected, observed = exact.flatten() * len(samples), counts.flatten()
    order = expected.argsort(descending=True)
    expected, observed = expected[order], observed[order]
    big = int((expected >= 5).sum())
    e = torch.cat([expected[:big], expected[big:].sum().view(1)])
    o = torch.cat([observed[:big], observed[big:].sum().view(1)])
    stat = ((o - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((e.numel() - 1) / 2), stat / 2))


class VerifierContract:
    """What every verifier must do, as pytest tests (collected from a subclass named Test*). ``verifier``: the
    registered name or the class; ``options``: option values; ``k``: draft tokens per chain round; ``samples``:
    decodes per law check; ``threshold``: the p-value below which the law check fails (the runs are seeded, so a
    verifier passes or fails the same way every time)."""

    verifier: ClassVar[Any] = None
    options: ClassVar[dict[str, Any]] = {}
    k: ClassVar[int] = 2
    samples: ClassVar[int] = 1500
    threshold: ClassVar[float] = 1e-3

    # -- helpers
    def build(self) -> api.Verifier:
        return build_component("verifier", self.verifier, self.options)

    def target_law(self, verifier: api.Verifier, logits: torch.Tensor) -> torch.Tensor:
        """The law plain sampling with this verifier's options draws from: ``api.sampling_distribution`` with its
        ``temperature``, ``top_k`` and ``top_p`` options where it has them (1, 0, 1 otherwise). A verifier whose law
        is set otherwise overrides this."""
        o = verifier.options
        return api.sampling_distribution(logits, getattr(o, "temperature", 1.0), getattr(o, "top_k", 0),
                                         getattr(o, "top_p", 1.0))

    def decode(self, verifier: api.Verifier, drafter: TableDrafter | None, mode: str,
               generator: torch.Generator) -> tuple[int, ...]:
        """The first ``N_TOKENS`` tokens of one decode of ``PROMPT`` over the target's logits, round by round as the
        reference engine runs it (``mode``: "plain", "chain" or "tree"; reported round costs are fixed, so a verifier
        that weighs them decides the same every run)."""
        target = tiny_target()
        verifier.bind(target.model)
        empty = api.Draft(tokens=torch.zeros(0, dtype=torch.long))
        seq = tuple(api.verify(verifier, target.logits(PROMPT)[None], empty, generator).emitted.tolist())
        while len(seq) < N_TOKENS:
            context = PROMPT + seq
            if mode == "plain":
                draft = empty
            elif mode == "chain":
                budget = verifier.draft_budget(self.k)
                assert isinstance(budget, int) and 0 <= budget <= self.k, f"draft_budget({self.k}) gave {budget!r}"
                draft = drafter.chain(context, budget, generator) if budget else empty
            else:
                draft = drafter.tree(context, 2, 2, generator)
            drafted = len(draft)
            if mode == "chain" and drafted:
                n = verifier.schedule(draft)
                assert n is None or (isinstance(n, int) and 0 <= n <= drafted), f"schedule gave {n!r} of {drafted}"
                draft = draft if n is None or n == drafted else draft.prefix(n)
            paths: list[tuple[int, ...]] = []
            for node, parent in enumerate(draft.parent_index().tolist()):
                paths.append((paths[parent] if parent >= 0 else context) + (int(draft.tokens[node]),))
            logits = torch.stack([target.logits(context)] + [target.logits(p) for p in paths])
            result = api.verify(verifier, logits, draft, generator)
            seq += tuple(result.emitted.tolist())
            if mode != "plain":
                verifier.observe(api.RoundCost(drafted=drafted, verified=len(draft), accepted=len(result.accepted),
                                               draft_seconds=1e-3 * drafted, target_seconds=1e-2 + 1e-3 * len(draft)))
        return seq[:N_TOKENS]

    def modes(self, verifier: api.Verifier) -> list[tuple[str, TableDrafter | None, str]]:
        """(label, drafter, mode): no drafts, chains of sampled and of argmax drafts, and trees of both kinds where
        the verifier verifies trees."""
        target = tiny_target()
        out = [("plain decoding", None, "plain"), ("chains of sampled drafts", TableDrafter(target), "chain"),
               ("chains of argmax drafts", TableDrafter(target, sampled=False), "chain")]
        if verifier.supports_tree:
            out += [("trees of sampled siblings", TableDrafter(target), "tree"),
                    ("trees of top-k siblings", TableDrafter(target, sampled=False), "tree")]
        return out

    # -- the contract
    def test_declares_what_the_engine_reads(self):
        cls = component_class("verifier", self.verifier)
        verifier = self.build()
        assert isinstance(cls.name, str) and cls.name, "a verifier has a registry name"
        assert isinstance(verifier.greedy, bool), f"greedy is {verifier.greedy!r}, not a bool"
        assert isinstance(cls.supports_tree, bool) and isinstance(cls.drafts_trees, bool)
        assert cls.supports_tree or not cls.drafts_trees, "a verifier that drafts trees by default must verify them"

    def test_greedy_decoding_is_plain_greedy_decoding(self):
        """A greedy verifier's output through the reference engine is plain greedy decoding's, token for token, for
        chains (and trees, where it verifies them) of drafts that are often right and often wrong."""
        from specframe.inference.engine import TreeShape, generate

        verifier = self.build()
        if not verifier.greedy:
            pytest.skip("not a greedy verifier (Verifier.greedy): its law is checked instead")
        target = tiny_target()
        shapes = [{"k": self.k + 1}] + ([{"tree": TreeShape(2, 2, 6)}] if verifier.supports_tree else [])
        for prompt in (PROMPT, (6, 4)):
            plain = target.greedy(prompt, 6)
            for shape, seed in itertools.product(shapes, range(4)):
                got = generate(target.model, torch.tensor(prompt), verifier, TableDrafter(target), max_new_tokens=6,
                               eos_token_id=(), generator=torch.Generator().manual_seed(seed), **shape)
                assert got.tokens == plain, (f"prompt {prompt}, {shape}, seed {seed}: emitted {got.tokens}, plain "
                                             f"greedy decoding {plain}")

    def test_sampling_emits_the_targets_law(self):
        """The first ``N_TOKENS`` tokens of speculative runs (and of plain decoding with the verifier) follow the
        target's exact joint law (``target_law`` at each step, enumerated over every continuation): chi-square
        p-value above ``threshold`` for every kind of draft."""
        verifier = self.build()
        if verifier.greedy:
            pytest.skip("a greedy verifier: its output is checked against plain greedy decoding instead")
        target = tiny_target()
        exact = torch.zeros((VOCAB,) * N_TOKENS, dtype=torch.float64)
        for seq in itertools.product(range(VOCAB), repeat=N_TOKENS):
            law = [self.target_law(verifier, target.logits(PROMPT + seq[:i])).double()[seq[i]] for i in range(N_TOKENS)]
            exact[seq] = torch.stack(law).prod()
        for index, (label, drafter, mode) in enumerate(self.modes(verifier)):
            g = torch.Generator().manual_seed(index)
            samples = [self.decode(verifier, drafter, mode, g) for _ in range(self.samples)]
            p = chi_square_pvalue(samples, exact)
            assert p > self.threshold, (f"{label}: the first {N_TOKENS} tokens do not follow the target's law "
                                        f"(chi-square p = {p:.3g} over {self.samples} decodes)")

    def test_a_seeded_run_repeats(self):
        """Every random choice comes from the generator the engine hands over: the same seed, the same tokens."""
        verifier = self.build()
        for label, drafter, mode in self.modes(verifier):
            runs = [[self.decode(verifier, drafter, mode, torch.Generator().manual_seed(seed)) for seed in range(10)]
                    for _ in range(2)]
            assert runs[0] == runs[1], f"{label}: two runs with the same seeds emitted {runs[0]} and {runs[1]}"
