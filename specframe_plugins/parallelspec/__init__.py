"""``parallelspec``: ParallelSpec (Xiao et al. 2024, arXiv 2410.05589), a parallel drafter with k distinct masks.

What the paper fixes (section 3): the drafter appends k-1 mask tokens [MASK]_1..[MASK]_{k-1}, each with its *own*
learned embedding, after the last real token and drafts k tokens in one forward; training is *group-wise parallel*:
every training position is followed by its own group of masks, and the attention mask lets a group see the real
prefix up to its position and the earlier members of its own group, never another group (exactly the shared
(anchor, depth) visibility rule: element (a, d >= 1) is [MASK]_d of anchor a's group, rotary position a + d); the
drafter is aligned to the target by distillation. This plugin distils with forward KL from the target's distribution
at each element's reference position, over a reduced draft vocabulary (EAGLE-3 indexing, docs/design.md section 8).

Choices where the paper leaves room (each an option):

- ``backbone``: ``"eagle"`` (default) builds on EAGLE, as the paper's strongest results do: the drafter reads the
  target's fused low / mid / high hidden states through ``fc`` and its first layer takes cat(embedding, hidden).
  ``"standalone"`` is a small causal LM initialised from the target's embedding and first ``layers`` layers that
  reads no target features (the target-independent setting the paper also compares against).
- The hidden input of a mask slot (eagle backbone) is its anchor's fused target feature, the last feature that
  exists at inference (the bonus token's); a mask slot is told apart from its anchor only by its own [MASK]_d
  embedding. (P-EAGLE instead shares one mask embedding and one learned hidden state across depths.)
- ``cod_ratio`` 1 (default) gives every position its full group, the paper's group-wise training; below 1 it
  samples groups PARD-style.
- The k-1 mask embeddings are a separate parameter ``mask_embeddings`` [k-1, H], initialised from the target's
  embedding rows of k-1 reserved ids chosen by the project's mask-token rule; the ids are recorded in the checkpoint
  so an export can write the learned rows into the embedding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from specframe import api

modeling = api.modeling
eagle = api.eagle
AUX = "aux_hidden"
BACKBONES = ("eagle", "standalone")


_fields = api.eagle.FamilyFields("parallelspec")  # the options the EAGLE family shares, defined once
_positive, _unit = _fields.positive, _fields.unit


def _backbone(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in BACKBONES:
        raise api.UsageError(f"parallelspec option 'backbone' must be one of {', '.join(BACKBONES)}, got {value!r}")


@attrs.define
class ParallelSpecOptions:
    """ParallelSpec settings (the ``[drafter_options]`` table of ``specframe train --config``)."""

    backbone: str = attrs.field(default="eagle", validator=_backbone, metadata={
        "help": "'eagle': read the target's fused hidden states (the paper's strongest setting); 'standalone': a "
                "small causal LM that reads no target features"})
    layers: int = attrs.field(default=1, validator=_positive, metadata={
        "help": "decoder layers of the drafter"})
    k_train: int = attrs.field(default=5, validator=_positive, metadata={
        "help": "group size k (the real token plus k-1 masks) trained, the default training depth; --depth "
                "overrides it up to num_masks + 1. Smaller than peagle's and pard's 8 because it sets the number "
                "of learned masks: pass --depth 8 with num_masks 7 for an equal-depth comparison"})
    k_infer: int = _fields.k_infer("at most num_masks + 1")
    num_masks: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive), metadata={
        "help": "distinct learned mask tokens; null: k_train - 1"})
    draft_vocab_size: int | None = _fields.draft_vocab_size("the same default as peagle and eagle3", default=None)
    aux_layer_ids: list[int] | None = _fields.aux_layer_ids("read by the eagle backbone")
    train_embedding: bool = _fields.train_embedding("the mask embeddings always train")
    cod_ratio: float = _fields.cod_ratio(1.0, "1 gives every position its full group, the paper's group-wise training")
    cod_min_ratio: float = _fields.cod_min_ratio()
    activation_checkpointing: bool = _fields.activation_checkpointing()
    loss_chunk: int = _fields.loss_chunk()
    vocab_position_mask: bool = _fields.vocab_position_mask()
    train_head: bool = _fields.train_head()
    loss_mask_bit: str = _fields.loss_mask_bit()
    loss_normalisation: str = _fields.loss_normalisation()
    loss: str = _fields.loss()
    ce_weight: float = _fields.ce_weight()
    init_from_target_layers: bool = _fields.init_from_target_layers()

    @property
    def masks(self) -> int:
        return self.num_masks if self.num_masks is not None else max(self.k_train - 1, 1)


class ParallelSpecDrafter(api.eagle.FamilyTraining, api.eagle.QueuedInference, api.Drafter):
    # FamilyTraining, not FamilyDrafter: its checkpoint record is its own (two backbones, no d2t)
    name = "parallelspec"
    Options = ParallelSpecOptions
    parallel = True

    @classmethod
    def import_options(cls, imported: Any) -> dict[str, Any]:
        values = super().import_options(imported)
        masks = imported.config.get("parallelspec_num_masks")
        if isinstance(masks, int):  # a ParallelSpec layout: its learned masks fix the depth and K it was trained for
            values = {"backbone": "eagle", "num_masks": masks, "k_train": masks + 1, "k_infer": masks + 1, **values}
        return values

    def __init__(self, target_config: Any, options: ParallelSpecOptions | None = None) -> None:
        super().__init__(target_config, options)
        opts = self.options
        self.reads_features = opts.backbone == "eagle"
        n_layers = int(target_config.num_hidden_layers)
        self.aux_layer_ids = eagle.aux_layer_ids(self.name, opts.aux_layer_ids, n_layers) if self.reads_features else []
        self.shape = modeling.LayerShape.from_config(target_config)
        self.vocab_size = int(target_config.vocab_size)
        self.draft_vocab_size = api.eagle.draft_vocab_size(opts.draft_vocab_size, self.vocab_size)
        self.model = eagle.EagleBackbone(
            self.shape, self.vocab_size, self.draft_vocab_size, 3 if self.reads_features else 0, opts.layers,
            eagle_input=self.reads_features,
        )
        self.model.mask_embeddings = nn.Parameter(torch.randn(opts.masks, self.shape.hidden) * 0.02)
        self.model.embed_tokens.weight.requires_grad_(opts.train_embedding)
        eagle.freeze_head(self.model, opts.train_head)
        self._sequence_scale = 1.0  # loss_normalisation 'sequence': set by prepare from the training data
        self.mask_token_ids: list[int] | None = None
        self._target_head: eagle.TargetHead | None = None
        self._reset_inference()

    def feature_spec(self) -> api.FeatureSpec:
        aux = tuple(self.aux_layer_ids) if self.reads_features else ()
        return api.FeatureSpec(aux_layers=aux, final_hidden=True)

    def module(self) -> torch.nn.Module:
        return self.model

    # ---------------------------------------------------------------------------------------------------- training
    def prepare(self, target: Any, examples: Any) -> None:
        examples = list(examples)
        counts = eagle.all_token_counts(examples, self.vocab_size)
        self.mask_token_ids = eagle.mask_token_ids(
            target.tokenizer, self.options.masks, data_counts=counts, embedding_rows=self.vocab_size
        )
        draft = eagle.draft_vocabulary(examples, self.draft_vocab_size, self.vocab_size, exclude=self.mask_token_ids)
        model = self.model
        with torch.no_grad():
            model.mask_embeddings.copy_(target.model.get_input_embeddings().weight.detach()[self.mask_token_ids])
            if not self.reads_features:
                self._copy_layers(target.model)
        self._target_head = eagle.start_from_target(model, target, draft, self.options.init_from_target_layers)
        self._sequence_scale = eagle.supervised_per_document(examples, self.supervision)

    def target_layers(self, num_layers: int) -> list[int]:
        """The standalone backbone copies the target's first ``layers`` layers (``_copy_layers``); with
        ``init_from_target_layers`` the last ones replace them (the family's rule)."""
        first = [] if self.reads_features else list(range(min(self.options.layers, num_layers)))
        return sorted({*first, *super().target_layers(num_layers)})

    def _copy_layers(self, target_model: Any) -> None:
        source = target_model.state_dict()
        if self.options.layers > int(target_model.config.num_hidden_layers):
            raise api.UsageError(
                f"parallelspec: {self.options.layers} layers cannot be copied from a "
                f"{target_model.config.num_hidden_layers}-layer target"
            )
        for key, value in self.model.state_dict().items():
            if key.startswith("layers.") or key == "norm.weight":
                value.copy_(source["model." + key].to(value.dtype))

    def supervision(self, example: api.TrainingExample) -> torch.Tensor:
        return api.eagle.shifted_supervision(example.loss_mask, example.doc, self.options.loss_mask_bit)

    def export_vllm(self, directory: Any, tokenizer: Any, serving: api.Serving | None = None) -> api.Manifest:
        """The EAGLE backbone for vLLM's parallel drafting (eagle3 method), served by specframe's vLLM general plugin
        model ``ParallelSpecLlamaForCausalLMEagle3``, which gives each draft slot its own learned [MASK]_d
        embedding and its anchor's hidden state (``specframe.vllm.vllm_plugin``). vLLM needs the target beside it
        (an explicit speculative config). The standalone backbone has no vLLM model (vLLM's draft-model proposer
        feeds every slot the same mask token)."""
        if self.mask_token_ids is None:
            raise api.SpecframeError("parallelspec: no mask tokens chosen (train the drafter or load a checkpoint first)")
        if not self.reads_features:
            raise api.SpecframeError(
                "drafter 'parallelspec' with backbone 'standalone' cannot be exported to vLLM: vLLM's draft-model "
                "parallel drafting feeds the same mask token to every slot and specframe ships a vLLM model only for "
                "the eagle backbone; serve it with the reference engine (`specframe generate`, `bench acceptance`)"
            )
        layouts = api.vllm_layouts
        weights = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
        config = layouts.llama_config(self.target_config, self.options.layers)
        return layouts.write_parallelspec(
            directory, weights, config=config, aux_layer_ids=self.aux_layer_ids, target_hidden_size=self.shape.hidden,
            mask_token_ids=self.mask_token_ids, target_num_layers=int(self.target_config.num_hidden_layers),
            tokenizer=tokenizer, drafter=self.name, serving=serving,
        )

    def import_weights(self, imported: Any) -> None:
        """Load a ParallelSpec export (``write_parallelspec``; ``specframe.layouts.imports``) of this drafter's shape,
        with its mask token ids."""
        if imported.layout != "parallelspec":
            raise api.SpecframeError(
                f"cannot import {imported.directory}: it holds a {imported.layout} drafter, not parallelspec"
            )
        imported.check_target(self.target_config)
        imported.check_shape(self.name, layers=self.options.layers, aux_layer_ids=self.aux_layer_ids,
                             draft_vocab_size=self.draft_vocab_size)
        # mask_hidden is only there for vLLM's loader (the plugin model replaces it by the anchor's hidden state)
        tensors = {k: v for k, v in imported.tensors.items() if k != "mask_hidden"}
        state = attrs.evolve(imported, tensors=tensors).eagle_state(
            self.model.state_dict(), self.target_config, own_embedding_is_target=self._target_head is not None)
        self.model.load_state_dict(state)
        self.mask_token_ids = [int(i) for i in imported.config["parallelspec_mask_token_ids"]]

    def check_training(self, depth: int, mask_builder: str, partitioner: str) -> None:
        self._check_depth(depth)

    def _check_depth(self, k: int) -> None:
        if k - 1 > self.options.masks:
            raise api.UsageError(
                f"parallelspec has {self.options.masks} mask tokens, so it trains and drafts at most "
                f"{self.options.masks + 1} tokens per group; got depth {k} (raise drafter.num_masks or k_train)"
            )

    def _inputs(self, tokens: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        model = self.model
        real = model.embed_tokens(tokens)
        masks = model.mask_embeddings[(depth - 1).clamp(min=0)]
        return torch.where((depth > 0)[:, None], masks.to(real.dtype), real)

    def loss(
        self, example: api.TrainingExample, elements: api.ElementSet, segment: api.Segment, attention: api.Attention
    ) -> api.LossTerms:
        if self._target_head is None:
            raise api.SpecframeError("parallelspec: prepare(target, examples) must run before loss()")
        self._check_depth(elements.max_depth)
        model = self.model
        device = model.lm_head.weight.device
        dtype = model.lm_head.weight.dtype
        sub = elements.subset(segment.elements)
        anchor, depth = sub.anchor.to(device), sub.depth.to(device)
        pos = anchor + depth
        ids = example.input_ids.to(device)
        embeds = self._inputs(ids[anchor + 1], depth)
        hidden = model.fuse(example.features[AUX].to(device)[anchor]) if self.reads_features else None
        out = model.run(embeds, hidden, pos, attention, checkpointing=self.options.activation_checkpointing)[0]
        sup = self.supervision(example)
        charged = segment.loss_mask.to(device) & sup.to(device)[pos]
        teacher = eagle.kl_teacher(example.features, model.t2d, self._target_head, device=device, dtype=dtype,
                                   mask=self.options.vocab_position_mask, evaluating=not model.training)
        result, correct, total = eagle.charged_forward_kl(
            self.options, model.norm(out[charged]), model.lm_head.weight, teacher, depth=depth, pos=pos,
            charged=charged, elements=elements, segment=segment, supervised=sup, sequence_scale=self._sequence_scale,
        )
        return api.LossTerms(result.loss_sum, int(charged.sum()), correct, total, hit=result.correct.cpu(),
                             masked=result.dropped)

    # --------------------------------------------------------------------------------------------------- inference
    def _reset_inference(self) -> None:
        super()._reset_inference()
        self._cache: list[modeling.KV] | None = None
        self._cached = 0

    def _check_ready(self) -> None:
        if self.mask_token_ids is None:
            raise api.SpecframeError("parallelspec: no mask tokens chosen (train the drafter or load a checkpoint)")

    @torch.no_grad()
    def propose(self, k: int, generator: torch.Generator | None = None) -> api.Draft:
        self.check_k(k)
        self._check_depth(k)
        model = self.model
        device = model.lm_head.weight.device
        tokens, aux = self._pending.take()
        tokens = tokens.to(device)
        p = tokens.shape[0]
        depth = torch.cat([torch.zeros(p, dtype=torch.long), torch.arange(1, k)]).to(device)
        embeds = self._inputs(torch.cat([tokens, tokens.new_zeros(k - 1)]), depth)
        hidden = None
        if self.reads_features:
            fused = model.fuse(aux.to(device))
            # mask slots carry the anchor's (the bonus token's) feature
            hidden = torch.cat([fused, fused[-1:].expand(k - 1, -1)])
        position = torch.arange(self._cached, self._cached + p + k - 1, device=device)
        out, kvs = model.run(embeds, hidden, position, modeling.causal_attention(self._cached), past=self._cache)
        draft = model.to_target(model.logits(out[p - 1 :]).argmax(-1))
        self._cache = eagle.keep_committed(self._cache, kvs, p)  # the mask slots' KV is rewritten next round
        self._cached += p
        return api.Draft(tokens=draft.cpu())

    # -------------------------------------------------------------------------------------------------- checkpoints
    def describe(self) -> dict[str, Any]:
        s = self.shape
        return {
            **super().describe(),
            "backbone": self.options.backbone,
            "mask_token_ids": self.mask_token_ids,
            "aux_layer_ids": self.aux_layer_ids,
            "draft_vocab_size": self.draft_vocab_size,
            "vocab_size": self.vocab_size,
            **s.config_fields(),
            "num_hidden_layers": self.options.layers,
        }

    def check_checkpoint(self, directory: Path, info: dict[str, Any]) -> None:
        if info["backbone"] != self.options.backbone or info["draft_vocab_size"] != self.draft_vocab_size:
            raise api.SpecframeError(
                f"{directory} holds a {info['backbone']} backbone with draft vocabulary {info['draft_vocab_size']}; "
                f"this drafter is {self.options.backbone} with {self.draft_vocab_size}"
            )

    def restore_checkpoint(self, info: dict[str, Any]) -> None:
        self.mask_token_ids = list(info["mask_token_ids"])


@api.hookimpl
def register_drafters(register):
    register(ParallelSpecDrafter)
