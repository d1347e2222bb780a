"""``greedy``: lossless greedy verification of a chain or a tree.

From the root, follow the child whose token equals the target's argmax at the current node; stop at the first node
with no such child and emit the target's argmax there (the correction, or the bonus token after a full path). The
emitted tokens are exactly what plain greedy decoding would produce.
"""

from __future__ import annotations

import torch

from specframe import api


class GreedyVerifier(api.Verifier):
    name = "greedy"
    supports_tree = True
    greedy = True

    def verify(self, logits: torch.Tensor, draft: api.Draft, generator: torch.Generator | None = None):
        parents = draft.parent_index().tolist()
        tokens = draft.tokens.tolist()
        best = logits.argmax(dim=-1).tolist()
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(parents):
            children.setdefault(parent, []).append(node)
        accepted: list[int] = []
        node = -1
        while True:
            want = best[node + 1]
            match = next((c for c in children.get(node, ()) if tokens[c] == want), None)
            if match is None:
                emitted = [tokens[i] for i in accepted] + [want]
                return api.Verification(torch.tensor(accepted, dtype=torch.long), torch.tensor(emitted, dtype=torch.long))
            accepted.append(match)
            node = match


@api.hookimpl
def register_verifiers(register):
    register(GreedyVerifier)
