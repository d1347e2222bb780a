"""The verifier interface (``specframe.api.Verifier``): what decides, losslessly, which draft tokens the target
accepts; the ``Verification`` it returns, the ``RoundCost`` it is told, and ``verify``, the checked call the engines
make. The sampling math verifiers share is ``specframe.sampling``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import attrs
import torch

from specframe.declarations import legacy_greedy
from specframe.drafting.drafts import Draft
from specframe.errors import PluginError, UsageError
from specframe.interfaces.component import Component


@attrs.frozen
class Verification:
    """The outcome of one verification.

    ``accepted`` (int64): draft node indices accepted, root to leaf. ``emitted`` (int64): the tokens to append, i.e.
    the accepted draft tokens followed by exactly one token from the target (the correction at the first rejection,
    or the bonus token after a fully accepted path).
    """

    accepted: torch.Tensor
    emitted: torch.Tensor


@attrs.frozen
class RoundCost:
    """API 11: one decode round as the reference engine saw it, for ``Verifier.observe``. ``drafted``: draft tokens
    the drafter proposed (0: drafting was skipped); ``verified``: those the target read (after ``schedule``);
    ``accepted``: those it accepted; ``draft_seconds``: the drafter's ``propose`` and the verifier's ``schedule``
    (0 when drafting was skipped); ``target_seconds``: the target's forward and the verification."""

    drafted: int
    verified: int
    accepted: int
    draft_seconds: float
    target_seconds: float


class Verifier(Component, ABC):
    """Decides which draft tokens the target accepts, without changing the target's output distribution."""

    #: whether the verifier accepts drafts with branching (``Draft.parents`` not a chain)
    supports_tree: ClassVar[bool] = False
    #: API 6: True when a run with this verifier drafts a tree unless told otherwise (the ``tree`` verifier: the
    #: EAGLE-2 dynamic tree at ``TreeShape``'s defaults); False: a chain unless a ``--tree-*`` option is given
    drafts_trees: ClassVar[bool] = False

    @property
    def greedy(self) -> bool:
        """API 6: True when this verifier's output is plain greedy decoding's, so speculative output must equal the
        target's own greedy output token for token (the benchmarks check it). Default, for a verifier written for
        API 5 or earlier: its ``temperature`` option is 0, or it has none."""
        return legacy_greedy(self.options)

    @abstractmethod
    def verify(self, logits: torch.Tensor, draft: Draft, generator: torch.Generator | None = None) -> Verification:
        """``logits`` [N + 1, V]: row 0 is the target at the root (predicts the first draft level), row i + 1 the
        target at draft node i. ``generator`` drives every random choice, so a seeded run is reproducible."""

    def bind(self, model: Any) -> None:
        """API 10: ``model`` (a transformers causal LM) is the target this verifier is about to verify for. The
        reference engine calls it at the start of every decode, before the decode's clock starts, so a verifier that
        measures something of the target (the cost of its forward) does it here, once per model, and no timed
        decode pays for it. Default: nothing."""
        return None

    def schedule(self, draft: Draft) -> int | None:
        """How many leading tokens of a chain ``draft`` the target should verify, decided before its forward (API 7;
        None, the default: all of them). The engine verifies ``draft.prefix(n)``. To keep sampling lossless the
        choice to keep token i may depend on the draft only through tokens before i (e.g. ``confidence[: i + 1]``,
        whose entry i a drafter computes before drawing token i), never on token i or later."""
        return None

    def draft_budget(self, k: int) -> int:
        """API 11: how many tokens (0..``k``) the drafter is asked for in the next chain round, decided before it
        drafts, from what ``observe`` has told of earlier rounds. 0 skips drafting: the round is a plain target step
        (the target's forward over the pending token alone), which is lossless whatever the choice, since the choice
        depends only on earlier rounds. Default: ``k``."""
        return k

    def observe(self, cost: RoundCost) -> None:
        """API 11: what the round just finished drafted, verified and accepted, and what its drafting and its target
        forward took on the reference engine (a chain round or a tree round; called after every decode round, so a
        verifier can weigh drafting against its return). Default: nothing."""
        return None


def verify(verifier: Verifier, logits: torch.Tensor, draft: Draft, generator: torch.Generator | None = None) -> Verification:
    """``verifier.verify`` with both sides checked: the inputs against each other (``InvalidDraftError``), and the
    result against the draft (a ``PluginError`` naming the verifier), so a buggy verifier plugin cannot emit a
    silently wrong sequence. The engines call verifiers only through this."""
    draft.check_against(logits)
    if draft.branched and not verifier.supports_tree:
        raise UsageError(f"verifier '{verifier.name}' only verifies chains, and the draft is a tree")
    result = verifier.verify(logits, draft, generator)
    who = f"verifier '{getattr(verifier, 'name', type(verifier).__name__)}'"
    if not isinstance(result, Verification):
        raise PluginError(f"{who} returned {type(result).__name__}, not a specframe.api.Verification")
    accepted, emitted = result.accepted.tolist(), result.emitted.tolist()
    if len(emitted) != len(accepted) + 1:
        raise PluginError(f"{who} emitted {len(emitted)} tokens for {len(accepted)} accepted draft tokens (expected one more)")
    parents, tokens = draft.parent_index().tolist(), draft.tokens.tolist()
    node = -1
    for a, tok in zip(accepted, emitted):
        if not 0 <= a < len(draft) or parents[a] != node:
            raise PluginError(f"{who} accepted nodes {accepted}, which are not a path from the root of the draft")
        if tok != tokens[a]:
            raise PluginError(f"{who} emitted token {tok} for accepted node {a}, whose draft token is {tokens[a]}")
        node = a
    if not 0 <= emitted[-1] < logits.shape[1]:
        raise PluginError(f"{who} emitted token {emitted[-1]}, outside the {logits.shape[1]}-token vocabulary")
    return result
