"""``pard``: PARD, the target-independent parallel draft model (An et al. 2025, arXiv 2504.18583; AMD-AGI/PARD).

A small causal LM with the target's tokenizer (by default a ``layers``-layer Llama whose embedding, first layers,
final norm and lm_head are copied from the target) drafts k tokens in one forward over
[accepted | bonus | MASK x (k-1)]: one mask token, chosen by the project's rule (``api.eagle.mask_token_ids``: an
unused special / reserved id that exists in the embedding) and recorded as ``pard_token`` in the checkpoint config.

Training on the shared engine, unshifted on data tokens (docs/design.md section 8): position i holds token x_i; element
(a, d) has rotary position a + d, token input x_a at depth 0 and MASK at depth >= 1, and predicts x_{a+d+1} (hard
cross-entropy over the full vocabulary, the PARD objective). It is supervised when x_{a+d+1} is a loss-masked token
of a's document. COD (r 0.7, r_min 0.2, PARD's defaults) keeps about 3.4 L elements at K = 8. No target features.

Checkpoint: ``causal_lm/`` is a plain transformers ``LlamaForCausalLM.save_pretrained`` folder (safetensors, config
with ``pard_token``) that vLLM loads as ``{"method": "draft_model", "parallel_drafting": true}``; it sits in a
sub-folder because the engine writes its own ``config.json`` beside the drafter's files. ``drafter.json`` holds the
specframe options.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from specframe import api

modeling = api.modeling
HF_DIR = "causal_lm"


_fields = api.eagle.FamilyFields("pard")  # the options the EAGLE family shares, defined once
_positive = _fields.positive


@attrs.define
class PardOptions:
    """PARD settings. PARD drafts over the full target vocabulary, so it has no ``draft_vocab_size``."""

    layers: int = attrs.field(default=2, validator=_positive, metadata={
        "help": "decoder layers of the draft causal LM"})
    init_from_target: bool = attrs.field(default=True, metadata={
        "help": "copy the target's embedding, first `layers` layers, final norm and lm_head (else random init)"})
    k_train: int = attrs.field(default=8, validator=_positive, metadata={
        "help": "depths trained, the default training depth; --depth overrides it. Same as peagle's (eagle3 trains "
                "7 TTT passes, parallelspec groups of 5: pass --depth for an equal-depth comparison)"})
    k_infer: int = _fields.k_infer()
    cod_ratio: float = _fields.cod_ratio(0.7)
    cod_min_ratio: float = _fields.cod_min_ratio()
    activation_checkpointing: bool = _fields.activation_checkpointing()
    loss_chunk: int = _fields.loss_chunk("PARD's is the full target vocabulary")
    train_head: bool = _fields.train_head(
        "PARD's head is the target's whole lm_head; with a tied target (SmolLM2) the embedding is that same tensor "
        "and freezes with it")
    loss_normalisation: str = _fields.loss_normalisation()


class PardLM(nn.Module):
    """A Llama causal LM whose parameter names are exactly ``LlamaForCausalLM``'s (``model.embed_tokens``,
    ``model.layers.N.*``, ``model.norm``, ``lm_head``), with attention delegated to an ``api.Attention``."""

    def __init__(self, shape: modeling.LayerShape, vocab_size: int, layers: int, tie: bool) -> None:
        super().__init__()
        self.shape = shape
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab_size, shape.hidden)
        self.model.layers = nn.ModuleList([modeling.DecoderLayer(shape) for _ in range(layers)])
        self.model.norm = modeling.RMSNorm(shape.hidden, shape.eps)
        self.lm_head = nn.Linear(shape.hidden, vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        self.tied = tie
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        tokens: torch.Tensor,
        position: torch.Tensor,
        attention: modeling.Attention,
        past: list[modeling.KV] | None = None,
        checkpointing: bool = False,
    ) -> tuple[torch.Tensor, list[modeling.KV]]:
        """Normalised final states [N, H] of ``tokens`` [N] at ``position`` [N], and each layer's new (k, v)."""
        embeds = self.model.embed_tokens(tokens)[None]
        out, kvs = modeling.run_layers(
            self.model.layers, embeds, embeds, position, self.shape, attention, past=past, checkpointing=checkpointing
        )
        return self.model.norm(out[0]), kvs


