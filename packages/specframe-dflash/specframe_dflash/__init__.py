"""``dflash``: DFlash block diffusion drafting (arXiv 2602.06036, z-lab/dflash) as a third-party specframe plugin.

It imports only ``specframe.api``. What it declares, and why (README.md has the sources):

- ``visibility = "block"``: inside a draft block attention is bidirectional. The engine stamps the rule on the element
  sets, so every mask builder and the ``peagle`` partitioner apply it (API 2).
- Elements: element (a, d) is mask slot d + 1 of the block anchored on token x_{a+1} (drafter position a reads feature
  g_a and token x_{a+1}, the EAGLE pairing), so it predicts x_{a+2+d}, exactly what the core's (anchor, depth) model
  asks of depth d; the training depth is ``block_size - 1``.
- Attention inside ``loss``: a block's queries are its anchor slot and mask slots; its keys are the context (the
  target's features at positions <= a, never run through a layer) and the block itself. The drafter expresses that
  as element sets under the block rule (context = depth-0 keys, block slot s = depth s + 1) and asks the segment's
  mask builder for it (``attention.subset``), so the configured builder's memory behaviour carries over.
- Loss: cross-entropy against the data token with the target's frozen lm_head, weight exp(-d / gamma) at depth d
  (``loss_decay_gamma``, 7 by default as SpecForge's block-16 recipes), computed in row chunks over the target's vocabulary
  (``api.modeling.chunked_cross_entropy``), never as a whole [rows, V] block. It trains the elements the reference
  samplers choose (``trained_elements``): a block anchored on a supervised token whose first target is supervised, up
  to its first unsupervised slot; the engine's other charged elements weigh 0. The engine divides the step's sum by
  the sum of those weights (``element_weights``, API 14), the references' ``sum(w * CE) / sum(w)``.
- Initialisation: every module the drafter owns starts as the reference's ``post_init`` (``reference_init``).

What it does as DSpark does (the target layers, declarations, supervision, checkpoint record, import checks, export
preamble) is ``api.block.BlockDrafter``'s (API 14), and its option checks are ``api.block``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch

from specframe import api

from .model import DFlashModel

AUX = "aux_hidden"
#: the std of every Linear the drafter owns at the start (transformers' initializer_range, 0.02 in the references)
INIT_STD = api.block.INIT_STD
_positive = api.positive_int("dflash")


@torch.no_grad()
def reference_init(model: torch.nn.Module) -> None:
    """The references' start (z-lab's, SpecForge's and speculators' DFlash drafters are transformers
    ``PreTrainedModel`` s: ``post_init``), ``api.block.reference_init``; the embedding and lm_head are left alone:
    ``prepare`` copies the target's over them."""
    api.block.reference_init(model, keep=(model.embed_tokens, model.lm_head))


# DFlash's target layers (z-lab's spacing), now shared with DSpark in the core (API 7); the name is kept for callers
default_aux_layers = api.block.spaced_aux_layers


@attrs.define
class DFlashOptions:
    """DFlash settings (the ``[drafter_options]`` table of ``specframe train --config``)."""

    layers: int = attrs.field(default=5, validator=_positive, metadata={
        "help": "draft decoder layers (z-lab's released drafters have 5)"})
    block_size: int = attrs.field(default=16, validator=_positive, metadata={
        "help": "block: one anchor token plus block_size - 1 mask tokens, so block_size - 1 draft tokens per round "
                "(16 as in z-lab's b16 drafters and SpecForge's default)"})
    k_infer: int | None = attrs.field(default=None, metadata={
        "help": "tokens drafted per round on the reference engine (null: block_size - 1), the first k_infer of the "
                "full block's; vLLM serves a DFlash export at block_size - 1 only (its proposer runs K + 1 slots)"})
    aux_layer_ids: list[int] | None = attrs.field(default=None, metadata={
        "help": "target aux layer ids (hidden state entering that layer); null: DFlash's evenly spaced layers"})
    # 7 as every SpecForge DFlash recipe at block 16 (DeepSpec and speculators use 4 at blocks 7 and 8)
    loss_decay_gamma: float | None = attrs.field(default=7.0, metadata={
        "help": "weight exp(-d / gamma) on depth d (the paper's position decay; SpecForge's recipes at block 16 use "
                "7, DeepSpec and speculators 4 at blocks 7-8); null: uniform"})
    loss_chunk: int = attrs.field(default=256, validator=_positive, metadata={
        "help": "rows per chunk of the cross-entropy over the target's vocabulary (memory: one [chunk, vocab] block)"})
    max_anchors: int | None = api.block.max_anchors_field("dflash")

    def __attrs_post_init__(self) -> None:
        if self.block_size < 2:
            raise api.UsageError(f"dflash option 'block_size' must be at least 2 (an anchor and a mask), got {self.block_size}")
        api.block.resolve_k_infer("dflash", self, self.block_size - 1, "block_size - 1")
        api.block.check_decay_gamma("dflash", self.loss_decay_gamma)

    @property
    def k_train(self) -> int:
        """The training depth the engine uses when --depth is not given: every mask slot of a block."""
        return self.block_size - 1


