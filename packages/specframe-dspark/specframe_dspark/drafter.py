"""``DSparkDrafter``: DSpark's declarations, loss, calibration, drafting and checkpoints (the package's docstring says
what it declares and why)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specframe import api

from . import sts
from .loss import chunked_terms
from .model import DSparkModel
from .options import DSparkOptions

AUX, FINAL = "aux_hidden", "final_hidden"


class DSparkDrafter(api.block.BlockDrafter, api.eagle.QueuedInference, api.Drafter):
    """Element (a, d) is slot d of the block anchored on x_{a+1}: the anchor is the first prediction slot, so a block of
    ``block_size`` slots drafts and trains ``block_size`` depths (DFlash's is block_size - 1); what the core reads
    instead of option names (API 6) is ``api.block.BlockDrafter``'s, with ``anchor_predicts``."""

    name = "dspark"
    Options = DSparkOptions
    parallel = True
    visibility = "block"
    anchor_predicts = True
    depth_text = "block_size"
    depth_slots = "slots"
    # the target's distribution at every predicted position, for the l1 term and the confidence
    final_hidden = True

    @classmethod
    def import_options(cls, imported: Any) -> dict[str, Any]:
        """A speculators ``dspark`` folder's shape (``specframe export``'s, or one speculators / vLLM users wrote):
        the core's layers / aux layers / K and the block (``BlockDrafter``), and the heads from the config vLLM's
        ``update_dspark`` reads."""
        values = super().import_options(imported)
        config = imported.config
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
        self.init_block(target_config)
        opts = self.options
        self.model = DSparkModel(self.shape, self.vocab_size, len(self.aux_layer_ids), opts)
        self.target_head: Any = None  # the target's head (the l1 term's teacher), set by prepare
        # slot j's confidence is sigmoid(logit / T_j): 1 until `calibrate` fits them (kept in describe())
        self.confidence_temperature = torch.ones(opts.block_size, dtype=torch.float64)
        # the verification rule the temperatures were fitted for (None: not fitted, T = 1)
        self.calibration_rule: str | None = None
        self._reset_inference()

    # ---------------------------------------------------------------------------------------------------- training
    def check_training(self, depth: int, mask_builder: str, partitioner: str) -> None:
        super().check_training(depth, mask_builder, partitioner)
        if self.options.confidence_head and self.options.confidence_weight == 0:
            # DeepSpec builds the head only when it is weighted (enable_confidence_head = confidence_head_alpha > 0)
            raise api.UsageError("dspark option 'confidence_weight' is 0, so the confidence head would never train "
                                 "yet be used; set confidence_head = false, or a positive confidence_weight")

    def prepare(self, target: Any, examples: Any) -> None:
        """Take the target's head as the teacher, then its embedding and lm_head (frozen, shared) and the mask token
        (``BlockDrafter.prepare``: ``api.block.share_target``)."""
        self.target_head = api.eagle.target_head(target)
        super().prepare(target, examples)

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
        k, sup, charged = self.charged(example, elements, segment)
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
        # one call over every row: each chunk's gradients are formed in its forward (loss.chunked_terms), so only one
        # chunk's [chunk, V] logits, softmaxes and gradients live at a time and none is recomputed in backward
        total, hit, verdict, accept, logit = chunked_terms(
            h_rows, latent_rows, conf_feats, target_hidden, labels, weight, model.lm_head.weight,
            model.markov_head.markov_w2.weight, conf_w, conf_b, teacher, opts.ce_weight, opts.l1_weight,
            opts.confidence_weight, opts.loss_chunk)
        hit, logit = hit.cpu(), logit.cpu()
        # per charged element: the analytical acceptance 1 - TV and the confidence head's (calibrated) estimate of it
        # (NaN without the head)
        self.last_acceptance = accept.detach().cpu()
        self.last_confidence_estimate = torch.sigmoid(logit.double() / self.confidence_temperature[depth]).float()
        self.last_trained = trained
        correct, count_total = api.eagle.per_depth(depth, hit, k)
        # the raw logits go to the engine (API 8), which measures their calibration and hands them to `calibrate`;
        # an element the reference does not train gives none (NaN), so its chain stays out of the held-out chains
        # (those are situations drafting never meets)
        # what the confidence is calibrated against (API 12): the acceptance under the rule that will verify, not the
        # top-1 hit against the data token (the same only when the data is the target's own greedy output)
        acceptance = (verdict.cpu().double() if opts.calibration_rule == "greedy"
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
            "confidence_temperature": [float(t) for t in self.confidence_temperature],
            "confidence_calibration_rule": self.calibration_rule,
        }

    def restore_checkpoint(self, info: dict[str, Any]) -> None:
        super().restore_checkpoint(info)
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
        opts, config = self.options, imported.config
        self.check_import(imported, {"markov_rank": opts.markov_rank, "markov_head_type": opts.markov_head_type},
                          {"markov_rank": config.get("markov_rank"),
                           "markov_head_type": config.get("markov_head_type", "vanilla")})
        where = f"cannot import {imported.directory}"
        if bool(config.get("enable_confidence_head")) != opts.confidence_head:
            raise api.SpecframeError(f"{where}: its enable_confidence_head is "
                                     f"{str(bool(config.get('enable_confidence_head'))).lower()}, this dspark "
                                     f"drafter's confidence_head is {str(opts.confidence_head).lower()}")
        self.load_import(imported)
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
        weights = self.export_weights()
        ids = self.aux_layer_ids
        layouts = api.vllm_layouts
        opts = self.options
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

