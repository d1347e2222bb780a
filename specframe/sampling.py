"""The sampling math the sampling verifiers share (``specframe.api`` re-exports it): the law a target's logits
sample from, the residual law after a rejection, one draft token's acceptance ratio (API 14: the chain and the tree
verifiers share it) and chain speculative sampling (API 8), so plain sampling and speculative sampling with the same
options draw from the same law."""

from __future__ import annotations

from typing import Any

import torch

from specframe.errors import UsageError
from specframe.interfaces.verifier import Verification


def sampling_distribution(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution a target's ``logits`` [..., V] sample from: temperature, then top-k, then top-p (nucleus).

    ``temperature`` 0 means greedy (one-hot at the argmax); ``top_k`` 0 and ``top_p`` 1 switch those filters off.
    Sampling verifiers accept against this distribution, so plain sampling and speculative sampling with the same
    options draw from the same law.
    """
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise UsageError(f"invalid sampling options: temperature {temperature}, top_k {top_k}, top_p {top_p}")
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where the target's token comes from after a draft drawn from q was rejected: normalise(max(0, p - q)).

    If p <= q everywhere a rejection has probability zero; floating-point error can still get here, and p is then
    the right law. Sampling verifiers, chain and tree, share this rule.
    """
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def acceptance_ratio(p: torch.Tensor, draft: Any, i: int, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft token's speculative acceptance (API 14): ``(q, p(x) / q(x))`` for draft node ``i`` whose token x is
    ``token`` (``draft.tokens[i]``, which the caller already holds as an int), ``p`` being the target's law there.
    q is ``draft.probs[i]`` when the drafter sampled and one-hot at x when it took the argmax; the ratio is 0 where
    q(x) is 0. The token is accepted when a uniform draw falls below the ratio (so with probability min(1, ratio));
    on a rejection the residual law takes q off p. The chain (``speculative_chain``) and the ``tree`` verifier
    share it."""
    if draft.probs is not None:
        q = draft.probs[i].float().cpu()
    else:
        q = torch.zeros_like(p)
        q[token] = 1.0
    return q, p[token] / q[token] if q[token] > 0 else torch.tensor(0.0)


def speculative_chain(
    logits: torch.Tensor, draft: Any, target: Any, generator: torch.Generator | None = None,
    residual: Any = residual_distribution,
) -> Verification:
    """Speculative sampling over a chain (API 8; what the ``sampling`` verifier and DSpark's ``scheduled`` verifier
    share). ``target(logits_row)`` is the target's law p at a slot; draft token d_i is accepted with probability
    min(1, p(d_i) / q(d_i)), q being ``draft.probs`` when the drafter sampled and one-hot at d_i when it took the
    argmax; at the first rejection the target's token is drawn from ``residual(p, q)`` and the round stops; after a
    fully accepted chain a bonus token is drawn from p at the last slot. Every random draw comes from ``generator``,
    one uniform per draft token tried and one categorical at the end, in that order."""
    tokens = draft.tokens.tolist()
    accepted: list[int] = []
    for i, token in enumerate(tokens):
        p = target(logits[i])
        q, ratio = acceptance_ratio(p, draft, i, token)
        if torch.rand((), generator=generator) < ratio:
            accepted.append(i)
            continue
        fix = int(torch.multinomial(residual(p, q), 1, generator=generator).item())
        return chain_verification(accepted, tokens, fix)
    bonus = int(torch.multinomial(target(logits[len(tokens)]), 1, generator=generator).item())
    return chain_verification(accepted, tokens, bonus)


def chain_verification(accepted: list[int], tokens: list[int], last: int) -> Verification:
    """The ``Verification`` of a chain whose draft slots ``accepted`` (a prefix) were kept, then ``last`` emitted."""
    emitted = [tokens[i] for i in accepted] + [last]
    return Verification(torch.tensor(accepted, dtype=torch.long), torch.tensor(emitted, dtype=torch.long))
