"""Tiny targets and test drafters for the decoding tests (imported by tests/unit/test_decoding.py and friends)."""

from __future__ import annotations

import functools

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specframe import api

# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine a second thread makes them 10x slower.
torch.set_num_threads(1)


@functools.lru_cache(maxsize=8)
def random_llama(vocab: int = 256, layers: int = 2, hidden: int = 64, seed: int = 0, logit_scale: float = 1.0):
    """A seeded random Llama (fp32, eval). ``logit_scale`` sharpens its distributions (random inits are near uniform)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


@torch.no_grad()
def naive_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding without a KV cache: the ground truth the engine must reproduce."""
    seq = list(prompt)
    for _ in range(n):
        logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
        seq.append(int(logits.argmax()))
    return seq[len(prompt) :]


class _TestDrafter(api.Drafter):
    """Shared plumbing: tracks the committed sequence; no training."""

    name = "test"

    def __init__(self, target_config=None, options=None) -> None:
        super().__init__(target_config, options)
        self.context: list[int] = []
        self.calls: list[tuple[list[int], dict]] = []

    def feature_spec(self):
        return None

    def module(self):
        return torch.nn.Module()

    def supervision(self, example):
        raise NotImplementedError

    def loss(self, example, elements, segment, attention):
        raise NotImplementedError

    def start(self, prompt_ids, features):
        self.context = prompt_ids.tolist()
        self.prompt_len = len(self.context)

    def accept(self, emitted, features):
        self.calls.append((emitted.tolist(), features))
        self.context += emitted.tolist()


class OracleDrafter(_TestDrafter):
    """Knows the plain greedy continuation; ``propose_tree`` hides the right child among random siblings."""

    def __init__(self, continuation: list[int], vocab: int, seed: int = 0) -> None:
        super().__init__()
        self.continuation = continuation
        self.vocab = vocab
        self.rng = torch.Generator().manual_seed(seed)

    def _next(self, k: int) -> list[int]:
        done = len(self.context) - self.prompt_len
        return self.continuation[done : done + k]

    def propose(self, k, generator=None):
        return api.Draft(tokens=torch.tensor(self._next(k), dtype=torch.long))

    def propose_tree(self, depth, top_k, total_tokens, generator=None):
        right = self._next(depth)
        tokens, parents, parent = [], [], -1
        for token in right:
            if len(tokens) >= total_tokens:
                break
            siblings = [int(t) for t in torch.randint(self.vocab, (top_k - 1,), generator=self.rng) if int(t) != token]
            slot = int(torch.randint(len(siblings) + 1, (1,), generator=self.rng))
            siblings.insert(slot, token)
            first = len(tokens)
            for s in siblings[: total_tokens - len(tokens)]:
                tokens.append(s)
                parents.append(parent)
            if slot >= total_tokens - first:
                break
            parent = first + slot
        return api.Draft(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))


class WrongDrafter(OracleDrafter):
    """Never proposes the target's greedy token (the oracle's token shifted by one)."""

    def propose(self, k, generator=None):
        return api.Draft(tokens=torch.tensor([(t + 1) % self.vocab for t in self._next(k)], dtype=torch.long))

    def propose_tree(self, depth, top_k, total_tokens, generator=None):
        right = self._next(1)
        wrong = [t for t in range(self.vocab) if t not in right]
        n = min(top_k, total_tokens)
        # wrong root children, then a chain under the first one (never reached, but it gives the tree depth)
        deep = min(depth - 1, total_tokens - n)
        tokens = wrong[:n] + wrong[:deep]
        parents = [-1] * n + [0] + list(range(n, n + deep - 1))
        return api.Draft(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents[: n + deep]))


class RandomDrafter(_TestDrafter):
    """Random tokens, random tree shapes: anything may be accepted or rejected."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        super().__init__()
        self.vocab = vocab
        self.rng = torch.Generator().manual_seed(seed)

    def propose(self, k, generator=None):
        n = int(torch.randint(k + 1, (1,), generator=self.rng))
        return api.Draft(tokens=torch.randint(self.vocab, (n,), generator=self.rng))

    def propose_tree(self, depth, top_k, total_tokens, generator=None):
        n = int(torch.randint(1, total_tokens + 1, (1,), generator=self.rng))
        parents: list[int] = []
        depths: list[int] = []
        for i in range(n):
            options = [-1] + [j for j in range(i) if depths[j] < depth]
            p = options[int(torch.randint(len(options), (1,), generator=self.rng))]
            parents.append(p)
            depths.append(1 if p < 0 else depths[p] + 1)
        return api.Draft(tokens=torch.randint(self.vocab, (n,), generator=self.rng), parents=torch.tensor(parents))


class ModelDrafter(_TestDrafter):
    """An autoregressive drafter over a small causal LM (no cache: it re-reads each path), with EAGLE-2 trees."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    @torch.no_grad()
    def _logprobs(self, paths: list[list[int]]) -> torch.Tensor:
        rows = [self.model(input_ids=torch.tensor([self.context + p])).logits[0, -1] for p in paths]
        return torch.log_softmax(torch.stack(rows).float(), dim=-1)

    def propose(self, k, generator=None):
        path: list[int] = []
        for _ in range(k):
            path.append(int(self._logprobs([path])[0].argmax()))
        return api.Draft(tokens=torch.tensor(path, dtype=torch.long))

    def propose_tree(self, depth, top_k, total_tokens, generator=None):
        root = self._logprobs([[]])[0]
        return api.dynamic_tree(
            root,
            lambda tree, nodes: self._logprobs([tree.path_tokens(n) for n in nodes]),
            depth=depth,
            top_k=top_k,
            total_tokens=total_tokens,
        )
