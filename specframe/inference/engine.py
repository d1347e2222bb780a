"""The reference decoding loop: plain and speculative decoding of one prompt (batch size 1).

Plain decoding is speculative decoding without a drafter: every decode forward reads the pending token and the
verifier picks the next token from an empty draft, so plain and speculative runs share one sampling rule. With a
drafter, each round is ``propose`` (or ``propose_tree``), one target forward over [pending, draft], the verifier's
decision, the cache roll-back and ``accept``; the verifier may shorten a chain before drafting (``draft_budget``: 0
makes the round a plain step) and before the target's forward (``schedule``), and is told each round's costs
(``observe``). The prefill forward also yields the first new token; it is not a
verification forward and is excluded from acceptance length.

Stopping: at the first eos token (kept) or after ``max_new_tokens``; tokens a round emits beyond either are dropped,
so the output equals plain decoding's token for token under a greedy verifier.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import attrs
import torch

from specframe import api
from specframe.errors import PluginError, SpecframeError, UsageError
from specframe.inference.target import TargetSession
from specframe.drafting.draft_tree import node_depths
from specframe.inference.defaults import DEFAULT_MAX_NEW_TOKENS
from specframe.values import is_int


@attrs.frozen
class TreeShape:
    """EAGLE-2 tree budget: ``depth`` draft levels, ``top_k`` children per expanded node, ``total_tokens`` nodes."""

    depth: int = 6
    top_k: int = 10
    total_tokens: int = 60

    def __attrs_post_init__(self) -> None:
        if min(self.depth, self.top_k, self.total_tokens) < 1:
            raise UsageError(f"tree depth, top_k and total_tokens must be positive, got {self}")


@attrs.frozen
class Round:
    """One decode forward: ``drafted`` draft depth (levels; 0 = no draft), ``nodes`` draft tokens read by the
    target, ``accepted`` draft tokens accepted, ``emitted`` tokens kept (accepted + one, fewer if the run stopped)."""

    drafted: int
    nodes: int
    accepted: int
    emitted: int


@attrs.define
class Generation:
    """The outcome of decoding one prompt.

    ``tokens``: the new tokens (prefill's included). ``rounds``: one ``Round`` per decode forward.
    ``target_forwards``: every target forward, prefill included. Times are wall-clock seconds; ``decode_seconds``
    covers everything after the prefill forward and its token (drafting, verification, bookkeeping).
    """

    prompt_ids: torch.Tensor
    tokens: list[int]
    rounds: list[Round]
    target_forwards: int
    prefill_seconds: float
    decode_seconds: float
    stop_reason: str

    @property
    def decode_tokens(self) -> int:
        """Tokens emitted by decode forwards (the prefill's token excluded)."""
        return sum(r.emitted for r in self.rounds)


def _propose(drafter: api.Drafter, method: str, limit: int, *args: Any) -> api.Draft:
    """Call ``drafter.<method>(*args)`` and check its draft; any failure names the drafter plugin."""
    who = f"drafter '{getattr(drafter, 'name', type(drafter).__name__)}'"
    try:
        draft = getattr(drafter, method)(*args)
    except SpecframeError as e:
        raise PluginError(f"{who}: {e}") from e
    except Exception as e:  # a bug in the plugin: one line naming it; --debug shows the traceback
        raise PluginError(f"{who} raised {type(e).__name__} in {method}: {e}") from e
    if not isinstance(draft, api.Draft):
        raise PluginError(f"{who} returned {type(draft).__name__} from {method}, not a specframe.api.Draft")
    if len(draft) > limit:
        raise PluginError(f"{who} proposed {len(draft)} tokens, more than the {limit} asked for")
    return draft


class _Output:
    """Collects emitted tokens and applies the stopping rule."""

    def __init__(self, max_new_tokens: int, eos: frozenset[int]) -> None:
        self.max_new_tokens = max_new_tokens
        self.eos = eos
        self.tokens: list[int] = []
        self.stop_reason = ""

    def add(self, emitted: Iterable[int]) -> int:
        """Append what fits; returns how many tokens were kept."""
        kept = 0
        for token in emitted:
            if self.stop_reason:
                break
            self.tokens.append(int(token))
            kept += 1
            if token in self.eos:
                self.stop_reason = "eos"
            elif len(self.tokens) >= self.max_new_tokens:
                self.stop_reason = "length"
        return kept


def _schedule(verifier: api.Verifier, draft: api.Draft) -> api.Draft:
    """The prefix of a chain the verifier asks the target to verify (``Verifier.schedule``, API 7), checked."""
    n = verifier.schedule(draft)
    if n is None:
        return draft
    if not is_int(n, 0, len(draft)):
        raise PluginError(f"verifier '{getattr(verifier, 'name', type(verifier).__name__)}' scheduled {n!r} tokens "
                          f"of a {len(draft)}-token draft (an integer in 0..{len(draft)} or None)")
    return draft if n == len(draft) else draft.prefix(n)


def _draft_budget(verifier: api.Verifier, k: int) -> int:
    """How many tokens the drafter is asked for this chain round (``Verifier.draft_budget``, API 11), checked."""
    n = verifier.draft_budget(k)
    if not is_int(n, 0, k):
        raise PluginError(f"verifier '{getattr(verifier, 'name', type(verifier).__name__)}' budgeted {n!r} draft "
                          f"tokens for a round of at most {k} (an integer in 0..{k})")
    return n


def _eos_ids(eos_token_id: int | Iterable[int] | None, model: Any) -> frozenset[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset({eos_token_id})
    return frozenset(int(t) for t in eos_token_id)


def generate(
    model: Any,
    prompt_ids: torch.Tensor,
    verifier: api.Verifier,
    drafter: api.Drafter | None = None,
    *,
    k: int = 5,
    tree: TreeShape | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    eos_token_id: int | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
) -> Generation:
    """Decode ``prompt_ids`` [n] with ``model`` (a transformers causal LM, eval mode).

    Without ``drafter``: plain decoding, one forward per token. With one: speculative decoding, chains of up to
    ``k`` tokens from ``drafter.propose``, or trees from ``drafter.propose_tree`` when ``tree`` is given (the verifier
    must then support trees). ``eos_token_id`` defaults to the model's generation config; pass ``()`` for none.
    ``generator`` drives every random draw of the drafter and the verifier.
    """
    if max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if drafter is not None and tree is None and k < 1:
        raise UsageError(f"k must be positive, got {k}")
    if tree is not None and not verifier.supports_tree:
        raise UsageError(f"verifier '{verifier.name}' cannot verify trees; use 'tree' or 'greedy', or drop the tree")
    prompt_ids = prompt_ids.view(-1).long().cpu()
    verifier.bind(model)  # API 10: before the clock starts; a verifier measuring the target does it once per model
    session = TargetSession(model, drafter.feature_spec() if drafter is not None else None)
    out = _Output(max_new_tokens, _eos_ids(eos_token_id, model))
    empty = api.Draft(tokens=torch.zeros(0, dtype=torch.long))
    rounds: list[Round] = []

    started = time.perf_counter()
    prefill = session.prefill(prompt_ids)
    first = api.verify(verifier, prefill.logits[-1:], empty, generator).emitted
    vocab = int(prefill.logits.shape[-1])
    out.add(first.tolist())
    if drafter is not None:
        drafter.start(prompt_ids, prefill.rows(list(range(len(prompt_ids)))))
        drafter.accept(first, prefill.rows([len(prompt_ids) - 1]))
    prefill_done = time.perf_counter()

    while not out.stop_reason:
        pending = out.tokens[-1]
        round_started = time.perf_counter()
        budget = k
        if drafter is None:
            draft = empty
        elif tree is None:
            budget = _draft_budget(verifier, k)
            draft = _propose(drafter, "propose", budget, budget, generator) if budget else empty
        else:
            draft = _propose(drafter, "propose_tree", tree.total_tokens, tree.depth, tree.top_k, tree.total_tokens, generator)
        drafted = len(draft)
        if tree is None and len(draft):
            draft = _schedule(verifier, draft)
        target_started = time.perf_counter()
        if len(draft) and int(draft.tokens.max()) >= vocab:
            # checked before the target forward, where the id would fail as an embedding IndexError
            raise PluginError(f"drafter '{drafter.name}' proposed token {int(draft.tokens.max())}, outside the "
                              f"target's {vocab}-token vocabulary")
        forward = session.verify(pending, draft.tokens, draft.parents)
        result = api.verify(verifier, forward.logits, draft, generator)
        accepted = result.accepted.tolist()
        session.keep(accepted)
        kept = out.add(result.emitted.tolist())
        depth = len(draft) if draft.parents is None or not len(draft) else int(node_depths(draft.parents).max())
        rounds.append(Round(drafted=depth, nodes=len(draft), accepted=min(len(accepted), kept), emitted=kept))
        if drafter is not None:
            verifier.observe(api.RoundCost(drafted=drafted, verified=len(draft), accepted=len(accepted),
                                           draft_seconds=target_started - round_started if budget else 0.0,
                                           target_seconds=time.perf_counter() - target_started))
        if drafter is not None and not out.stop_reason:
            drafter.accept(result.emitted, forward.rows([0] + [1 + a for a in accepted]))

    return Generation(
        prompt_ids=prompt_ids,
        tokens=out.tokens,
        rounds=rounds,
        target_forwards=session.forwards,
        prefill_seconds=prefill_done - started,
        decode_seconds=time.perf_counter() - prefill_done,
        stop_reason=out.stop_reason,
    )
