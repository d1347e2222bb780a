"""Draft trees: the EAGLE-2 dynamic tree construction and the tree attention layout.

A draft tree is stored flat, in topological order (every parent before its children), as ``tokens`` [N] and
``parents`` [N] (-1 = child of the root, i.e. of the last committed token). Siblings appear in the order a verifier
should try them.

It sits below the API, beside ``specframe.drafting.drafts``: ``specframe.api`` re-exports ``dynamic_tree`` and ``DraftTree``
(drafter plugins build trees with them) and the reference engine (``specframe.inference``) lays out tree attention
with the rest, so it depends on torch, attrs and the leaf ``specframe.drafting.drafts`` (``api.Draft``) only, never on the API
or the engine.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from specframe.drafting.drafts import Draft


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (children of the root have depth 1); ``parents`` must be topologically ordered."""
    depth: list[int] = []
    for node, parent in enumerate(parents.tolist()):
        if not -1 <= parent < node:
            raise ValueError(f"draft node {node} has parent {parent}: parents must come before their children")
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return torch.tensor(depth, dtype=torch.long)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """Bool [N + 1, N + 1] over [root, node 0, ..., node N-1]: row i may see column j iff j is i or an ancestor of i.

    Row/column 0 is the root (the pending committed token), which every node descends from.
    """
    n = int(parents.shape[0])
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[0, 0] = True
    for node, parent in enumerate(parents.tolist()):
        mask[node + 1] = mask[parent + 1]
        mask[node + 1, node + 1] = True
    return mask


@attrs.define
class DraftTree:
    """A tree being grown by ``dynamic_tree``; what an ``expand`` callback reads to know which nodes it scores.

    ``tokens`` / ``parents`` / ``depth`` / ``score`` are per node, in creation order; ``score`` is the log path
    confidence (sum of the draft log-probabilities from the root to the node).
    """

    tokens: list[int] = attrs.field(factory=list)
    parents: list[int] = attrs.field(factory=list)
    depth: list[int] = attrs.field(factory=list)
    score: list[float] = attrs.field(factory=list)

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(1 if parent < 0 else self.depth[parent] + 1)
        self.score.append(score)
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        out: list[int] = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path(node)]


#: ``expand(tree, nodes)`` -> log-probabilities [len(nodes), V] of the token following each of ``nodes``
Expand = Callable[[DraftTree, list[int]], torch.Tensor]


def dynamic_tree(root_logprobs: torch.Tensor, expand: Expand, *, depth: int, top_k: int, total_tokens: int) -> Draft:
    """Build an EAGLE-2 dynamic draft tree (Li et al. 2024, arXiv 2406.16858, section 4).

    ``root_logprobs`` [V]: the drafter's log-probabilities for the first draft token. Level 1 is its ``top_k`` tokens.
    Each further level expands the ``top_k`` nodes of the previous level with the highest path confidence (product
    of draft probabilities along the path): ``expand`` scores them, each gets its ``top_k`` most likely children, and
    the ``top_k`` best of those children form the next frontier. ``expand`` is called ``depth - 1`` times. Finally
    every drafted node is reranked by path confidence and the best ``total_tokens`` are kept; since a child is never
    more confident than its parent (ties broken towards the shallower, earlier node) the kept set is closed under
    ancestors. The result is topologically ordered with siblings by decreasing confidence.

    Autoregressive drafters implement ``expand`` as one drafter step over the frontier nodes (each sees its own
    path, ``tree.path_tokens(node)``); a parallel drafter with per-depth distributions may return the distribution
    of depth ``tree.depth[node] + 1`` for every node. Drafting is deterministic (top-k), so the draft's ``probs`` is
    None and sampling verifiers treat each proposal as a one-hot draft.
    """

    if depth < 1 or top_k < 1 or total_tokens < 1:
        raise ValueError(f"depth, top_k and total_tokens must be positive, got {depth}, {top_k}, {total_tokens}")
    tree = DraftTree()
    values, tokens = root_logprobs.float().topk(min(top_k, root_logprobs.shape[-1]))
    frontier = [tree.add(int(t), -1, float(v)) for v, t in zip(values, tokens)]
    for _ in range(depth - 1):
        # Expand the most confident nodes of the newest level only (EAGLE-2's expansion phase).
        frontier = sorted(frontier, key=lambda n: -tree.score[n])[:top_k]
        logprobs = expand(tree, frontier).float()
        if logprobs.shape[0] != len(frontier):
            raise ValueError(f"expand returned {logprobs.shape[0]} rows for {len(frontier)} nodes")
        values, tokens = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
        cand = (values + torch.tensor([tree.score[n] for n in frontier]).unsqueeze(1)).flatten()
        best = cand.topk(min(top_k, cand.numel())).indices.tolist()
        # Every candidate child is drafted (and may survive the rerank); only the best top_k are expanded further.
        created = {}
        for flat in range(cand.numel()):
            row, col = divmod(flat, values.shape[1])
            created[flat] = tree.add(int(tokens[row, col]), frontier[row], float(cand[flat]))
        frontier = [created[f] for f in best]
    order = sorted(range(len(tree.tokens)), key=lambda n: (-tree.score[n], tree.depth[n], n))[:total_tokens]
    new_index = {old: new for new, old in enumerate(order)}
    parents = [-1 if tree.parents[n] < 0 else new_index[tree.parents[n]] for n in order]
    return Draft(
        tokens=torch.tensor([tree.tokens[n] for n in order], dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
    )
