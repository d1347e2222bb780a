"""``sampling``: speculative sampling over a chain (Leviathan et al. 2023; Chen et al. 2023).

The target distribution p at each slot is ``api.sampling_distribution`` of the target logits (temperature, top-k,
top-p). Draft token d_i is accepted with probability min(1, p(d_i) / q(d_i)); at the first rejection the target's
token is drawn from normalise(max(0, p - q)) and the round stops; after a fully accepted chain a bonus token is
drawn from p at the last slot. q is ``Draft.probs`` when the drafter sampled, one-hot at d_i when it took the argmax.
Every random draw comes from the given generator. The emitted tokens are distributed exactly as sampling from p
token by token (plain decoding with the same options).
"""

from __future__ import annotations

import attrs
import torch

from specframe import api

_fields = api.SamplingFields("sampling")


@attrs.define
class SamplingOptions:
    temperature: float = _fields.temperature(1.0, "softmax temperature; 0 is greedy (p one-hot at the argmax)")
    top_k: int = _fields.top_k("keep only the k most likely tokens (0: off)")
    top_p: float = _fields.top_p("keep the smallest set of tokens whose mass reaches top_p (1: off)")


class SamplingVerifier(api.SamplesTarget, api.Verifier):
    name = "sampling"
    Options = SamplingOptions
    supports_tree = False

    # a class attribute, so a test can swap in a deliberately broken rule and watch the distribution check fail
    residual = staticmethod(api.residual_distribution)

    def verify(self, logits: torch.Tensor, draft: api.Draft, generator: torch.Generator | None = None):
        if draft.branched:
            raise api.UsageError("the 'sampling' verifier verifies chains; use 'tree' for draft trees")
        return api.speculative_chain(logits, draft, self.target, generator, residual=self.residual)


@api.hookimpl
def register_verifiers(register):
    register(SamplingVerifier)
