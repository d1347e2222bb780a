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
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import torch

from specframe import api

from .model import DFlashModel

AUX = "aux_hidden"
#: the std of every Linear the drafter owns at the start (transformers' initializer_range, 0.02 in the references)
INIT_STD = 0.02
_positive = api.positive_int("dflash")


@torch.no_grad()
def reference_init(model: torch.nn.Module) -> None:
    """The references' start: z-lab's, SpecForge's and speculators' DFlash drafters are transformers
    ``PreTrainedModel`` s whose ``post_init`` draws every Linear N(0, initializer_range = 0.02), biases 0, norms 1
    (PyTorch's own Linear default is kaiming-uniform, std about 1 / sqrt(3 fan_in)). The embedding and lm_head are
    left alone: ``prepare`` copies the target's over them. (DSpark's ``DSparkModel.reference_init`` is the same rule;
    each package keeps its own copy, as a plugin imports only ``specframe.api``.)"""
    shared = (model.embed_tokens, model.lm_head)
    for module in model.modules():
        if any(module is s for s in shared):
            continue
        if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
            module.weight.normal_(0.0, INIT_STD)
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            module.bias.zero_()


# DFlash's target layers (z-lab's spacing), now shared with DSpark in the core (API 7)
default_aux_layers = api.block.default_aux_layers


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

    def __attrs_post_init__(self) -> None:
        if self.block_size < 2:
            raise api.UsageError(f"dflash option 'block_size' must be at least 2 (an anchor and a mask), got {self.block_size}")
        if self.k_infer is None:  # resolved here so `specframe generate` and the export read one number
            self.k_infer = self.block_size - 1
        k = self.k_infer
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.block_size - 1:
            raise api.UsageError(f"dflash option 'k_infer' must be in 1..block_size - 1 ({self.block_size - 1}), got {k!r}")
        g = self.loss_decay_gamma
        if g is not None and (isinstance(g, bool) or not isinstance(g, int | float) or not g > 0):
            raise api.UsageError(f"dflash option 'loss_decay_gamma' must be a positive number or null, got {g!r}")

    @property
    def k_train(self) -> int:
        """The training depth the engine uses when --depth is not given: every mask slot of a block."""
        return self.block_size - 1


