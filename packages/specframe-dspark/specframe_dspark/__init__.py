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
  vocabulary, each chunk recomputed in backward (activation checkpointing), never as a whole [rows, V] block. The
  elements DeepSpec does not train (``trained_elements``) weigh 0, and the engine divides the step's sum by the sum
  of the weights (``element_weights``, API 14), as DeepSpec divides each term by ``sum(w)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from specframe import api

from . import sts

AUX, FINAL = "aux_hidden", "final_hidden"
HEAD_TYPES = ("vanilla", "rnn")
#: the verification rules a confidence can be calibrated for (the 'scheduled' verifier's rules)
RULES = ("greedy", "sampling")
#: the std of every Linear / Embedding at the start (transformers' initializer_range, DeepSpec's Qwen3 config)
INIT_STD = 0.02
_positive = api.positive_int("dspark")


def _non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise api.UsageError(f"dspark option '{attribute.name}' must be a non-negative number, got {value!r}")


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

    def __attrs_post_init__(self) -> None:
        if self.k_infer is None:  # resolved here so `specframe generate` and the export read one number
            self.k_infer = self.block_size
        k = self.k_infer
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.block_size:
            raise api.UsageError(f"dspark option 'k_infer' must be in 1..block_size ({self.block_size}), got {k!r}")
        if self.calibration_rule not in RULES:
            raise api.UsageError(f"dspark option 'calibration_rule' must be one of {', '.join(RULES)}, got "
                                 f"{self.calibration_rule!r}")
        if self.markov_head_type not in HEAD_TYPES:
            raise api.UsageError(f"dspark option 'markov_head_type' must be one of {', '.join(HEAD_TYPES)}, got "
                                 f"{self.markov_head_type!r}")
        g = self.loss_decay_gamma
        if g is not None and (isinstance(g, bool) or not isinstance(g, int | float) or not g > 0):
            raise api.UsageError(f"dspark option 'loss_decay_gamma' must be a positive number or null, got {g!r}")
        if self.ce_weight + self.l1_weight == 0:
            raise api.UsageError("dspark options 'ce_weight' and 'l1_weight' are both 0: nothing trains the drafts")

    @property
    def k_train(self) -> int:
        """The training depth the engine uses when --depth is not given: every slot of a block."""
        return self.block_size


# ------------------------------------------------------------------------------------------------------- the heads


