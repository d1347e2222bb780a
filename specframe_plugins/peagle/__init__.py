"""``peagle``: the P-EAGLE parallel drafter (docs/design.md sections 3, 4 and 8).

An EAGLE-3-style drafter that drafts every depth in one forward. Depth-0 elements read a real token and the target's
fused aux features; every deeper slot reads one learned mask-token embedding row and one learned shared hidden state
``mask_hidden`` (3H, through the same ``fc``). Trained with forward KL to the target distribution over the draft
vocabulary at every retained element, normalised by the element count, no depth decay.

Indexing (section 8): training index i holds input token x_{i+1}, feature g_i, the target distribution at y_{i+1}
and the loss-mask bit of x_{i+1} (``loss_mask_bit`` 'input', speculators'; 'predicted': x_{i+2}'s); element (a, d) is
charged at reference position a + d.

Inference protocol (batch 1): ``start(prompt_ids, features)`` pairs prompt token i+1 with feature row i; the last
prompt row's features arrive with the first generated token through ``accept([t0], features_at_last_prompt_row)``.
In general ``accept(emitted, features)`` takes one feature row per emitted token: the target's features at the
position whose logits produced that token (the verification forward's rows 0..len(emitted)-1). ``propose(k)``
forwards [not-yet-cached accepted tokens | MASK x (k-1)] once, keeps the KV of the accepted tokens and drops the
mask slots'.

Mask token: the first id ``api.vocab.mask_token_ids`` picks (a special or reserved token that the chat template never
emits and the training data never contains, with an embedding row), recorded in the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch

from specframe import api

from .model import PEagleModel

modeling = api.modeling
AUX = "aux_hidden"


_fields = api.eagle.FamilyFields("peagle")  # the options the EAGLE family shares, defined once
_positive = _fields.positive


_non_negative = api.non_negative("peagle")


@attrs.define
class PEagleOptions:
    """P-EAGLE settings (the ``[drafter_options]`` table of ``specframe train --config``)."""

    layers: int = attrs.field(default=4, validator=_positive, metadata={
        "help": "decoder layers; the first is EAGLE-3's (embedding + fused hidden in). 4 as released"})
    k_train: int = attrs.field(default=8, validator=_positive, metadata={
        "help": "depths trained (K_train), the default training depth; --depth overrides it. Same as pard's "
                "(eagle3 trains 7 TTT passes, parallelspec groups of 5: pass --depth for an equal-depth comparison)"})
    k_infer: int = _fields.k_infer("K_infer")
    draft_vocab_size: int | None = _fields.draft_vocab_size(
        "the same default as eagle3 and parallelspec (pard drafts over the full target vocabulary)", default=None)
    aux_layer_ids: list[int] | None = _fields.aux_layer_ids()
    cod_ratio: float = _fields.cod_ratio(0.7)
    cod_min_ratio: float = _fields.cod_min_ratio()
    activation_checkpointing: bool = _fields.activation_checkpointing()
    loss_chunk: int = _fields.loss_chunk()
    vocab_position_mask: bool = _fields.vocab_position_mask()
    # 1.0 as speculators, NeMo and SpecForge; specframe's earlier 0.02 measured no better (deviations row 1)
    mask_hidden_std: float = attrs.field(default=1.0, validator=_non_negative, metadata={
        "help": "std of the shared hidden state mask_hidden's normal init (the raw 3H aux space before fc), as "
                "speculators, NeMo and SpecForge"})
    train_head: bool = _fields.train_head()
    loss_mask_bit: str = _fields.loss_mask_bit()
    loss_normalisation: str = _fields.loss_normalisation()
    loss: str = _fields.loss()
    ce_weight: float = _fields.ce_weight()
    init_from_target_layers: bool = _fields.init_from_target_layers()
    qk_norm: bool = _fields.qk_norm()
    norm_before_residual: bool = _fields.norm_before_residual()
    norm_before_fc: bool = _fields.norm_before_fc()
    sliding_window: int | None = _fields.sliding_window()


class PEagleDrafter(api.eagle.FamilyDrafter, api.eagle.QueuedInference, api.Drafter):
    name = "peagle"
    Options = PEagleOptions
    parallel = True
    recorded = ("mask_token_id",)  # in the checkpoint record before the family's fields; restore_checkpoint reads it

    def __init__(self, target_config: Any, options: PEagleOptions | None = None) -> None:
        super().__init__(target_config, options)
        opts = self.options
        self.aux_layer_ids = api.eagle.aux_layer_ids(self.name, opts.aux_layer_ids,
                                                     int(target_config.num_hidden_layers))
        self.shape = modeling.LayerShape.from_config(target_config)
        self.vocab_size = int(target_config.vocab_size)
        self.draft_vocab_size = api.eagle.draft_vocab_size(opts.draft_vocab_size, self.vocab_size)
        self.model = PEagleModel(self.shape, self.vocab_size, self.draft_vocab_size, 3, opts.layers,
                                 mask_hidden_std=float(opts.mask_hidden_std),
                                 architecture=api.eagle.Architecture.of(opts))
        self.model.set_draft_vocab(torch.arange(self.draft_vocab_size))
        api.eagle.freeze_head(self.model, opts.train_head)
        self._sequence_scale = 1.0  # loss_normalisation 'sequence': set by prepare from the training data
        self.mask_token_id: int | None = None
        self._target_head: api.eagle.TargetHead | None = None
        self._reset_inference()

    # ------------------------------------------------------------------------------------------------ description
    def feature_spec(self) -> Any:
        return api.FeatureSpec(aux_layers=tuple(self.aux_layer_ids), final_hidden=True)

    def module(self) -> torch.nn.Module:
        return self.model

    # ---------------------------------------------------------------------------------------------------- training
    def prepare(self, target: Any, examples: Any) -> None:
        """Initialise the embedding from the target's, pick the draft vocabulary (``api.vocab``: most frequent
        assistant tokens) and the mask token (``api.vocab.mask_token_ids``' rule: a special or reserved token never
        seen in the training data), and keep the target's lm_head for the loss."""
        examples = list(examples)
        counts = api.eagle.all_token_counts(examples, self.vocab_size)
        self.mask_token_id = api.eagle.mask_token_ids(
            target.tokenizer, 1, data_counts=counts, embedding_rows=self.vocab_size
        )[0]
        draft = api.eagle.draft_vocabulary(examples, self.draft_vocab_size, self.vocab_size,
                                           exclude=[self.mask_token_id])  # never a draft token
        self._target_head = api.eagle.start_from_target(self.model, target, draft, self.options.init_from_target_layers)
        self._sequence_scale = api.eagle.supervised_per_document(examples, self.supervision)

    def supervision(self, example: api.TrainingExample) -> torch.Tensor:
        return api.eagle.shifted_supervision(example.loss_mask, example.doc, self.options.loss_mask_bit)

    def loss(
        self, example: api.TrainingExample, elements: api.ElementSet, segment: api.Segment, attention: api.Attention
    ) -> api.LossTerms:
        if self._target_head is None or self.mask_token_id is None:
            raise api.SpecframeError("peagle: prepare(target, examples) must run before loss()")
        model = self.model
        device = model.fc.weight.device
        sub = elements.subset(segment.elements)
        anchor, depth = sub.anchor.to(device), sub.depth.to(device)
        pos = anchor + depth
        ids = example.input_ids.to(device)
        aux = example.features[AUX].to(device=device, dtype=model.fc.weight.dtype)
        is_mask = depth > 0
        tokens = torch.where(is_mask, torch.full_like(anchor, self.mask_token_id), ids[anchor + 1])
        # [0]: the per-layer (k, v) are for inference; holding them here would keep 2 x layers x N rows alive
        hidden = model(
            tokens,
            aux[: int(anchor.max()) + 1],
            is_mask,
            pos,
            api.eagle.windowed(attention, sub, self.options.sliding_window),
            checkpointing=self.options.activation_checkpointing,
            aux_index=anchor,
        )[0]
        sup = self.supervision(example).to(device)
        charged = segment.loss_mask.to(device) & sup[pos]
        teacher = api.eagle.kl_teacher(example.features, model.t2d, self._target_head, device=device,
                                       dtype=hidden.dtype, mask=self.options.vocab_position_mask,
                                       evaluating=not model.training)
        result, correct, total = api.eagle.charged_forward_kl(
            self.options, hidden[charged], model.lm_head.weight, teacher, depth=depth, pos=pos, charged=charged,
            elements=elements, segment=segment, supervised=sup, sequence_scale=self._sequence_scale,
        )
        return api.LossTerms(result.loss_sum, int(charged.sum()), correct, total, hit=result.correct.cpu(),
                             masked=result.dropped)

    # --------------------------------------------------------------------------------------------------- inference
    def _reset_inference(self) -> None:
        super()._reset_inference()
        self._cache: list[modeling.KV] | None = None
        self._cached = 0

    @torch.no_grad()
    def propose(self, k: int, generator: torch.Generator | None = None) -> api.Draft:
        self.check_k(k)
        model = self.model
        device = model.fc.weight.device
        tokens, aux = self._pending.take()
        tokens = tokens.to(device)
        aux = aux.to(device=device, dtype=model.fc.weight.dtype)
        p = tokens.shape[0]
        block_tokens = torch.cat([tokens, torch.full((k - 1,), self.mask_token_id, device=device, dtype=torch.long)])
        block_aux = torch.cat([aux, aux.new_zeros(k - 1, aux.shape[1])])
        is_mask = torch.arange(p + k - 1, device=device) >= p
        position = torch.arange(self._cached, self._cached + p + k - 1, device=device)
        hidden, kvs = model(
            block_tokens, block_aux, is_mask, position,
            modeling.causal_attention(self._cached, self.options.sliding_window), past=self._cache,
        )
        draft = model.lm_head(hidden[p - 1 :]).argmax(-1)
        target_ids = draft + model.d2t[draft]
        self._cache = api.eagle.keep_committed(self._cache, kvs, p)  # the mask slots' KV is rewritten next round
        self._cached += p
        return api.Draft(tokens=target_ids.cpu())

    # -------------------------------------------------------------------------------------------------- checkpoints
    def restore_checkpoint(self, info: dict[str, Any]) -> None:
        self.mask_token_id = info["mask_token_id"]

    def export_vllm(self, directory: Path, tokenizer: Any, serving: api.Serving | None = None) -> api.Manifest:
        """The speculators ``peagle`` layout (vLLM's eagle3 method with ``parallel_drafting``), served from the
        folder alone: the module's tensors already carry its names (``mask_hidden`` [1, 1, 3H] included); the
        trained embedding is exported so the mask row is used."""
        if self.mask_token_id is None:
            raise api.SpecframeError("peagle: no mask token chosen (train the drafter or load a checkpoint first)")
        layouts = api.vllm_layouts
        weights = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
        config = layouts.llama_config(self.target_config, self.options.layers)
        return layouts.write_peagle(
            directory, weights, config=config, aux_layer_ids=self.aux_layer_ids, target_hidden_size=self.shape.hidden,
            mask_token_id=self.mask_token_id, target_num_layers=int(self.target_config.num_hidden_layers),
            tokenizer=tokenizer, drafter=self.name,
            verifier=layouts.verifier_of(self.target_config), speculative_tokens=self.options.k_infer,
            verifier_architectures=layouts.verifier_architectures_of(self.target_config),
            architecture=self.model.architecture.export_fields(), serving=serving,
        )

    @classmethod
    def import_options(cls, imported: Any) -> dict[str, Any]:
        """The folder's shape and its layer architecture (``qk_norm``, ``norm_before_residual``, ``norm_before_fc``,
        ``sliding_window``; a parallel drafter has no step to feed, so ``norm_output`` means nothing to it)."""
        arch = {k: v for k, v in imported.architecture.items() if k != "norm_output"}
        return {**super().import_options(imported), **arch}

    def import_weights(self, imported: Any) -> None:
        """Load a P-EAGLE folder (speculators ``peagle``; ``specframe.layouts.imports``) of this drafter's shape, with
        its mask token; without ``embed_tokens`` the target's embedding is used."""
        if imported.layout != "peagle":
            raise api.SpecframeError(f"cannot import {imported.directory}: it holds a {imported.layout} drafter, not peagle")
        imported.check_target(self.target_config)
        imported.check_shape(self.name, layers=self.options.layers, aux_layer_ids=self.aux_layer_ids,
                             draft_vocab_size=self.draft_vocab_size,
                             **{k: v for k, v in self.model.architecture.export_fields().items()
                                if k != "norm_output"})
        state = imported.eagle_state(self.model.state_dict(), self.target_config,
                                     own_embedding_is_target=self._target_head is not None)
        self.model.load_state_dict(state)
        self.mask_token_id = imported.mask_token_id


@api.hookimpl
def register_drafters(register):
    register(PEagleDrafter)
