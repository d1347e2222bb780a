"""``Draft``: what a drafter proposes and a verifier checks (exposed as ``specframe.api.Draft``).

A leaf module (torch, attrs and the errors only), so ``specframe.drafting.draft_tree`` builds drafts without importing
``specframe.api``, which imports the tree in turn: no import circle through the API.
"""

from __future__ import annotations

import attrs
import torch

from specframe.errors import InvalidDraftError


@attrs.frozen
class Draft:
    """Proposed tokens, as a chain or a tree.

    ``tokens`` [N]: draft tokens. ``parents`` [N] (int64) or None: index of each node's parent, -1 for children of
    the root (the last committed token); None means a chain (node i's parent is i - 1). Nodes are in topological
    order (a parent's index is below its children's) and siblings in the order a verifier tries them. ``probs``
    [N, V] or None: the drafter distribution each token was drawn from (over the target vocabulary); siblings of a
    tree are independent draws from their (shared) distribution. None means deterministic drafting (argmax or
    top-k), i.e. one-hot q. ``confidence`` [N] or None (API 7): the drafter's estimate, in [0, 1], that node i is
    accepted given that its parent was (DSpark's confidence head); verifiers that schedule read it (``schedule``).
    """

    tokens: torch.Tensor
    parents: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None

    def __attrs_post_init__(self) -> None:
        # A malformed draft would otherwise surface as an IndexError deep inside a verifier or the target forward,
        # or worse, as a silently wrong tree; refuse it where it is made.
        t = self.tokens
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            what = f"shape {tuple(t.shape)}, dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidDraftError(f"malformed draft: tokens must be a 1-D integer tensor, got {what}")
        n = int(t.shape[0])
        if n and int(t.min()) < 0:
            raise InvalidDraftError(f"malformed draft: negative token id {int(t.min())}")
        if self.parents is not None:
            p = self.parents
            if not isinstance(p, torch.Tensor) or tuple(p.shape) != (n,) or p.dtype.is_floating_point or p.dtype == torch.bool:
                what = f"shape {tuple(p.shape)}, dtype {p.dtype}" if isinstance(p, torch.Tensor) else type(p).__name__
                raise InvalidDraftError(f"malformed draft: parents must be an integer tensor of shape ({n},), got {what}")
            bad = [i for i, q in enumerate(p.tolist()) if not -1 <= q < i]
            if bad:
                raise InvalidDraftError(
                    f"malformed draft: node {bad[0]} has parent {int(p[bad[0]])}; parents must be -1 (the root) or "
                    "an earlier node (topological order)"
                )
        if self.probs is not None:
            q = self.probs
            if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.shape[0] != n or not q.dtype.is_floating_point:
                what = f"shape {tuple(q.shape)}, dtype {q.dtype}" if isinstance(q, torch.Tensor) else type(q).__name__
                raise InvalidDraftError(f"malformed draft: probs must be a float tensor [{n}, V], got {what}")

        c = self.confidence
        if c is not None:
            if not isinstance(c, torch.Tensor) or tuple(c.shape) != (n,) or not c.dtype.is_floating_point:
                what = f"shape {tuple(c.shape)}, dtype {c.dtype}" if isinstance(c, torch.Tensor) else type(c).__name__
                raise InvalidDraftError(f"malformed draft: confidence must be a float tensor of shape ({n},), got {what}")
            if n and not bool(((c >= 0) & (c <= 1)).all()):
                raise InvalidDraftError("malformed draft: confidence values must lie in [0, 1]")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def prefix(self, n: int) -> Draft:
        """The chain's first ``n`` tokens (their probs and confidence with them): what a ``schedule`` keeps."""
        if self.branched:
            raise InvalidDraftError("malformed draft: only a chain has a prefix to schedule")
        return Draft(tokens=self.tokens[:n], probs=None if self.probs is None else self.probs[:n],
                     confidence=None if self.confidence is None else self.confidence[:n])

    def check_against(self, logits: torch.Tensor) -> None:
        """Refuse verifying this draft against ``logits`` unless they are [N + 1, V] with every token (and the
        width of ``probs``) inside the same V-token vocabulary."""
        n = len(self)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.dtype.is_floating_point:
            what = f"shape {tuple(logits.shape)}, dtype {logits.dtype}" if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise InvalidDraftError(f"logits must be a float tensor [N + 1, V], got {what}")
        if logits.shape[0] != n + 1:
            raise InvalidDraftError(f"{logits.shape[0]} logit rows for a draft of {n} tokens (expected {n + 1})")
        vocab = int(logits.shape[1])
        if n and int(self.tokens.max()) >= vocab:
            raise InvalidDraftError(f"draft token {int(self.tokens.max())} is outside the {vocab}-token vocabulary")
        if self.probs is not None and self.probs.shape[1] != vocab:
            raise InvalidDraftError(f"draft probs cover {self.probs.shape[1]} tokens, the logits {vocab}")

    @property
    def branched(self) -> bool:
        """True when ``parents`` describe a tree with branching (a chain given explicitly is not branched)."""
        return self.parents is not None and self.parents.tolist() != list(range(-1, len(self) - 1))

    def parent_index(self) -> torch.Tensor:
        """Parents as a tensor, chains included."""
        if self.parents is not None:
            return self.parents
        return torch.arange(len(self), dtype=torch.long) - 1
