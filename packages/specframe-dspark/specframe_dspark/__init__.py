"""``dspark``: DSpark semi-autoregressive block drafting (deepseek-ai/DeepSpec) as a third-party specframe plugin.

It imports only ``specframe.api`` (API 7: the block backbone it shares with DFlash is ``api.block``; API 8: its
confidence calibration through ``api.calibration``). What it
declares, and why (docs/plugins/dspark.md has the sources):

- ``visibility = "block"``: inside a draft block attention is bidirectional (the DFlash backbone), so every mask
  builder and the ``peagle`` partitioner apply the block rule.
- Elements: element (a, d) is slot d of the block anchored on token x_{a+1} (drafter position a reads feature g_a
  and token x_{a+1}, the EAGLE pairing). The anchor slot is the first prediction position (DeepSpec's
  anchor-as-first-prediction, vLLM's ``sample_from_anchor``): slot d predicts x_{a+2+d}, exactly what the core's
  (anchor, depth) model asks of depth d; the training depth is ``block_size``.
- The sequential stage: each slot's base logits (the frozen target lm_head over the backbone state) get a
  prefix-dependent bias from the previous token of the block (the anchor for slot 0): the Markov head's low-rank
  transition ``markov_w2(markov_w1[x_{d-1}])``, or the RNN head's gated recurrent state over the block. Training is
  teacher-forced (the previous token is the data token); drafting samples left to right.
- The confidence head (a linear layer and a sigmoid over the backbone state and, by default, the previous token's
  Markov embedding) is trained toward the analytical acceptance ``1 - TV(p_draft, p_target)`` (binary cross-entropy
  on its logit, the target detached), then calibrated at the end of training: one temperature per slot, fitted on
  the held-out sequences so that the product of the calibrated confidences matches the observed prefix acceptance
  (sequential temperature scaling, ``calibrate``), kept with the checkpoint and read by drafting.
- Loss per charged element, weighted ``exp(-d / gamma)``: ``ce_weight * CE(data token) + l1_weight * ||p_draft -
  p_target||_1 + confidence_weight * BCE``, as DeepSpec's ``compute_dspark_loss`` (the l1 term is the L1 distance of
  the two distributions, i.e. twice their total variation). It is computed in row chunks over the target's
  vocabulary, each chunk's gradients formed in its forward (``loss.chunked_terms``), never as a whole [rows, V]
  block. The elements DeepSpec does not train (``trained_elements``) weigh 0, and the engine divides the step's sum
  by the sum of the weights (``element_weights``, API 14), as DeepSpec divides each term by ``sum(w)``.
"""

from specframe import api

from .drafter import AUX, FINAL, DSparkDrafter
from .loss import chunk_terms, chunked_terms
from .model import INIT_STD, ConfidenceHead, DSparkModel, MarkovHead, RNNHead
from .options import HEAD_TYPES, RULES, DSparkOptions

__all__ = ["AUX", "FINAL", "HEAD_TYPES", "INIT_STD", "RULES", "ConfidenceHead", "DSparkDrafter", "DSparkModel",
           "DSparkOptions", "MarkovHead", "RNNHead", "chunk_terms", "chunked_terms"]

# The classes keep the home they had before the package was split by idea: ``specframe plugins --options dspark``
# reports a component's class by its module, and a pickle or a doc names it there.
for _cls in (ConfidenceHead, DSparkDrafter, DSparkModel, DSparkOptions, MarkovHead, RNNHead):
    _cls.__module__ = __name__
del _cls


@api.hookimpl
def register_drafters(register):
    register(DSparkDrafter)


@api.hookimpl
def register_verifiers(register):
    from .scheduled import ScheduledVerifier

    register(ScheduledVerifier)