class MarkovHead(nn.Module):
    """The vanilla head: bias = markov_w2(markov_w1[x_prev]) (names as vLLM's ``DSparkMarkovHead``)."""

    def __init__(self, vocab: int, rank: int, hidden: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def latents(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced latents [B, S, r] of blocks whose slot s follows ``prev[:, s]``; the bias is w2(latent)."""
        return self.markov_w1(prev)

    def step(self, state: Any, prev: torch.Tensor, hidden: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """One drafting step: (new state, latent) for the slot with backbone state ``hidden`` after token ``prev``."""
        return state, self.markov_w1(prev)


class RNNHead(MarkovHead):
    """The RNN head (DeepSpec's ``RNNHead``): a gated state s_k = g s_{k-1} + (1 - g) c over the block, from
    [s_{k-1}; W1[x_{k-1}]; h_k] through one joint projection to (gate, candidate, output); latent tanh(output)."""

    def __init__(self, vocab: int, rank: int, hidden: int) -> None:
        super().__init__(vocab, rank, hidden)
        self.rank = rank
        self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def step(self, state, prev, hidden):
        if state is None:
            state = hidden.new_zeros(*hidden.shape[:-1], self.rank)
        gate, cand, out = self.joint_proj(torch.cat([state, self.markov_w1(prev), hidden], -1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(cand)
        return state, torch.tanh(out)

    def latents(self, prev, hidden):
        state, out = None, []
        for s in range(prev.shape[1]):
            state, latent = self.step(state, prev[:, s], hidden[:, s])
            out.append(latent)
        return torch.stack(out, 1)


class ConfidenceHead(nn.Module):
    """Linear logit of the acceptance probability (names as vLLM's ``DSparkConfidenceHead``: ``proj``, with bias)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkModel(api.block.BlockModel):
    """The DFlash block backbone (``api.block.BlockModel``, vLLM's names) plus ``markov_head`` and
    ``confidence_head`` (vLLM's ``Qwen3DSparkModel``)."""

    def __init__(self, shape, vocab_size: int, n_aux: int, options: DSparkOptions) -> None:
        super().__init__(shape, vocab_size, n_aux, options.layers, shape.hidden)
        cls = RNNHead if options.markov_head_type == "rnn" else MarkovHead
        self.markov_head = cls(vocab_size, options.markov_rank, shape.hidden)
        self.with_markov = options.confidence_head_with_markov
        self.confidence_head = None
        if options.confidence_head:
            self.confidence_head = ConfidenceHead(shape.hidden + (options.markov_rank if self.with_markov else 0))
        self.reference_init()

    @torch.no_grad()
    def reference_init(self) -> None:
        """DeepSpec's start (its drafter is a transformers ``PreTrainedModel``, ``post_init``; SpecForge and
        speculators alike): every Linear and Embedding N(0, INIT_STD), biases 0, norms 1. PyTorch's defaults would
        start ``markov_w1`` at N(0, 1), a random bias of about +-0.6 nats on every logit from the previous token.
        The embedding and lm_head are the target's, copied over this by ``prepare``."""
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.weight.normal_(0.0, INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()

    def confidence_logit(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        feats = torch.cat([hidden, self.markov_head.embed(prev).to(hidden.dtype)], -1) if self.with_markov else hidden
        return self.confidence_head(feats)


def _chunk_terms(hidden, latent, conf_feats, target_hidden, labels, weight, lm_w, w2, conf_w, conf_b,
                 target_head, ce_w: float, l1_w: float, c_w: float):
    """One chunk of rows: the weighted loss sum, each row's top-1 hit (against the data token), its greedy verdict
    (against the target's argmax), its analytical acceptance 1 - TV and the confidence head's raw logit (NaN without
    the head)."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    logits = (F.linear(hidden, lm_w) + F.linear(latent, w2)).to(dtype)
    logq = torch.log_softmax(logits, -1)
    ce = -logq.gather(1, labels[:, None]).squeeze(1)
    with torch.no_grad():
        p = torch.softmax(target_head.logits(target_hidden).to(dtype), -1)
    l1 = (logq.exp() - p).abs().sum(-1)
    accept = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    per = ce_w * ce + l1_w * l1
    confidence = torch.full_like(accept, float("nan"))
    if conf_feats is not None:
        conf = F.linear(conf_feats, conf_w, conf_b).squeeze(-1).to(dtype)
        per = per + c_w * F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
        confidence = conf.detach()
    top1 = logits.argmax(-1)
    return (per * weight).sum(), top1 == labels, top1 == p.argmax(-1), accept, confidence


class DSparkDrafter(api.eagle.QueuedInference, api.Drafter):
    name = "dspark"
    Options = DSparkOptions
    parallel = True
    visibility = "block"

    # what the core reads instead of option names (API 6): the anchor is the first prediction slot, so a block of
    # block_size slots drafts block_size tokens and trains block_size depths (DFlash's is block_size - 1)
    @classmethod
    def training(cls, options: DSparkOptions) -> api.Training:
        return api.Training(depth=options.block_size, k=options.k_infer, loss_chunk=options.loss_chunk)

    @classmethod
    def comparison_options(cls, depth: int, draft_vocab_size: int, k: int) -> dict[str, Any]:
        return {"block_size": depth, "k_infer": min(k, depth)}  # over the full target vocabulary, as DFlash

    @classmethod
    def import_options(cls, imported: Any) -> dict[str, Any]:
        """A speculators ``dspark`` folder's shape (``specframe export``'s, or one speculators / vLLM users wrote):
        the core's layers / aux layers / K, and the block and heads from the config vLLM's ``update_dspark`` reads."""
        values = super().import_options(imported)
        config = imported.config
        if isinstance(config.get("block_size"), int):  # the block it was trained on
            values["block_size"] = int(config["block_size"])
        if isinstance(config.get("markov_rank"), int):
            values["markov_rank"] = int(config["markov_rank"])
        if isinstance(config.get("markov_head_type"), str):
            values["markov_head_type"] = config["markov_head_type"]
        if isinstance(config.get("enable_confidence_head"), bool):
            values["confidence_head"] = config["enable_confidence_head"]
            values["confidence_head_with_markov"] = bool(config.get("confidence_head_with_markov", False))
        values.pop("draft_vocab_size", None)  # DSpark drafts over the target's whole vocabulary
        return values

    def __init__(self, target_config: Any, options: DSparkOptions | None = None) -> None:
        super().__init__(target_config, options)
        opts = self.options
        n_layers = int(target_config.num_hidden_layers)
        ids = opts.aux_layer_ids if opts.aux_layer_ids is not None else api.block.default_aux_layers(n_layers,
                                                                                                     opts.layers)
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < n_layers]
        if not ids or bad:
            raise api.UsageError(
                f"dspark aux layer ids {ids} are invalid for a target with {n_layers} layers (valid: 0..{n_layers - 1})"
            )
        self.aux_layer_ids = ids
        self.shape = api.modeling.LayerShape.from_config(target_config)
        self.vocab_size = int(target_config.vocab_size)
        self.model = DSparkModel(self.shape, self.vocab_size, len(ids), opts)
        self.mask_token_id: int | None = None
        self.target_head: Any = None  # the target's head (the l1 term's teacher), set by prepare
        # slot j's confidence is sigmoid(logit / T_j): 1 until `calibrate` fits them (kept in describe())
        self.confidence_temperature = torch.ones(opts.block_size, dtype=torch.float64)
        # the verification rule the temperatures were fitted for (None: not fitted, T = 1)
        self.calibration_rule: str | None = None
        self._reset_inference()

    # ------------------------------------------------------------------------------------------------ description
    def feature_spec(self) -> Any:
        # final_hidden: the target's distribution at every predicted position, for the l1 term and the confidence
        return api.FeatureSpec(aux_layers=tuple(self.aux_layer_ids), final_hidden=True)

    def module(self) -> torch.nn.Module:
        return self.model

    @property
    def depth(self) -> int:
        return self.options.block_size

    @property
    def vllm_speculative_tokens(self) -> range:
        """vLLM's DSpark speculator (``sample_from_anchor``) runs a block of exactly K slots for K tokens; the block
        is bidirectional, so only K = block_size is the network this drafter was trained as."""
        return range(self.depth, self.depth + 1)

    # ---------------------------------------------------------------------------------------------------- training
    def check_training(self, depth: int, mask_builder: str, partitioner: str) -> None:
        if depth > self.depth:
            raise api.UsageError(
                f"dspark trains at most block_size = {self.depth} depths (its slots), got --depth {depth}")
        if self.options.confidence_head and self.options.confidence_weight == 0:
            # DeepSpec builds the head only when it is weighted (enable_confidence_head = confidence_head_alpha > 0)
            raise api.UsageError("dspark option 'confidence_weight' is 0, so the confidence head would never train "
                                 "yet be used; set confidence_head = false, or a positive confidence_weight")

    def forwarded_rows(self, elements: int, anchors: int) -> int:
        # every slot of each anchor's block runs through the layers, however few of its depths the grid trains
        return anchors * self.depth

    def prepare(self, target: Any, examples: Any) -> None:
        """Take the target's embedding and lm_head (frozen, shared) and its head as the teacher, and pick the mask
        token by ``api.vocab``'s rule (a special or reserved token never seen in the training data): DFlash's
        ``api.block.share_target``."""
        self.target_head = api.eagle.target_head(target)
        self.mask_token_id = api.block.share_target(self.model, target, examples)

    def supervision(self, example: api.TrainingExample) -> torch.Tensor:
        # position i reads x_{i+1} with g_i and is charged with x_{i+2}: the EAGLE indexing, so the EAGLE rule
        return api.eagle.shifted_supervision(example.loss_mask, example.doc)

    @staticmethod
    def trained_elements(example: api.TrainingExample, sup: torch.Tensor, anchor: torch.Tensor,
                         depth: torch.Tensor) -> torch.Tensor:
        """Which charged elements (a, d) the loss trains, as DeepSpec's and SpecForge's samplers choose them
        (DFlash's rule, ``api.block.trained_elements``: a block anchored on a supervised token whose first target is
        supervised, up to its first unsupervised slot); the others stay charged with weight 0."""
        return api.block.trained_elements(example.loss_mask, sup, anchor, depth)

    def element_weights(self, example: api.TrainingExample, elements: api.ElementSet) -> torch.Tensor:
        """Each element's weight in the loss and the engine's normaliser (API 14): the depth decay on the trained
        elements, 0 on the others (``api.block.element_weights``), so a step's loss is DeepSpec's
        ``sum(w * terms) / sum(w)``."""
        return api.block.element_weights(example.loss_mask, self.supervision(example), elements.anchor,
                                         elements.depth, self.options.loss_decay_gamma)

    def _teacher(self, device: torch.device, dtype: torch.dtype) -> Any:
        if self.target_head is None:
            # a drafter restored from a checkpoint without prepare(): the head is the lm_head it shares (a plain
            # matmul; prepare's target_head would carry a bias or soft-capping a target applies)
            return api.eagle.TargetHead(weight=self.model.lm_head.weight)
        return self.target_head.to(device=device, dtype=dtype)

    def loss(
        self, example: api.TrainingExample, elements: api.ElementSet, segment: api.Segment, attention: Any
    ) -> api.LossTerms:
        if self.mask_token_id is None:
            raise api.SpecframeError("dspark: prepare(target, examples) must run before loss()")
        if FINAL not in example.features:
            raise api.UsageError("dspark needs the target's final hidden states (its l1 term is over the whole "
                                 "vocabulary); a feature cache with only a top-k teacher cannot train it")
        model, opts = self.model, self.options
        device, dtype = model.fc.weight.device, model.fc.weight.dtype
        k = elements.max_depth
        if k > self.depth:
            raise api.UsageError(f"dspark: element depth {k} exceeds block_size = {self.depth}")
        sup = self.supervision(example)
        charged = api.block.charged_blocks(elements, segment, sup)
        if not charged.count:
            return api.LossTerms.empty(k, model.fc.weight)
        anchor, depth, blocks, block_of = charged.anchor, charged.depth, charged.blocks, charged.block_of
        slots = self.depth
        ids = example.input_ids
        hidden = api.block.block_hidden(model, example.features[AUX], ids, elements, blocks, slots,
                                        self.mask_token_id, attention)
        # teacher forcing: slot s of block a follows x_{a+1+s} (the anchor token for s = 0). Positions past the
        # sequence are clamped: they only feed slots that are never charged (their target would lie past the end).
        last = ids.shape[0] - 1
        prev_blocks = ids[(blocks[:, None] + 1 + torch.arange(slots)).clamp(max=last)].to(device)
        hidden_blocks = hidden.view(blocks.numel(), slots, -1)
        latents = model.markov_head.latents(prev_blocks, hidden_blocks)  # [blocks, slots, r], RNN: over the block
        rows = (block_of * slots + depth).to(device)
        h_rows = hidden[rows]
        latent_rows = latents.reshape(-1, latents.shape[-1])[rows]
        prev_rows = prev_blocks.reshape(-1)[rows]
        conf_feats = None
        conf_w = conf_b = None
        if model.confidence_head is not None:
            conf_feats = (torch.cat([h_rows, model.markov_head.embed(prev_rows).to(h_rows.dtype)], -1)
                          if model.with_markov else h_rows)
            conf_w, conf_b = model.confidence_head.proj.weight, model.confidence_head.proj.bias
        labels = ids[anchor + depth + 2].to(device)
        # the target's distribution for x_{a+2+d} comes from its final hidden state at position a+1+d
        target_hidden = example.features[FINAL][anchor + depth + 1].to(device=device, dtype=dtype)
        trained = self.trained_elements(example, sup, anchor, depth)
        # the weights the engine's normaliser sums (element_weights): the depth decay on the trained elements
        weight = api.block.element_weights(example.loss_mask, sup, anchor, depth,
                                           opts.loss_decay_gamma).to(dtype).to(device)
        teacher = self._teacher(device, dtype)
        total = hidden.new_zeros(())
        hits, greedy, accepts, confidences = [], [], [], []
        n, chunk = int(rows.numel()), opts.loss_chunk
        for lo in range(0, n, chunk):
            sl = slice(lo, lo + chunk)
            args = (h_rows[sl], latent_rows[sl], None if conf_feats is None else conf_feats[sl], target_hidden[sl],
                    labels[sl], weight[sl], model.lm_head.weight, model.markov_head.markov_w2.weight, conf_w, conf_b,
                    teacher, opts.ce_weight, opts.l1_weight, opts.confidence_weight)
            # recomputed in backward: only one chunk's [chunk, V] logits, softmaxes and gradients live at a time
            part, hit, verdict, accept, confidence = checkpoint(_chunk_terms, *args, use_reentrant=False) if torch.is_grad_enabled() \
                else _chunk_terms(*args)
            total = total + part
            hits.append(hit)
            greedy.append(verdict)
            accepts.append(accept)
            confidences.append(confidence)
        hit = torch.cat(hits).cpu()
        logit = torch.cat(confidences).cpu()
        # per charged element: the analytical acceptance 1 - TV and the confidence head's (calibrated) estimate of it
        # (NaN without the head)
        self.last_acceptance = torch.cat(accepts).detach().cpu()
        self.last_confidence_estimate = torch.sigmoid(logit.double() / self.confidence_temperature[depth]).float()
        self.last_trained = trained
        correct, count_total = api.eagle.per_depth(depth, hit, k)
        # the raw logits go to the engine (API 8), which measures their calibration and hands them to `calibrate`;
        # an element the reference does not train gives none (NaN), so its chain stays out of the held-out chains
        # (those are situations drafting never meets)
        # what the confidence is calibrated against (API 12): the acceptance under the rule that will verify, not the
        # top-1 hit against the data token (the same only when the data is the target's own greedy output)
        acceptance = (torch.cat(greedy).cpu().double() if opts.calibration_rule == "greedy"
                      else self.last_acceptance.double())
        return api.LossTerms(total, int(anchor.numel()), correct, count_total, hit=hit,
                             confidence=logit.masked_fill(~trained, float("nan"))
                             if model.confidence_head is not None else None, acceptance=acceptance)

    # ------------------------------------------------------------------------------------------------- calibration
    def calibrated_confidence(self, logits: torch.Tensor) -> torch.Tensor:
        return api.calibration.apply_temperatures(logits, self.confidence_temperature)

    def calibrate(self, logits: torch.Tensor, accepted: torch.Tensor) -> bool:
        """Sequential temperature scaling on the held-out chains by ECE grid search (``sts.fit_temperatures``, the
        paper's): slot j's temperature with slots 0..j-1's fixed, so the product of the confidences predicts the
        prefix acceptance the scheduler weighs. ``accepted`` is what ``loss`` returned as ``LossTerms.acceptance``:
        the acceptance under ``calibration_rule``, which the fit is recorded for."""
        if self.model.confidence_head is None or not self.options.calibrate_confidence:
            return False
        fitted = sts.fit_temperatures(logits, accepted)
        self.confidence_temperature = torch.ones(self.depth, dtype=torch.float64)
        self.confidence_temperature[: fitted.numel()] = fitted
        self.calibration_rule = self.options.calibration_rule
        return True

    # --------------------------------------------------------------------------------------------------- inference
    def _reset_inference(self) -> None:
        super()._reset_inference()
        self._context = api.block.BlockContext(self.model)
        self.last_confidence: torch.Tensor | None = None

    @torch.no_grad()
    def propose(self, k: int, generator: torch.Generator | None = None) -> api.Draft:
        """The backbone runs the whole block in one pass (always block_size slots: attention inside the block is
        bidirectional, so a shorter block is another network); the sequential stage then drafts left to right, each
        slot's logits biased by the token drafted before it (the anchor for the first). Drafts are the argmax
        (``draft_temperature`` 0: one-hot q for the verifiers) or drawn from softmax(logits / T) with ``generator``,
        their q returned as ``Draft.probs``; ``last_confidence`` holds each kept slot's confidence."""
        self.check_k(k)
        k = min(k, self.depth)
        model = self.model
        tokens, aux = self._pending.take()
        self._context.extend(aux)
        prev = tokens[-1:].to(model.fc.weight.device)  # x_{t+1}, the anchor: slot 0's previous token
        hidden = self._context.run(int(prev), self.depth, self.mask_token_id)
        base = model.lm_head(hidden[:k])
        temperature = float(self.options.draft_temperature)
        state, drafted, conf, probs = None, [], [], []
        for i in range(k):
            h = hidden[i : i + 1]
            state, latent = model.markov_head.step(state, prev, h)
            logits = base[i : i + 1] + model.markov_head.markov_w2(latent)
            if model.confidence_head is not None:
                conf.append(torch.sigmoid(model.confidence_logit(h, prev).double() / self.confidence_temperature[i]))
            if temperature > 0:
                q = torch.softmax(logits.double() / temperature, -1).cpu()
                prev = torch.multinomial(q, 1, generator=generator).reshape(1).to(logits.device)
                probs.append(q)
            else:
                prev = logits.argmax(-1)
            drafted.append(prev)
        self.last_confidence = torch.cat(conf).float().cpu() if conf else None
        # slot i's confidence reads the token drafted before it, never its own: a verifier may schedule on it and
        # stay lossless (api.Verifier.schedule)
        return api.Draft(tokens=torch.cat(drafted).cpu(), probs=torch.cat(probs).float() if probs else None,
                         confidence=self.last_confidence)

    # -------------------------------------------------------------------------------------------------- checkpoints
    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "mask_token_id": self.mask_token_id,
            "aux_layer_ids": list(self.aux_layer_ids),
            "vocab_size": self.vocab_size,
            **self.shape.config_fields(),
            "num_hidden_layers": self.options.layers,
            "confidence_temperature": [float(t) for t in self.confidence_temperature],
            "confidence_calibration_rule": self.calibration_rule,
        }

    def check_checkpoint(self, directory: Path, info: dict[str, Any]) -> None:
        if list(info.get("aux_layer_ids", [])) != list(self.aux_layer_ids):
            raise api.SpecframeError(
                f"{directory} was trained with aux layers {info.get('aux_layer_ids')}, this drafter has "
                f"{self.aux_layer_ids}"
            )

    def restore_checkpoint(self, info: dict[str, Any]) -> None:
        self.mask_token_id = info["mask_token_id"]
        # a checkpoint written before calibration existed (or never calibrated) keeps T = 1: the head as trained
        temperatures = info.get("confidence_temperature")
        if temperatures is not None:
            if len(temperatures) != self.depth or not all(isinstance(t, int | float) and t > 0 for t in temperatures):
                raise api.SpecframeError(f"dspark: the checkpoint's confidence_temperature {temperatures!r} is not "
                                         f"{self.depth} positive numbers")
            self.confidence_temperature = torch.tensor(temperatures, dtype=torch.float64)
        # a checkpoint calibrated before the rule was recorded was fitted on top-1 hits against the data token
        fitted = temperatures is not None and any(t != 1 for t in temperatures)
        self.calibration_rule = info.get("confidence_calibration_rule", "data-top1" if fitted else None)

    def import_weights(self, imported: Any) -> None:
        """Load a speculators ``dspark`` folder of this drafter's shape, with its mask token: ``generate`` / ``bench
        --checkpoint FOLDER``, ``export`` and ``train --init-from`` call it after the core's reader has checked the
        folder against the target. A folder without ``embed_tokens`` / ``lm_head`` shares the target's (vLLM does):
        the reader fills them from the target's files, else (``--init-from``, a prepared drafter) they are this
        drafter's own, which are the target's. The folder carries no calibration (T = 1 until one is fitted) unless
        specframe exported it: then its temperatures and the rule they were fitted for."""
        where = f"cannot import {imported.directory}"
        if imported.layout != "dspark":
            raise api.SpecframeError(f"{where}: it holds a {imported.layout} drafter, not dspark")
        opts, config = self.options, imported.config
        ours = {"layers": opts.layers, "aux_layer_ids": list(self.aux_layer_ids), "block_size": opts.block_size,
                "markov_rank": opts.markov_rank, "markov_head_type": opts.markov_head_type}
        theirs = {"layers": imported.num_layers, "aux_layer_ids": list(imported.aux_layer_ids),
                  "block_size": config.get("block_size"), "markov_rank": config.get("markov_rank"),
                  "markov_head_type": config.get("markov_head_type", "vanilla")}
        for key, value in ours.items():
            if theirs[key] != value:
                raise api.SpecframeError(f"{where}: its {key} is {theirs[key]!r}, this dspark drafter's is {value!r} "
                                         f"(set drafter.{key} to match)")
        if bool(config.get("enable_confidence_head")) != opts.confidence_head:
            raise api.SpecframeError(f"{where}: its enable_confidence_head is "
                                     f"{str(bool(config.get('enable_confidence_head'))).lower()}, this dspark "
                                     f"drafter's confidence_head is {str(opts.confidence_head).lower()}")
        # prepared: its own embed_tokens / lm_head are the target's
        state = imported.block_state(self.model.state_dict(), own_shared_are_target=self.mask_token_id is not None)
        self.model.load_state_dict(state)
        self.mask_token_id = imported.mask_token_id
        self.confidence_temperature = torch.ones(self.depth, dtype=torch.float64)
        self.calibration_rule = None
        # a specframe export keeps the fitted calibration in its ``specframe`` entry (read into the flat config)
        temperatures = config.get("confidence_temperature")
        if temperatures is not None and opts.confidence_head:
            self.restore_checkpoint({"mask_token_id": self.mask_token_id, "confidence_temperature": temperatures,
                                     "confidence_calibration_rule": config.get("confidence_calibration_rule")})

    def export_vllm(self, directory: Path, tokenizer: Any, serving: api.Serving | None = None) -> api.Manifest:
        """The speculators ``dspark`` layout vLLM 0.32 serves with method ``dspark``: the module's state dict already
        carries vLLM's ``Qwen3DSparkModel`` names."""
        if self.mask_token_id is None:
            raise api.SpecframeError("dspark: no mask token chosen (train the drafter or load a checkpoint first)")
        ids = self.aux_layer_ids
        if len(set(ids)) != len(ids):
            # vLLM collects each target layer's hidden state once, so a repeated id leaves the drafter short of inputs
            raise api.SpecframeError(
                f"dspark: aux layers {ids} repeat a target layer, which vLLM cannot serve (it collects each layer "
                f"once); train with distinct drafter.aux_layer_ids"
            )
        layouts = api.vllm_layouts
        opts = self.options
        weights = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
        # a head never trained (confidence_weight 0, a checkpoint from before training refused it) is exported
        # switched off, as DeepSpec derives enable_confidence_head = confidence_head_alpha > 0: vLLM would otherwise
        # verify by its untrained estimates
        head = opts.confidence_head and opts.confidence_weight > 0
        if not head:
            weights = {k: v for k, v in weights.items() if not k.startswith("confidence_head.")}
        config = layouts.llama_config(self.target_config, opts.layers, **self.shape.config_fields())
        return layouts.write_dspark(
            directory, weights, config=config, aux_layer_ids=ids, target_hidden_size=self.shape.hidden,
            mask_token_id=self.mask_token_id, block_size=opts.block_size, markov_rank=opts.markov_rank,
            markov_head_type=opts.markov_head_type, enable_confidence_head=head,
            confidence_head_with_markov=opts.confidence_head_with_markov,
            confidence_temperature=[float(t) for t in self.confidence_temperature] if self.calibration_rule else None,
            confidence_calibration_rule=self.calibration_rule,
            target_num_layers=int(self.target_config.num_hidden_layers), tokenizer=tokenizer, drafter=self.name,
            verifier=layouts.verifier_of(self.target_config),
            verifier_architectures=layouts.verifier_architectures_of(self.target_config), serving=serving,
        )


@api.hookimpl
def register_drafters(register):
    register(DSparkDrafter)


@api.hookimpl
def register_verifiers(register):
    from .scheduled import ScheduledVerifier

    register(ScheduledVerifier)