class DFlashDrafter(api.eagle.QueuedInference, api.Drafter):
    name = "dflash"
    Options = DFlashOptions
    parallel = True
    visibility = "block"

    @classmethod
    def training(cls, options: DFlashOptions) -> api.Training:
        # every mask slot of a block is a depth; the whole block trains (no COD), and the layers keep activations
        return api.Training(depth=options.block_size - 1, k=options.k_infer, loss_chunk=options.loss_chunk)

    @classmethod
    def comparison_options(cls, depth: int, draft_vocab_size: int, k: int) -> dict[str, Any]:
        # a block is the anchor plus one mask token per depth; DFlash drafts over the full target vocabulary
        return {"block_size": depth + 1, "k_infer": min(k, depth)}

    @classmethod
    def import_options(cls, imported: Any) -> dict[str, Any]:
        values = super().import_options(imported)
        if isinstance(imported.config.get("block_size"), int):  # the block it was trained on
            values["block_size"] = int(imported.config["block_size"])
        return values

    def __init__(self, target_config: Any, options: DFlashOptions | None = None) -> None:
        super().__init__(target_config, options)
        opts = self.options
        n_layers = int(target_config.num_hidden_layers)
        ids = opts.aux_layer_ids if opts.aux_layer_ids is not None else default_aux_layers(n_layers, opts.layers)
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < n_layers]
        if not ids or bad:
            raise api.UsageError(
                f"dflash aux layer ids {ids} are invalid for a target with {n_layers} layers (valid: 0..{n_layers - 1})"
            )
        self.aux_layer_ids = ids
        self.shape = api.modeling.LayerShape.from_config(target_config)
        self.vocab_size = int(target_config.vocab_size)
        self.model = DFlashModel(self.shape, self.vocab_size, len(ids), opts.layers, self.shape.hidden)
        reference_init(self.model)
        self.mask_token_id: int | None = None
        self._reset_inference()

    # ------------------------------------------------------------------------------------------------ description
    def feature_spec(self) -> Any:
        return api.FeatureSpec(aux_layers=tuple(self.aux_layer_ids))

    def module(self) -> torch.nn.Module:
        return self.model

    @property
    def depth(self) -> int:
        return self.options.block_size - 1

    @property
    def vllm_speculative_tokens(self) -> range:
        """The draft tokens per step vLLM can serve this drafter at: ``block_size - 1`` only. vLLM's DFlash proposer
        drafts K tokens from a block of K + 1 slots (``num_query_per_req = 1 + num_speculative_tokens``) and cannot
        be told to run the full block and keep K, as ``propose`` does; the block is bidirectional, so at
        K < block_size - 1 it would serve a network this drafter was never trained as (GPU-path review item 3). The
        export records the bound (``write_dflash``'s ``min_speculative_tokens``), and vLLM serving refuses fewer."""
        return range(self.depth, self.depth + 1)

    # ---------------------------------------------------------------------------------------------------- training
    def check_training(self, depth: int, mask_builder: str, partitioner: str) -> None:
        # element (a, d) is mask slot d + 1: a block has block_size - 1 of them, so a deeper grid has no slot to train
        if depth > self.depth:
            raise api.UsageError(
                f"dflash trains at most block_size - 1 = {self.depth} depths (its mask slots), got --depth {depth}"
            )

    def forwarded_rows(self, elements: int, anchors: int) -> int:
        # every slot of each anchor's block runs through the layers (the anchor token and all block_size - 1 masks:
        # the block attends to itself bidirectionally), however few of its depths the grid trains
        return anchors * (self.depth + 1)

    def prepare(self, target: Any, examples: Any) -> None:
        """Take the target's embedding and lm_head (frozen: DFlash shares them) and pick the mask token by
        ``api.vocab``'s rule (a special or reserved token never seen in the training data), as
        ``api.block.share_target`` does for both block drafters."""
        self.mask_token_id = api.block.share_target(self.model, target, examples)

    def supervision(self, example: api.TrainingExample) -> torch.Tensor:
        # position i reads x_{i+1} with g_i and is charged with x_{i+2}: the EAGLE indexing, so the EAGLE rule
        return api.eagle.shifted_supervision(example.loss_mask, example.doc)

    @staticmethod
    def trained_elements(example: api.TrainingExample, sup: torch.Tensor, anchor: torch.Tensor,
                         depth: torch.Tensor) -> torch.Tensor:
        """Which charged elements (a, d) the loss trains, as the reference samplers choose them
        (``api.block.trained_elements``: a block anchored on a supervised token whose first target is supervised, up
        to its first unsupervised slot); the others stay charged with weight 0."""
        return api.block.trained_elements(example.loss_mask, sup, anchor, depth)

    def element_weights(self, example: api.TrainingExample, elements: api.ElementSet) -> torch.Tensor:
        """Each element's weight in the loss and the engine's normaliser (API 14): the depth decay on the trained
        elements, 0 on the others (``api.block.element_weights``), so a step's loss is SpecForge's and DeepSpec's
        ``sum(w * CE) / sum(w)`` over the trained slots."""
        return api.block.element_weights(example.loss_mask, self.supervision(example), elements.anchor,
                                         elements.depth, self.options.loss_decay_gamma)

    def loss(
        self, example: api.TrainingExample, elements: api.ElementSet, segment: api.Segment, attention: Any
    ) -> api.LossTerms:
        if self.mask_token_id is None:
            raise api.SpecframeError("dflash: prepare(target, examples) must run before loss()")
        model = self.model
        device = model.fc.weight.device
        k = elements.max_depth
        if k > self.depth:
            raise api.UsageError(f"dflash: element depth {k} exceeds block_size - 1 = {self.depth}")
        sup = self.supervision(example)
        charged = api.block.charged_blocks(elements, segment, sup)
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
    def _reset_inference(self) -> None:
        super()._reset_inference()
        self._context = api.block.BlockContext(self.model)

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
    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "mask_token_id": self.mask_token_id,
            "aux_layer_ids": list(self.aux_layer_ids),
            "vocab_size": self.vocab_size,
            **self.shape.config_fields(),
            "num_hidden_layers": self.options.layers,
        }

    def check_checkpoint(self, directory: Path, info: dict[str, Any]) -> None:
        if list(info.get("aux_layer_ids", [])) != list(self.aux_layer_ids):
            raise api.SpecframeError(
                f"{directory} was trained with aux layers {info.get('aux_layer_ids')}, this drafter has "
                f"{self.aux_layer_ids}"
            )

    def restore_checkpoint(self, info: dict[str, Any]) -> None:
        self.mask_token_id = info["mask_token_id"]

    def import_weights(self, imported: Any) -> None:
        """Load a speculators ``dflash`` folder (``specframe export``'s, or one speculators wrote) of this drafter's
        shape, with its mask token: ``generate`` / ``bench --checkpoint FOLDER``, ``export`` and ``train --init-from``
        call it after the core's reader has checked the folder against the target. A folder without
        ``embed_tokens`` / ``lm_head`` shares the target's, as vLLM does: the reader fills them from the target's
        files, else (``--init-from``, a prepared drafter) they are this drafter's own, which are the target's."""
        where = f"cannot import {imported.directory}"
        if imported.layout != "dflash":
            raise api.SpecframeError(f"{where}: it holds a {imported.layout} drafter, not dflash")
        ours = {"layers": self.options.layers, "aux_layer_ids": list(self.aux_layer_ids),
                "block_size": self.options.block_size}
        theirs = {"layers": imported.num_layers, "aux_layer_ids": list(imported.aux_layer_ids),
                  "block_size": imported.config.get("block_size")}
        for key, value in ours.items():
            if theirs[key] != value:
                raise api.SpecframeError(f"{where}: its {key} is {theirs[key]}, this dflash drafter's is {value} "
                                         f"(set drafter.{key} to match)")
        # prepared: its own embed_tokens / lm_head are the target's
        state = imported.block_state(self.model.state_dict(), own_shared_are_target=self.mask_token_id is not None)
        self.model.load_state_dict(state)
        self.mask_token_id = imported.mask_token_id

    def export_vllm(self, directory: Path, tokenizer: Any, serving: api.Serving | None = None) -> api.Manifest:
        """The speculators ``dflash`` layout vLLM serves with method ``dflash``: the module's state dict already
        carries vLLM's ``DFlashQwen3Model`` names; the layer sizes are the drafter's (the target's)."""
        if self.mask_token_id is None:
            raise api.SpecframeError("dflash: no mask token chosen (train the drafter or load a checkpoint first)")
        ids = self.aux_layer_ids
        if len(set(ids)) != len(ids):
            # vLLM collects each target layer's hidden state once, so a repeated id leaves the drafter short of inputs
            raise api.SpecframeError(
                f"dflash: aux layers {ids} repeat a target layer, which vLLM cannot serve (it collects each layer "
                f"once); a {self.target_config.num_hidden_layers}-layer target is too shallow for the default spacing "
                f"of {self.options.layers} draft layers: train with distinct drafter.aux_layer_ids"
            )
        layouts = api.vllm_layouts
        weights = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
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
