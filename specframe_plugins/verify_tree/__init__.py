"""``tree``: lossless verification of a draft tree (EAGLE-2), greedy or sampling.

Greedy (``temperature`` 0, the default): from the root, follow the child whose token is the target's argmax; emit
the argmax at the first node without such a child. Sampling (``temperature`` > 0): at each node, with p the target
distribution there (``api.sampling_distribution``), try the children in order; child c with token x and draft
distribution q (``Draft.probs[c]``, one-hot when the draft is deterministic) is accepted with probability
min(1, p(x) / q(x)); on rejection p <- normalise(max(0, p - q)) and the next sibling is tried (the multi-draft rule
of SpecInfer, which EAGLE uses; for a one-hot q it zeroes the rejected token in p and renormalises). When every
child is rejected the target's token is drawn from the current p. Siblings with a shared stochastic q must be
independent draws from it; deterministic (top-k) siblings are distinct tokens with probs None.
"""

from __future__ import annotations

import attrs
import torch

from specframe import api

_fields = api.SamplingFields("tree")


@attrs.define
class TreeOptions:
    temperature: float = _fields.temperature(0.0, "softmax temperature of the target; 0 means greedy acceptance")
    top_k: int = _fields.top_k()
    top_p: float = _fields.top_p()


class TreeVerifier(api.SamplesTarget, api.Verifier):
    name = "tree"
    Options = TreeOptions
    supports_tree = True
    drafts_trees = True  # this verifier exists for trees: a run with it drafts one unless --tree-* says otherwise

    # a class attribute, so a test can swap in a deliberately broken rule and watch the distribution check fail
    residual = staticmethod(api.residual_distribution)

    def verify(self, logits: torch.Tensor, draft: api.Draft, generator: torch.Generator | None = None):
        tokens = draft.tokens.tolist()
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(draft.parent_index().tolist()):
            children.setdefault(parent, []).append(node)
        greedy = self.greedy
        accepted: list[int] = []
        node = -1
        while True:
            if greedy:
                want = int(logits[node + 1].argmax())
                node = next((c for c in children.get(node, ()) if tokens[c] == want), None)
                if node is None:
                    return _verification(accepted, tokens, want)
                accepted.append(node)
                continue
            p = self.target(logits[node + 1])
            chosen = None
            for child in children.get(node, ()):
                q, ratio = api.acceptance_ratio(p, draft, child, tokens[child])
                if torch.rand((), generator=generator) < ratio:
                    chosen = child
                    break
                p = self.residual(p, q)
            if chosen is None:
                last = torch.multinomial(p, 1, generator=generator).item()
                return _verification(accepted, tokens, last)
            accepted.append(chosen)
            node = chosen


def _verification(accepted: list[int], tokens: list[int], last: int) -> api.Verification:
    emitted = [tokens[i] for i in accepted] + [last]
    return api.Verification(torch.tensor(accepted, dtype=torch.long), torch.tensor(emitted, dtype=torch.long))


@api.hookimpl
def register_verifiers(register):
    register(TreeVerifier)
