"""The (anchor, depth) element model shared by every drafter (docs/design.md section 3).

Element (a, d) asks the drafter for the token d steps beyond a plain next-token prediction at anchor a; its rotary
position is a + d. Elements are laid out position-major (index a*K + d in the full grid), and every element also
carries the document it belongs to, so packed sequences never attend across documents.

Every element set also carries the visibility rule its drafter declared (``Drafter.visibility``), so the mask
builders and partitioners that receive it apply that rule without being told separately (``visible`` below):

- ``chain`` (the default; P-EAGLE, EAGLE-3, PARD, ParallelSpec): (a, d) sees the context (depth-0 elements of its
  document up to its anchor) and its own anchor's chain up to its depth, (a, 0) .. (a, d).
- ``block`` (DFlash's block diffusion): (a, d) sees the context and every element of its own anchor's block,
  (a, 0) .. (a, K-1), whatever their depth: inside a block attention is bidirectional.

Both rules share the context clause, so a depth-0 key at an earlier anchor is visible to every deeper query of the
same document under either rule; they differ only inside one anchor's elements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from specframe.errors import PluginError, UsageError
from specframe.values import is_int

#: the visibility rules a drafter may declare (module docstring); ``chain`` is the default
VISIBILITY_RULES = ("chain", "block")


def check_visibility(rule: Any, who: str = "visibility") -> str:
    """``rule`` if it names a visibility rule, else a ``PluginError`` naming ``who`` and the rules there are."""
    if not isinstance(rule, str) or rule not in VISIBILITY_RULES:
        raise PluginError(f"{who} must be one of {', '.join(VISIBILITY_RULES)}, got {rule!r}")
    return rule


@attrs.frozen
class ElementSet:
    """The elements of one training sequence (or a subset of them), as parallel int64 vectors, and the visibility
    rule they attend by (``chain`` or ``block``, see the module docstring)."""

    anchor: torch.Tensor
    depth: torch.Tensor
    doc: torch.Tensor
    seq_len: int
    max_depth: int
    visibility: str = attrs.field(default="chain", kw_only=True)
    #: a sliding window W (None: none): a depth-0 key of the context is visible only to queries whose position
    #: (anchor + depth) lies less than W past its anchor, as vLLM's and speculators' sliding-window layers attend;
    #: the query's own chain / block stays visible (``rule_matrix``). Only builders declaring ``windows`` apply it.
    window: int | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        n = self.anchor.shape[0]
        if self.anchor.dim() != 1 or self.depth.shape != (n,) or self.doc.shape != (n,):
            raise ValueError(
                f"anchor, depth and doc must be 1-D and equally long, got "
                f"{tuple(self.anchor.shape)}, {tuple(self.depth.shape)}, {tuple(self.doc.shape)}"
            )
        check_visibility(self.visibility, "an element set's visibility")

    def __len__(self) -> int:
        return int(self.anchor.shape[0])

    @property
    def position(self) -> torch.Tensor:
        """Rotary position (and reference position for targets / loss masks) of each element: anchor + depth."""
        return self.anchor + self.depth

    def subset(self, index: torch.Tensor) -> ElementSet:
        """The elements at ``index`` (int64 indices or a bool mask), order kept."""
        return ElementSet(
            self.anchor[index], self.depth[index], self.doc[index], self.seq_len, self.max_depth,
            visibility=self.visibility, window=self.window,
        )

    def with_visibility(self, rule: str) -> ElementSet:
        """The same elements under visibility rule ``rule`` (how the engine applies ``Drafter.visibility``)."""
        return attrs.evolve(self, visibility=rule)


def full_grid(
    seq_len: int, max_depth: int, doc: torch.Tensor | None = None, *, visibility: str = "chain"
) -> ElementSet:
    """Every element (a, d) with 0 <= d < max_depth and a + d < seq_len, position-major.

    ``doc`` gives the document id of each of the ``seq_len`` positions (default: one document); an element belongs to
    its anchor's document, and elements whose reference position a + d falls in another document are dropped.
    ``visibility`` is the rule the set attends by.
    """
    if seq_len < 1 or max_depth < 1:
        raise ValueError(f"seq_len and max_depth must be positive, got {seq_len} and {max_depth}")
    if doc is None:
        doc = torch.zeros(seq_len, dtype=torch.long)
    if doc.shape != (seq_len,):
        raise ValueError(f"doc must have one id per position ({seq_len}), got shape {tuple(doc.shape)}")
    anchor = torch.arange(seq_len).repeat_interleave(max_depth)
    depth = torch.arange(max_depth).repeat(seq_len)
    pos = anchor + depth
    keep = pos < seq_len
    keep[keep.clone()] &= doc[pos[keep]] == doc[anchor[keep]]
    return ElementSet(anchor[keep], depth[keep], doc[anchor[keep]], seq_len, max_depth, visibility=visibility)


def position_docs(doc: torch.Tensor, n: int) -> torch.Tensor:
    """Document ids of a drafter's ``n`` own positions over ``L = len(doc)`` data tokens (packed sequences).

    A drafter with shift ``s = L - n`` (EAGLE's is 1) reads data tokens i .. i + s at its position i (token x_{i+1}
    with feature g_i). A position whose reads straddle a document boundary mixes two conversations, which training
    on each conversation alone never does, so it gets a document of its own: nothing attends to it and it attends to
    nothing else (``shifted_supervision`` never charges it). Ids are renumbered 0, 1, ... in order, so they stay
    non-decreasing along the sequence.
    """
    length = int(doc.shape[0])
    shift = length - n
    if n < 0 or shift < 0:
        raise ValueError(f"a drafter cannot have {n} positions over {length} data tokens")
    if n == 0:
        return doc[:0].long()
    own = doc[shift:].long()
    straddle = doc[:n] != own
    label = own * 2 + straddle.long()
    changed = torch.ones(n, dtype=torch.long)
    changed[1:] = (label[1:] != label[:-1]).long()
    return torch.cumsum(changed, 0) - 1


def shared_visibility(query: ElementSet, key: ElementSet) -> str:
    """The rule two element sets attend by; they must agree (both come from one drafter's sequence)."""
    if query.visibility != key.visibility:
        raise PluginError(
            f"query and key elements carry different visibility rules ({query.visibility!r} and {key.visibility!r}); "
            "both must come from the same drafter's element set"
        )
    return query.visibility


def rule_matrix(
    rule: str, qa: torch.Tensor, qd: torch.Tensor, ka: torch.Tensor, kd: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """The rule on broadcastable anchor / depth tensors, documents left out (one document): the single source the
    builders that evaluate it themselves (chunked, precomputed, flex) call, so no builder restates it.

    chain: (k is depth 0 and k.anchor <= q.anchor) or (same anchor and k.depth <= q.depth).
    block: (k is depth 0 and k.anchor <= q.anchor) or same anchor.
    ``window`` W narrows the context clause to keys with q.anchor + q.depth - k.anchor < W (speculators' P-EAGLE
    mask, and vLLM's sliding window at the query's position); the own-anchor clause is untouched.
    """
    context = (kd == 0) & (ka <= qa)
    if window is not None:
        context = context & (qa + qd - ka < window)
    if rule == "block":
        return context | (ka == qa)
    return context | ((ka == qa) & (kd <= qd))


def visible(query: ElementSet, key: ElementSet) -> torch.Tensor:
    """The reference visibility rule as a dense bool matrix [len(query), len(key)].

    q may see k iff same document and the sets' rule (``rule_matrix``) holds. A precomputed single-document mask
    combines with packed documents by AND-ing this block-diagonal document condition.
    """
    rule = shared_visibility(query, key)
    qa, qd, qdoc = query.anchor[:, None], query.depth[:, None], query.doc[:, None]
    ka, kd, kdoc = key.anchor[None, :], key.depth[None, :], key.doc[None, :]
    return (qdoc == kdoc) & rule_matrix(rule, qa, qd, ka, kd, shared_window(query, key))


def shared_window(query: ElementSet, key: ElementSet) -> int | None:
    """The sliding window two element sets attend by; they must agree (both come from one drafter's sequence)."""
    if query.window != key.window:
        raise PluginError(f"query and key elements carry different windows ({query.window!r} and {key.window!r})")
    return query.window


def cod_sample(
    supervised: torch.Tensor,
    max_depth: int,
    ratio: float = 0.7,
    min_ratio: float = 0.2,
    *,
    generator: torch.Generator | None = None,
    doc: torch.Tensor | None = None,
    visibility: str = "chain",
) -> ElementSet:
    """Conditional drop-token sampling (COD, docs/design.md section 8), position-major.

    Depth 0 keeps every position. For 1 <= d < ``max_depth`` the candidates are anchors a whose (a, d-1) was kept,
    with a + d < L, a + d in a's document and ``supervised[a + d]``; ``floor(n_sup * max(ratio**d, min_ratio))`` of
    them are kept uniformly at random (n_sup = number of supervised positions), or all if there are fewer. Every kept
    element therefore has its whole chain. ``generator`` drives every choice (None: torch's global generator), so a
    seeded generator gives the same set every time.
    """
    if not isinstance(supervised, torch.Tensor) or supervised.dim() != 1 or supervised.dtype != torch.bool:
        raise ValueError(
            f"supervised must be a 1-D bool tensor, got "
            f"{getattr(supervised, 'dtype', type(supervised).__name__)} of shape {tuple(getattr(supervised, 'shape', ()))}"
        )
    seq_len = int(supervised.shape[0])
    if seq_len < 1:
        raise ValueError("supervised is empty: a sequence needs at least one position")
    if not is_int(max_depth, 1):
        raise UsageError(f"COD max_depth must be a positive integer, got {max_depth!r}")
    if not 0.0 < ratio <= 1.0:
        raise UsageError(f"COD ratio must be in (0, 1], got {ratio!r}")
    if not 0.0 <= min_ratio <= 1.0:
        raise UsageError(f"COD min_ratio must be in [0, 1], got {min_ratio!r}")
    if doc is None:
        doc = torch.zeros(seq_len, dtype=torch.long)
    elif doc.shape != (seq_len,):
        raise ValueError(f"doc must have one id per position ({seq_len}), got shape {tuple(doc.shape)}")
    supervised = supervised.cpu()
    doc = doc.cpu().long()
    n_sup = int(supervised.sum())

    anchors = [torch.arange(seq_len)]
    depths = [torch.zeros(seq_len, dtype=torch.long)]
    parents = anchors[0]
    for d in range(1, max_depth):
        cand = parents[parents + d < seq_len]
        cand = cand[(doc[cand + d] == doc[cand]) & supervised[cand + d]]
        # The epsilon makes floor(1000 * 0.7**2) 490, as the definition means, not 489 from 0.48999999999999994.
        keep = math.floor(n_sup * max(ratio**d, min_ratio) + 1e-9)
        if cand.numel() > keep:
            chosen = torch.randperm(cand.numel(), generator=generator)[:keep]
            cand = cand[chosen].sort().values
        if cand.numel() == 0:
            break
        anchors.append(cand)
        depths.append(torch.full_like(cand, d))
        parents = cand
    anchor = torch.cat(anchors)
    depth = torch.cat(depths)
    order = torch.argsort(anchor * max_depth + depth)
    anchor, depth = anchor[order], depth[order]
    return ElementSet(anchor, depth, doc[anchor], seq_len, max_depth, visibility=visibility)


def check_partition(elements: ElementSet, segments: Sequence[Any], partitioner: str = "?") -> None:
    """Raise ``PluginError`` naming ``partitioner`` unless ``segments`` is a valid partition of ``elements``.

    Valid means: at least one segment; each segment's ``elements`` is a strictly increasing int64 index into
    ``elements`` with a bool ``loss_mask`` of the same length; every element is charged in exactly one segment; and
    every segment is causally complete (every key visible to one of its elements, under the set's visibility rule, is
    forwarded by it too). The check is O(number of elements) per segment, so the engine can afford it on every
    sequence.
    """
    n = len(elements)
    where = f"partitioner '{partitioner}'"
    if len(segments) == 0:
        raise PluginError(f"{where} returned no segments for {n} elements")
    charged = torch.zeros(n, dtype=torch.long)
    _, doc_idx = torch.unique(elements.doc, return_inverse=True)
    # One id per (document, anchor): chains never cross documents, so the chain rule compares these ids.
    chain_id = doc_idx * elements.seq_len + elements.anchor
    n_docs = int(doc_idx.max()) + 1 if n else 0
    is_root = elements.depth == 0
    for s, seg in enumerate(segments):
        idx, lm = seg.elements, seg.loss_mask
        if idx.dim() != 1 or idx.dtype != torch.long:
            raise PluginError(f"{where}: segment {s} elements must be a 1-D int64 tensor, got {idx.dtype} {tuple(idx.shape)}")
        if lm.dtype != torch.bool or lm.shape != idx.shape:
            raise PluginError(
                f"{where}: segment {s} loss_mask must be bool with one entry per element, got {lm.dtype} {tuple(lm.shape)}"
            )
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise PluginError(f"{where}: segment {s} indexes outside the {n} elements")
        if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise PluginError(f"{where}: segment {s} element indices are not strictly increasing")
        charged.index_add_(0, idx[lm], torch.ones(int(lm.sum()), dtype=torch.long))
        if idx.numel() == 0:
            continue
        inside = torch.zeros(n, dtype=torch.bool)
        inside[idx] = True
        # Context: every depth-0 key of a query's document up to the query's anchor.
        last = torch.full((n_docs,), -1, dtype=torch.long)
        last.scatter_reduce_(0, doc_idx[idx], elements.anchor[idx], reduce="amax")
        need = is_root & (elements.anchor <= last[doc_idx])
        # Chain: every key of a query's own chain up to the query's depth; block: every key of a query's block.
        deepest = torch.full((n_docs * elements.seq_len,), -1, dtype=torch.long)
        deepest.scatter_reduce_(0, chain_id[idx], elements.depth[idx], reduce="amax")
        if elements.visibility == "block":
            need |= deepest[chain_id] >= 0
        else:
            need |= elements.depth <= deepest[chain_id]
        missing = need & ~inside
        if bool(missing.any()):
            i = int(missing.nonzero()[0])
            raise PluginError(
                f"{where}: segment {s} is not causally complete: it lacks element {i} "
                f"(anchor {int(elements.anchor[i])}, depth {int(elements.depth[i])}), which one of its elements sees "
                f"({int(missing.sum())} missing in all)"
            )
    bad = (charged != 1).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise PluginError(
            f"{where}: every element must be charged in exactly one segment, but element {i} "
            f"(anchor {int(elements.anchor[i])}, depth {int(elements.depth[i])}) is charged {int(charged[i])} times "
            f"({bad.numel()} such elements)"
        )