class DFlashDrafter(api.block.BlockDrafter, api.eagle.QueuedInference, api.Drafter):
    """Element (a, d) is mask slot d + 1 of the block anchored on x_{a+1}: a block of ``block_size`` slots drafts
    and trains ``block_size - 1`` depths (``api.block.BlockDrafter`` declares them, with ``anchor_predicts`` False)."""

    name = "dflash"
    Options = DFlashOptions
    parallel = True
    visibility = "block"

    def __init__(self, target_config: Any, options: DFlashOptions | None = None) -> None:
        super().__init__(target_config, options)
        self.init_block(target_config)
        self.model = DFlashModel(self.shape, self.vocab_size, len(self.aux_layer_ids), self.options.layers,
                                 self.shape.hidden)
        reference_init(self.model)
        self._reset_inference()

    # ---------------------------------------------------------------------------------------------------- training
    def loss(
        self, example: api.TrainingExample, elements: api.ElementSet, segment: api.Segment, attention: Any
    ) -> api.LossTerms:
        if self.mask_token_id is None:
            raise api.SpecframeError("dflash: prepare(target, examples) must run before loss()")
        model = self.model
        device = model.fc.weight.device
        k, sup, charged = self.charged(example, elements, segment)
        if not charged.count:
            return api.LossTerms.empty(k, model.fc.weight)
        # Blocks are independent given the target's features: only the charged elements' blocks are run.
        anchor, depth, blocks, block_of = charged.anchor, charged.depth, charged.blocks, charged.block_of
        slots = self.depth + 1  # the anchor token and every mask slot, whatever the grid's depth
        ids = example.input_ids
        hidden = api.block.block_hidden(model, example.features[AUX], ids, elements, blocks, slots,
                                        self.mask_token_id, attention)
        # element (a, d) is slot d + 1 of block a and predicts x_{a+2+d}
        rows = (block_of * slots + depth + 1).to(device)
        target = ids[anchor + depth + 2].to(device)
        # the weights the engine's normaliser sums (element_weights): the depth decay on the trained elements
        self.last_trained = self.trained_elements(example, sup, anchor, depth)
        weight = api.block.element_weights(example.loss_mask, sup, anchor, depth,
                                           self.options.loss_decay_gamma).to(device)
        # the head is the target's whole vocabulary: full [rows, V] logits (and softmax's saved copy and gradient)
        # would be most of a step's memory, so the core's chunked cross-entropy holds one [chunk, V] block at a time
        loss_sum, hit = api.modeling.chunked_cross_entropy(
            hidden[rows], model.lm_head.weight, target, self.options.loss_chunk, row_weight=weight)
        hit = hit.cpu()
        correct, total = api.eagle.per_depth(depth, hit, k)
        return api.LossTerms(loss_sum, int(anchor.numel()), correct, total, hit=hit)

    # --------------------------------------------------------------------------------------------------- inference
    @torch.no_grad()
    def propose(self, k: int, generator: torch.Generator | None = None) -> api.Draft:
        self.check_k(k)
        k = min(k, self.depth)  # a block drafts at most block_size - 1 tokens
        slots = self.depth + 1  # always the block it was trained as (GPU-path review item 3, below)
        tokens, aux = self._pending.take()
        # the new (token, feature) pairs extend the context: features at positions cached .. cached + p - 1
        self._context.extend(aux)
        anchor = int(tokens[-1])  # x_{t+1}, the token the target committed last; its feature is not known yet
        # The whole block of block_size slots, whatever k: attention inside it is bidirectional, so every slot's
        # output depends on how many mask slots follow, and a shorter block (k + 1 slots) would be a network it was
        # never trained as. z-lab's dflash_generate drafts the full block too; the first k drafts are kept.
        hidden = self._context.run(anchor, slots, self.mask_token_id)
        draft = self.model.lm_head(hidden[1 : k + 1]).argmax(-1)
        return api.Draft(tokens=draft.cpu())

    # -------------------------------------------------------------------------------------------------- checkpoints
    def import_weights(self, imported: Any) -> None:
        """Load a speculators ``dflash`` folder (``specframe export``'s, or one speculators wrote) of this drafter's
        shape, with its mask token: ``generate`` / ``bench --checkpoint FOLDER``, ``export`` and ``train --init-from``
        call it after the core's reader has checked the folder against the target (``BlockDrafter.check_import`` and
        ``load_import``: a folder without ``embed_tokens`` / ``lm_head`` shares the target's, as vLLM does)."""
        self.check_import(imported, {}, {})
        self.load_import(imported)

    def export_vllm(self, directory: Path, tokenizer: Any, serving: api.Serving | None = None) -> api.Manifest:
        """The speculators ``dflash`` layout vLLM serves with method ``dflash``: the module's state dict already
        carries vLLM's ``DFlashQwen3Model`` names; the layer sizes are the drafter's (the target's)."""
        weights = self.export_weights()
        layouts = api.vllm_layouts
        config = layouts.llama_config(self.target_config, self.options.layers, **self.shape.config_fields())
        serves = self.vllm_speculative_tokens
        # k_infer is the reference engine's; vLLM's default must be a number it serves this drafter at
        tokens = self.options.k_infer if self.options.k_infer in serves else serves[-1]
        return layouts.write_dflash(
            directory, weights, config=config, aux_layer_ids=self.aux_layer_ids, target_hidden_size=self.shape.hidden,
            mask_token_id=self.mask_token_id, block_size=self.options.block_size,
            target_num_layers=int(self.target_config.num_hidden_layers), tokenizer=tokenizer, drafter=self.name,
            verifier=layouts.verifier_of(self.target_config),
            verifier_architectures=layouts.verifier_architectures_of(self.target_config),
            speculative_tokens=tokens, min_speculative_tokens=serves[0], serving=serving,
        )


@api.hookimpl
def register_drafters(register):
    register(DFlashDrafter)
