"""DSpark's options (the ``[drafter_options]`` table of ``specframe train --config``) and their checks."""

from __future__ import annotations

import attrs

from specframe import api

HEAD_TYPES = ("vanilla", "rnn")
#: the verification rules a confidence can be calibrated for (the 'scheduled' verifier's rules)
RULES = ("greedy", "sampling")
_positive = api.positive_int("dspark")
_non_negative = api.non_negative("dspark")


@attrs.define
class DSparkOptions:
    """DSpark settings (the ``[drafter_options]`` table of ``specframe train --config``); defaults from DeepSpec's
    ``config/dspark/dspark_qwen3_4b.py``."""

    layers: int = attrs.field(default=5, validator=_positive, metadata={
        "help": "draft decoder layers of the parallel backbone (DeepSpec's num_draft_layers: 5)"})
    block_size: int = attrs.field(default=7, validator=_positive, metadata={
        "help": "slots per block: the anchor token and block_size - 1 mask tokens; every slot predicts (the anchor "
                "is the first prediction position), so block_size draft tokens per round (DeepSpec: 7)"})
    k_infer: int | None = attrs.field(default=None, metadata={
        "help": "tokens drafted per round on the reference engine (null: block_size), the first k_infer of the full "
                "block's; vLLM serves a DSpark export at block_size only"})
    aux_layer_ids: list[int] | None = attrs.field(default=None, metadata={
        "help": "target aux layer ids (hidden state entering that layer); null: evenly spaced as DFlash / DeepSpec"})
    markov_head_type: str = attrs.field(default="vanilla", metadata={
        "help": "sequential head: 'vanilla' (low-rank Markov transition W2 W1[x_prev]; what vLLM serves) or 'rnn' "
                "(a gated recurrent state over the block; reference engine only)"})
    markov_rank: int = attrs.field(default=256, validator=_positive, metadata={
        "help": "rank r of the Markov head's transition (W1: vocab x r, W2: r x vocab); DeepSpec: 256"})
    confidence_head: bool = attrs.field(default=True, metadata={
        "help": "train the confidence head (per-slot acceptance estimate toward 1 - TV(p_draft, p_target))"})
    confidence_head_with_markov: bool = attrs.field(default=True, metadata={
        "help": "the confidence head also reads the previous token's Markov embedding W1[x_prev] (DeepSpec: true)"})
    ce_weight: float = attrs.field(default=0.1, validator=_non_negative, metadata={
        "help": "weight of the cross-entropy against the data token (DeepSpec's ce_loss_alpha: 0.1)"})
    l1_weight: float = attrs.field(default=0.9, validator=_non_negative, metadata={
        "help": "weight of the L1 distance between draft and target distributions (DeepSpec's l1_loss_alpha: 0.9)"})
    confidence_weight: float = attrs.field(default=1.0, validator=_non_negative, metadata={
        "help": "weight of the confidence head's BCE (DeepSpec's confidence_head_alpha: 1.0)"})
    loss_decay_gamma: float | None = attrs.field(default=4.0, metadata={
        "help": "weight exp(-d / gamma) on slot d (d = 0 at the anchor); null: uniform (DeepSpec: 4)"})
    calibrate_confidence: bool = attrs.field(default=True, metadata={
        "help": "at the end of training, fit one temperature per slot on the held-out sequences so the product of "
                "the confidences matches the prefix acceptance under calibration_rule (sequential temperature "
                "scaling by ECE grid search, the paper's calibration); kept with the checkpoint and the export, "
                "read by drafting and the 'scheduled' verifier"})
    calibration_rule: str = attrs.field(default="greedy", metadata={
        "help": "the verification the confidence is calibrated for: 'greedy' (accepted iff the draft token is the "
                "target's argmax; the default verifier and vLLM at temperature 0) or 'sampling' (speculative "
                "sampling at temperature 1: the expected acceptance 1 - TV); recorded with the fit"})
    draft_temperature: float = attrs.field(default=0.0, validator=_non_negative, metadata={
        "help": "drafting on the reference engine: 0 takes each slot's argmax (one-hot q); > 0 samples each slot from "
                "softmax(logits / T) left to right and hands the verifier that q (Draft.probs)"})
    loss_chunk: int = attrs.field(default=256, validator=_positive, metadata={
        "help": "rows per chunk of the loss over the target's vocabulary (memory: a few [chunk, vocab] blocks)"})
    max_anchors: int | None = api.block.max_anchors_field("dspark")

    def __attrs_post_init__(self) -> None:
        api.block.resolve_k_infer("dspark", self, self.block_size, "block_size")
        if self.calibration_rule not in RULES:
            raise api.UsageError(f"dspark option 'calibration_rule' must be one of {', '.join(RULES)}, got "
                                 f"{self.calibration_rule!r}")
        if self.markov_head_type not in HEAD_TYPES:
            raise api.UsageError(f"dspark option 'markov_head_type' must be one of {', '.join(HEAD_TYPES)}, got "
                                 f"{self.markov_head_type!r}")
        api.block.check_decay_gamma("dspark", self.loss_decay_gamma)
        if self.ce_weight + self.l1_weight == 0:
            raise api.UsageError("dspark options 'ce_weight' and 'l1_weight' are both 0: nothing trains the drafts")

    @property
    def k_train(self) -> int:
        """The training depth the engine uses when --depth is not given: every slot of a block."""
        return self.block_size

