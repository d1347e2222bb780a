"""``ngram``: prompt-lookup drafting (Saxena 2023; vLLM's ``ngram`` method), a baseline that needs no training.

To draft, take the last n tokens of the committed sequence (prompt and output), for n from ``n_max`` down to
``n_min``, find their most recent earlier occurrence, and propose the tokens that followed it. The first n that
matches wins; no match means an empty draft (the round decodes one token). Drafting is deterministic, so sampling
verifiers treat it as one-hot q. It reads no target features and has no weights.
"""

from __future__ import annotations

import attrs
import torch

from specframe import api


@attrs.define
class NgramOptions:
    n_max: int = attrs.field(default=3, validator=attrs.validators.ge(1), metadata={
        "help": "longest context suffix looked up in the earlier context"})
    n_min: int = attrs.field(default=1, validator=attrs.validators.ge(1), metadata={
        "help": "shortest context suffix looked up (at most n_max)"})

    def __attrs_post_init__(self) -> None:
        if self.n_min > self.n_max:
            raise api.UsageError(f"ngram n_min ({self.n_min}) exceeds n_max ({self.n_max})")


def lookup(context: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix of ``context``."""
    for n in range(min(n_max, len(context) - 1), n_min - 1, -1):
        suffix = context[-n:]
        # Scan right to left so the most recent occurrence (not the suffix itself) wins.
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                return context[start + n : start + n + k]
    return []


class NgramDrafter(api.Drafter):
    name = "ngram"
    Options = NgramOptions
    parallel = True

    def __init__(self, target_config=None, options=None) -> None:
        super().__init__(target_config, options)
        self._context: list[int] = []
        self._module = torch.nn.Module()

    def feature_spec(self):
        return None

    def module(self) -> torch.nn.Module:
        return self._module

    def supervision(self, example):
        raise api.SpecframeError("drafter 'ngram' (prompt lookup) has no weights and cannot be trained")

    def vllm_speculative_config(self, k: int) -> dict:
        # vLLM's own prompt lookup with the same suffix lengths (its proposer matches the longest suffix first, too)
        return {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_max": int(self.options.n_max),
                "prompt_lookup_min": int(self.options.n_min)}

    def loss(self, example, elements, segment, attention):
        raise api.SpecframeError("drafter 'ngram' (prompt lookup) has no weights and cannot be trained")

    def start(self, prompt_ids, features) -> None:
        self._context = [int(t) for t in prompt_ids.view(-1).tolist()]

    def propose(self, k: int, generator=None) -> api.Draft:
        o = self.options
        return api.Draft(tokens=torch.tensor(lookup(self._context, k, o.n_max, o.n_min), dtype=torch.long))

    def accept(self, emitted, features) -> None:
        self._context.extend(int(t) for t in emitted.tolist())


@api.hookimpl
def register_drafters(register):
    register(NgramDrafter)