def chunked_cross_entropy(
    hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, chunk: int, row_weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of hard cross-entropy over rows (each times ``row_weight``, when given) and the top-1 hits, O(chunk x V)
    logits at a time (the full vocabulary is large): ``modeling.chunked_cross_entropy``, named here so tests can
    watch what PARD's loss sees."""
    return modeling.chunked_cross_entropy(hidden, head, labels, chunk, row_weight=row_weight)


class PardDrafter(api.Drafter):
    name = "pard"
    Options = PardOptions
    parallel = True

    @classmethod
    def training(cls, options: PardOptions) -> api.Training:
        return api.eagle.family_training(options, options.k_train)

    @classmethod
    def comparison_options(cls, depth: int, draft_vocab_size: int, k: int) -> dict[str, Any]:
        return {"k_train": depth, "k_infer": k}  # PARD drafts over the full target vocabulary

    def __init__(self, target_config: Any, options: PardOptions | None = None) -> None:
        super().__init__(target_config, options)
        self.shape = modeling.LayerShape.from_config(target_config)
        self.vocab_size = int(target_config.vocab_size)
        self.tie = bool(getattr(target_config, "tie_word_embeddings", False))
        self.model = PardLM(self.shape, self.vocab_size, self.options.layers, self.tie)
        api.eagle.freeze_head(self.model, self.options.train_head)
        self._sequence_scale = 1.0  # loss_normalisation 'sequence': set by prepare from the training data
        self.mask_token_id: int | None = None
        self._reset_inference()

    def feature_spec(self) -> api.FeatureSpec:
        # an explicit empty tuple: readers of the spec treat a missing aux list as "none" only when iterable
        return api.FeatureSpec(aux_layers=())

    def module(self) -> torch.nn.Module:
        return self.model

    # ---------------------------------------------------------------------------------------------------- training
    def prepare(self, target: Any, examples: Any) -> None:
        examples = list(examples)
        counts = api.eagle.all_token_counts(examples, self.vocab_size)
        self.mask_token_id = api.eagle.mask_token_ids(
            target.tokenizer, 1, data_counts=counts, embedding_rows=self.vocab_size
        )[0]
        if self.options.init_from_target:
            self._copy_from(target.model)
        self._sequence_scale = api.eagle.supervised_per_document(examples, self.supervision)

    def target_layers(self, num_layers: int) -> list[int]:
        """``init_from_target`` copies the target's first ``layers`` layers (``_copy_from``, which refuses more than
        the target has); without it only the embedding and head are read."""
        return list(range(min(self.options.layers, num_layers))) if self.options.init_from_target else []

    def _copy_from(self, target_model: Any) -> None:
        source = target_model.state_dict()
        n_target = int(target_model.config.num_hidden_layers)
        if self.options.layers > n_target:
            raise api.UsageError(
                f"pard: {self.options.layers} layers cannot be copied from a {n_target}-layer target "
                "(lower drafter.layers or set drafter.init_from_target = false)"
            )
        own = self.model.state_dict()
        missing = [k for k in own if k not in source]
        if missing:
            raise api.UsageError(f"pard: the target has no {missing[0]} to initialise from (not a Llama layout?)")
        with torch.no_grad():
            for key, value in own.items():
                value.copy_(source[key].to(value.dtype))

    def supervision(self, example: api.TrainingExample) -> torch.Tensor:
        lm = example.loss_mask.to(torch.bool)
        doc = example.doc
        sup = torch.zeros(lm.shape[0], dtype=torch.bool)
        # position i predicts x_{i+1}, charged when it is a loss-masked token of i's document
        sup[:-1] = lm[1:] & (doc[1:] == doc[:-1])
        return sup

    def loss(
        self, example: api.TrainingExample, elements: api.ElementSet, segment: api.Segment, attention: api.Attention
    ) -> api.LossTerms:
        if self.mask_token_id is None:
            raise api.SpecframeError("pard: prepare(target, examples) must run before loss()")
        model = self.model
        device = model.lm_head.weight.device
        sub = elements.subset(segment.elements)
        anchor, depth = sub.anchor.to(device), sub.depth.to(device)
        pos = anchor + depth
        ids = example.input_ids.to(device)
        tokens = torch.where(depth > 0, torch.full_like(anchor, self.mask_token_id), ids[anchor])
        hidden = model(tokens, pos, attention, checkpointing=self.options.activation_checkpointing)[0]
        sup = self.supervision(example)
        charged = segment.loss_mask.to(device) & sup.to(device)[pos]
        weighting = {}
        if self.options.loss_normalisation == "sequence":
            weighting["row_weight"] = api.eagle.sequence_weights(
                elements, sup, segment.elements[charged.cpu()], self._sequence_scale).to(device)
        loss_sum, hits = chunked_cross_entropy(
            hidden[charged], model.lm_head.weight, ids[pos[charged] + 1], self.options.loss_chunk, **weighting
        )
        correct, total = api.eagle.per_depth(sub.depth[charged.cpu()], hits, elements.max_depth)
        return api.LossTerms(loss_sum, int(charged.sum()), correct, total, hit=hits.cpu())

    # --------------------------------------------------------------------------------------------------- inference
    def _reset_inference(self) -> None:
        self._cache: list[modeling.KV] | None = None
        self._cached = 0
        self._pending: list[torch.Tensor] = []

    def start(self, prompt_ids: torch.Tensor, features: dict[str, torch.Tensor]) -> None:
        if self.mask_token_id is None:
            raise api.SpecframeError("pard: no mask token chosen (train the drafter or load a checkpoint first)")
        self._reset_inference()
        self._pending.append(prompt_ids.reshape(-1))

    def accept(self, emitted: torch.Tensor, features: dict[str, torch.Tensor]) -> None:
        self._pending.append(emitted.reshape(-1))

    @torch.no_grad()
    def propose(self, k: int, generator: torch.Generator | None = None) -> api.Draft:
        if k < 1:
            raise api.UsageError(f"pard.propose: k must be positive, got {k}")
        if not self._pending:
            raise api.SpecframeError("pard.propose: no new token to draft from (call accept first)")
        model = self.model
        device = model.lm_head.weight.device
        tokens = torch.cat(self._pending).to(device)
        p = tokens.shape[0]
        block = torch.cat([tokens, torch.full((k - 1,), self.mask_token_id, device=device, dtype=torch.long)])
        position = torch.arange(self._cached, self._cached + p + k - 1, device=device)
        hidden, kvs = model(block, position, modeling.causal_attention(self._cached), past=self._cache)
        draft = model.lm_head(hidden[p - 1 :]).argmax(-1)
        self._cache = api.eagle.keep_committed(self._cache, kvs, p)  # the mask slots' KV is rewritten next round
        self._cached += p
        self._pending = []
        return api.Draft(tokens=draft.cpu())

    # -------------------------------------------------------------------------------------------------- checkpoints
    def hf_config(self) -> Any:
        """The transformers config of the draft LM: a Llama config with the target's sizes, RoPE, activation and
        special tokens (whatever the target's family: the draft LM is a Llama), the drafter's depth and ``pard_token``."""
        from transformers import LlamaConfig

        t = self.target_config
        fields = {k: v for k, v in self.shape.config_fields().items() if k != "rope_theta"}  # in rope_parameters
        cfg = LlamaConfig(
            vocab_size=self.vocab_size, num_hidden_layers=self.options.layers, tie_word_embeddings=self.tie,
            attention_bias=False, mlp_bias=False, bos_token_id=getattr(t, "bos_token_id", None),
            eos_token_id=getattr(t, "eos_token_id", None), pad_token_id=getattr(t, "pad_token_id", None), **fields,
        )
        cfg.pard_token = self.mask_token_id
        cfg.architectures = ["LlamaForCausalLM"]
        return cfg

    def save(self, directory: Path) -> None:
        from transformers import LlamaForCausalLM

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        hf = LlamaForCausalLM(self.hf_config())
        missing, unexpected = hf.load_state_dict({k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                                                 strict=False)
        if unexpected or [m for m in missing if not (self.tie and m == "lm_head.weight")]:
            raise api.SpecframeError(f"pard: draft weights do not map onto LlamaForCausalLM: {missing} {unexpected}")
        hf.save_pretrained(str(directory / HF_DIR), safe_serialization=True)
        info = {**self.describe(), "mask_token_id": self.mask_token_id,
                "pard_token": self.mask_token_id, "causal_lm": HF_DIR}
        (directory / self.CHECKPOINT_INFO).write_text(json.dumps(info, indent=1))

    def load(self, directory: Path) -> None:
        from transformers import LlamaForCausalLM

        directory = Path(directory)
        info = self.read_checkpoint_info(directory)
        hf = LlamaForCausalLM.from_pretrained(str(directory / info["causal_lm"]), dtype=torch.float32)
        try:
            self.model.load_state_dict(hf.state_dict())
        except RuntimeError as exc:
            raise api.SpecframeError(f"{directory}: weights do not fit this pard drafter: {exc}") from exc
        self.mask_token_id = int(hf.config.pard_token)

    def export_vllm(self, directory: Path, tokenizer: Any, serving: api.Serving | None = None) -> api.Manifest:
        """vLLM's ``{"method": "draft_model", "parallel_drafting": true}`` layout: the plain causal LM."""
        if self.mask_token_id is None:
            raise api.SpecframeError("pard: no mask token chosen (train the drafter or load a checkpoint first)")
        weights = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
        config = {k: v for k, v in self.hf_config().to_dict().items() if k != "pard_token"}
        return api.vllm_layouts.write_pard(
            directory, weights, config=config, pard_token=self.mask_token_id, tokenizer=tokenizer, drafter=self.name,
            serving=serving,
        )

    def import_weights(self, imported: Any) -> None:
        """Load a PARD causal LM of the target's tokenizer (config with ``pard_token``; ``specframe.layouts.imports``)
        with this drafter's depth; its ``pard_token`` becomes the mask token."""
        if imported.layout != "pard":
            raise api.SpecframeError(f"cannot import {imported.directory}: it holds a {imported.layout} drafter, not pard")
        imported.check_target(self.target_config)
        imported.check_shape(self.name, layers=self.options.layers)
        state = dict(imported.tensors)
        embed = state.get("model.embed_tokens.weight")
        head = state.get("lm_head.weight")
        if self.tie and head is not None and embed is not None and not torch.equal(head, embed):
            raise api.SpecframeError(
                f"cannot import {imported.directory}: tie_word_embeddings: the target ties lm_head to the embedding, "
                "the folder's lm_head.weight differs from its embedding"
            )
        if embed is not None and (self.tie or head is None):
            state["lm_head.weight"] = embed
        own = self.model.state_dict()
        extra, missing = sorted(set(state) - set(own)), sorted(set(own) - set(state))
        if extra or missing:
            what = f"tensor {extra[0]!r} has no place in the drafter" if extra else f"missing tensor {missing[0]!r}"
            raise api.SpecframeError(f"cannot import {imported.directory}: {what}")
        self.model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})
        self.mask_token_id = imported.mask_token_id


@api.hookimpl
def register_drafters(register):
    register(PardDrafter)
