"""``eagle3``: the autoregressive EAGLE-3 drafter (Li et al. 2025, arXiv 2503.01840) on the shared engine.

Network (vLLM ``llama_eagle3`` layout, ``api.eagle.EagleBackbone``): the target's low / mid / high hidden states
(3H) go through ``fc`` to H; the first decoder layer's attention reads cat(norm(embedding), norm(hidden)) (2H); one
layer by default, as released; a draft-vocabulary ``lm_head`` with ``d2t`` / ``t2d``. The token embedding is the
target's, frozen unless ``train_embedding``.

Training-time test (TTT), the shared rule of docs/design.md section 3: element (a, d) has rotary position a + d, token
input the true next token at its reference position (x_{a+d+1} in the EAGLE shift) and, for d >= 1, hidden input the
drafter's own pre-norm output at (a, d-1). Pass d forwards the segment with the engine's attention and charges the
loss of its depth-d elements. The visibility rule lets no element see a deeper one, so the deeper elements a pass
also forwards (their inputs are not final yet) never change a shallower output: no private mask is needed and every
mask builder and partitioner applies. Each pass forwards the whole segment (the engine's attention is built for it),
so a step costs ``depth`` forwards of the element set; gradients flow through the fed-back states, as in the original
TTT loop. Loss: forward KL from the target distribution over the draft vocabulary (soft cross-entropy up to a
constant), weighted 0.8^d by default (``depth_decay`` or explicit ``depth_weights``). COD is off by default
(``cod_ratio`` 1: the full grid, as EAGLE-3 trains every position at every step).

Inference (batch 1): ``start`` / ``accept`` queue committed tokens with their features (token x_{t+1} with g_t);
``propose(k)`` forwards the queued tokens into the KV cache, then drafts k tokens one forward each, feeding its own
output state back; the draft steps' KV entries are dropped afterwards (rollback), so after partial acceptance the
accepted tokens are re-read with the target's real features. ``propose_tree`` grows an EAGLE-2 dynamic tree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch

from specframe import api

modeling = api.modeling
eagle = api.eagle
AUX = "aux_hidden"


_fields = api.eagle.FamilyFields("eagle3")  # the options the EAGLE family shares, defined once
_positive, _unit = _fields.positive, _fields.unit


def _weights(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not value or any(not isinstance(w, int | float) or w < 0 for w in value)):
        raise api.UsageError(f"eagle3 option 'depth_weights' must be a non-empty list of weights >= 0, got {value!r}")


@attrs.define
class Eagle3Options:
    """EAGLE-3 settings (the ``[drafter_options]`` table of ``specframe train --config``)."""

    layers: int = attrs.field(default=1, validator=_positive, metadata={
        "help": "decoder layers; the first reads cat(embedding, hidden). 1 as released"})
    ttt_steps: int = attrs.field(default=7, validator=_positive, metadata={
        "help": "training-time-test passes = the default training depth (k_train); --depth overrides it. 7 as in "
                "the original code, where peagle and pard train 8: pass --depth for an equal-depth comparison"})
    k_infer: int = _fields.k_infer()
    depth_decay: float = attrs.field(default=0.8, validator=_unit, metadata={
        "help": "depth d's loss weight is depth_decay ** d (0.8 in the original) unless depth_weights lists them"})
    depth_weights: list[float] | None = attrs.field(default=None, validator=_weights, metadata={
        "help": "explicit loss weight per depth (overrides depth_decay); null: use depth_decay"})
    draft_vocab_size: int | None = _fields.draft_vocab_size(
        "the same default as peagle and parallelspec (EAGLE-3 released 32000 for Llama 3's 128K vocabulary)",
        default=None)
    aux_layer_ids: list[int] | None = _fields.aux_layer_ids("clamped for tiny targets")
    train_embedding: bool = _fields.train_embedding()
    cod_ratio: float = _fields.cod_ratio(1.0, "1 is the EAGLE-3 recipe")
    cod_min_ratio: float = _fields.cod_min_ratio()
    activation_checkpointing: bool = _fields.activation_checkpointing()
    loss_chunk: int = _fields.loss_chunk()
    vocab_position_mask: bool = attrs.field(default=True, metadata={
        "help": "leave out of the loss the positions whose target top-1 token lies outside the draft vocabulary, as "
                "the EAGLE-3 / P-EAGLE reference trainers do (t2d[argmax] x mask); evaluation reports the share dropped"})
    train_head: bool = _fields.train_head()
    loss_mask_bit: str = _fields.loss_mask_bit()
    loss_normalisation: str = _fields.loss_normalisation()
    loss: str = _fields.loss()
    ce_weight: float = _fields.ce_weight()
    init_from_target_layers: bool = _fields.init_from_target_layers()
    qk_norm: bool = _fields.qk_norm()
    norm_before_residual: bool = _fields.norm_before_residual()
    norm_before_fc: bool = _fields.norm_before_fc()
    norm_output: bool = _fields.norm_output()
    sliding_window: int | None = _fields.sliding_window()

    @property
    def k_train(self) -> int:
        """The engine's default training depth: one element depth per TTT pass."""
        return self.ttt_steps


def parents_of(elements: api.ElementSet) -> torch.Tensor:
    """Index of each element's parent (a, d-1) within ``elements`` (-1 at depth 0). Raises if a chain is broken."""
    key = elements.anchor * (elements.max_depth + 1) + elements.depth
    order = torch.argsort(key)
    pos = torch.searchsorted(key[order], key - 1).clamp(max=len(elements) - 1)
    parent = order[pos] if len(elements) else pos
    deep = elements.depth > 0
    if bool((key[parent][deep] != (key - 1)[deep]).any()):
        raise api.PluginError("eagle3: a segment holds an element without its parent (the partition is not causal)")
    return torch.where(deep, parent, torch.full_like(parent, -1))


class Eagle3Drafter(api.eagle.FamilyDrafter, api.Drafter):
    name = "eagle3"
    Options = Eagle3Options
    parallel = False
    builds_trees = True  # propose_tree grows an EAGLE-2 dynamic tree
    depth_option = "ttt_steps"  # the training depth: one element depth per TTT pass

    def __init__(self, target_config: Any, options: Eagle3Options | None = None) -> None:
        super().__init__(target_config, options)
        opts = self.options
        self.aux_layer_ids = eagle.aux_layer_ids(self.name, opts.aux_layer_ids, int(target_config.num_hidden_layers))
        self.shape = modeling.LayerShape.from_config(target_config)
        self.vocab_size = int(target_config.vocab_size)
        self.draft_vocab_size = api.eagle.draft_vocab_size(opts.draft_vocab_size, self.vocab_size)
        self.model = eagle.EagleBackbone(self.shape, self.vocab_size, self.draft_vocab_size, 3, opts.layers,
                                         architecture=eagle.Architecture.of(opts))
        self.model.embed_tokens.weight.requires_grad_(opts.train_embedding)
        eagle.freeze_head(self.model, opts.train_head)
        self._sequence_scale = 1.0  # loss_normalisation 'sequence': set by prepare from the training data
        self._target_head: eagle.TargetHead | None = None
        self._reset_inference()

    def feature_spec(self) -> api.FeatureSpec:
        return api.FeatureSpec(aux_layers=tuple(self.aux_layer_ids), final_hidden=True)

    def module(self) -> torch.nn.Module:
        return self.model

    # ---------------------------------------------------------------------------------------------------- training
    def prepare(self, target: Any, examples: Any) -> None:
        """Copy the target's embedding, choose the draft vocabulary and initialise ``lm_head`` from the target's
        rows of it; keep the target's lm_head for the loss."""
        examples = list(examples)
        draft = eagle.draft_vocabulary(examples, self.draft_vocab_size, self.vocab_size)
        self._target_head = eagle.start_from_target(self.model, target, draft, self.options.init_from_target_layers)
        self._sequence_scale = eagle.supervised_per_document(examples, self.supervision)

    def supervision(self, example: api.TrainingExample) -> torch.Tensor:
        return api.eagle.shifted_supervision(example.loss_mask, example.doc, self.options.loss_mask_bit)

    def loss(
        self, example: api.TrainingExample, elements: api.ElementSet, segment: api.Segment, attention: api.Attention
    ) -> api.LossTerms:
        if self._target_head is None:
            raise api.SpecframeError("eagle3: prepare(target, examples) must run before loss()")
        model = self.model
        device = model.lm_head.weight.device
        dtype = model.lm_head.weight.dtype
        sub = elements.subset(segment.elements)
        window = self.options.sliding_window
        if window is not None and getattr(attention, "subset", None) is not None:
            # each pass's attention is built from these sets (below): stamped, every pass applies the window
            sub = attrs.evolve(sub, window=window)
        elif window is not None:
            attention = eagle.windowed(attention, sub, window)  # refused, by name, where the window binds
        depth = sub.depth.to(device)
        pos = sub.position.to(device)
        parent = parents_of(sub).to(device)
        ids = example.input_ids.to(device)
        aux = example.features[AUX].to(device=device, dtype=dtype)
        sup = self.supervision(example).to(device)
        charged = segment.loss_mask.to(device) & sup[pos]
        k = elements.max_depth
        weights = eagle.depth_weights(k, self.options.depth_decay, self.options.depth_weights).to(device)
        teacher = eagle.kl_teacher(example.features, model.t2d, self._target_head, device=device, dtype=dtype,
                                   mask=self.options.vocab_position_mask, evaluating=not model.training)
        masked = 0

        embeds = model.embed_tokens(ids[pos + 1])
        hidden = model.fuse(aux[sub.anchor.to(device)])
        # a segment may be charged with nothing (context only); its zero must still be part of the graph
        loss_sum = api.LossTerms.zero(hidden)
        hits = torch.zeros(len(sub), dtype=torch.bool)
        passes = int(depth.max()) + 1 if len(sub) else 0

        # each pass's charged outputs wait here and the loss runs once over all depths, so the target's distribution
        # at a position is computed once for every depth that predicts it (with depth d's weight per row)
        charged_out: list[torch.Tensor] = []
        charged_rows: list[torch.Tensor] = []

        def charge(d: int, out: torch.Tensor, rows: torch.Tensor) -> None:
            """Queue the charged depth-``d`` elements ``rows`` (indices); ``out``: their pre-norm outputs."""
            if rows.numel():
                charged_out.append(out)
                charged_rows.append(rows)

        subset = getattr(attention, "subset", None)
        if subset is None:
            # a plain Attention (no builder at hand): every pass forwards the whole segment, K times the work
            for d in range(passes):
                out = model.run(embeds, hidden, pos, attention, checkpointing=self.options.activation_checkpointing)[0]
                rows = (charged & (depth == d)).nonzero().squeeze(1)
                charge(d, out[rows], rows)
                if d + 1 < passes:
                    # depth d+1 now reads its parent's fresh output; every shallower input is unchanged
                    hidden = torch.where((depth == d + 1)[:, None], model.feed(out)[parent.clamp(min=0)], hidden)
        else:
            # Pass d forwards only the depth-d elements: a shallower element's inputs never change after its own
            # pass, so its keys and values (every layer) are the ones that pass produced, and no depth-d element
            # sees a deeper one. Same outputs and gradients as forwarding the whole segment each pass, 1/K the work.
            past: list[modeling.KV] | None = None
            done: list[torch.Tensor] = []
            row = torch.full((len(sub),), -1, dtype=torch.long, device=device)
            for d in range(passes):
                sel = (depth == d).nonzero().squeeze(1)
                keys = torch.cat([*done, sel])
                att = subset(sub.subset(sel.cpu()), sub.subset(keys.cpu()))
                out, kvs = model.run(embeds[sel], hidden[sel], pos[sel], att, past=past,
                                     checkpointing=self.options.activation_checkpointing)
                past = kvs if past is None else eagle.cat_kv(past, kvs)
                done.append(sel)
                mine = charged[sel]
                charge(d, out[mine], sel[mine])
                if d + 1 < passes:
                    row[sel] = torch.arange(len(sel), device=device)
                    nxt = (depth == d + 1).nonzero().squeeze(1)
                    hidden = hidden.index_copy(0, nxt, model.feed(out[row[parent[nxt]]]))
        if charged_rows:
            rows = torch.cat(charged_rows)
            row_weight = weights[depth[rows]]
            if self.options.loss_normalisation == "sequence":
                row_weight = row_weight * eagle.sequence_weights(
                    elements, sup, segment.elements[rows.cpu()], self._sequence_scale).to(device)
            result = modeling.chunked_forward_kl(
                model.norm(torch.cat(charged_out)), model.lm_head.weight, **teacher, chunk=self.options.loss_chunk,
                target_index=pos[rows] + 1, row_weight=row_weight, **eagle.loss_kind(self.options),
            )
            masked = result.dropped
            loss_sum = loss_sum + result.loss_sum
            hits[rows.cpu()] = result.correct.cpu()
        d_ch = sub.depth[charged.cpu()]
        correct, total = eagle.per_depth(d_ch, hits[charged.cpu()], k)
        return api.LossTerms(loss_sum, int(charged.sum()), correct, total, hit=hits[charged.cpu()], masked=masked)

    # --------------------------------------------------------------------------------------------------- inference
    def _reset_inference(self) -> None:
        self._cache: list[modeling.KV] | None = None
        self._cached = 0
        self._pending = api.eagle.PendingInputs(self.name)
        self._last: torch.Tensor | None = None  # pre-norm output of the last committed position

    def start(self, prompt_ids: torch.Tensor, features: dict[str, torch.Tensor]) -> None:
        self._reset_inference()
        self._pending.start(prompt_ids, features)

    def accept(self, emitted: torch.Tensor, features: dict[str, torch.Tensor]) -> None:
        self._pending.accept(emitted, features)

    def _commit(self) -> torch.Tensor:
        """Forward the queued committed tokens into the KV cache; returns the last one's pre-norm output."""
        model = self.model
        device = model.lm_head.weight.device
        tokens, aux = self._pending.take()
        tokens, aux = tokens.to(device), aux.to(device)
        position = torch.arange(self._cached, self._cached + tokens.shape[0], device=device)
        out, kvs = model.run(
            model.embed_tokens(tokens), model.fuse(aux), position,
            modeling.causal_attention(self._cached, self.options.sliding_window), past=self._cache,
        )
        self._cache = kvs if self._cache is None else eagle.cat_kv(self._cache, kvs)
        self._cached += tokens.shape[0]
        return out[-1:]

    def _step(self, token: torch.Tensor, hidden: torch.Tensor, chain: list[modeling.KV] | None, offset: int):
        """One draft step past the committed cache: ``chain`` holds the KV of this path's earlier draft steps;
        ``hidden`` is the previous step's pre-norm output (fed as ``model.feed`` makes it)."""
        model = self.model
        past = self._cache if chain is None else eagle.cat_kv(self._cache, chain)
        position = torch.tensor([self._cached + offset], device=hidden.device)
        out, kvs = model.run(
            model.embed_tokens(token.view(1)), model.feed(hidden), position,
            modeling.causal_attention(self._cached + offset, self.options.sliding_window), past=past,
        )
        return out, (kvs if chain is None else eagle.cat_kv(chain, kvs))

    @torch.no_grad()
    def propose(self, k: int, generator: torch.Generator | None = None) -> api.Draft:
        if k < 1:
            raise api.UsageError(f"eagle3.propose: k must be positive, got {k}")
        model = self.model
        out = self._commit()
        chain = None
        drafted = []
        for step in range(k):
            token = model.to_target(model.logits(out).argmax(-1))
            drafted.append(token)
            if step + 1 < k:
                out, chain = self._step(token, out, chain, step)
        # the draft steps' KV entries are never stored: the cache holds committed tokens only
        return api.Draft(tokens=torch.cat(drafted).cpu())

    @torch.no_grad()
    def propose_tree(
        self, depth: int, top_k: int, total_tokens: int, generator: torch.Generator | None = None
    ) -> api.Draft:
        model = self.model
        root = self._commit()
        states: dict[int, tuple[torch.Tensor, list[modeling.KV] | None]] = {}

        def full_logprobs(out: torch.Tensor) -> torch.Tensor:
            logp = torch.log_softmax(model.logits(out).float(), dim=-1)
            full = logp.new_full((logp.shape[0], self.vocab_size), float("-inf"))
            full[:, model.draft_ids()] = logp
            return full

        def expand(tree: api.DraftTree, nodes: list[int]) -> torch.Tensor:
            rows = []
            for node in nodes:
                parent = tree.parents[node]
                hidden, chain = (root, None) if parent < 0 else states[parent]
                token = torch.tensor(tree.tokens[node], device=root.device)
                out, new_chain = self._step(token, hidden, chain, tree.depth[node] - 1)
                states[node] = (out, new_chain)
                rows.append(full_logprobs(out))
            return torch.cat(rows)

        return api.dynamic_tree(full_logprobs(root)[0], expand, depth=depth, top_k=top_k, total_tokens=total_tokens)

    # -------------------------------------------------------------------------------------------------- checkpoints
    def export_vllm(self, directory: Path, tokenizer: Any, serving: api.Serving | None = None) -> api.Manifest:
        """The speculators ``eagle3`` layout vLLM serves from the folder alone (``LLM(model=EXPORT)``, the verifier
        being this target); the module's tensors already carry its names."""
        layouts = api.vllm_layouts
        weights = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
        config = layouts.llama_config(self.target_config, self.options.layers)
        return layouts.write_eagle3(
            directory, weights, config=config, aux_layer_ids=self.aux_layer_ids, target_hidden_size=self.shape.hidden,
            target_num_layers=int(self.target_config.num_hidden_layers), tokenizer=tokenizer, drafter=self.name,
            verifier=layouts.verifier_of(self.target_config), speculative_tokens=self.options.k_infer,
            verifier_architectures=layouts.verifier_architectures_of(self.target_config),
            architecture=self.model.architecture.export_fields(), serving=serving,
        )

    @classmethod
    def import_options(cls, imported: Any) -> dict[str, Any]:
        """The folder's shape and its layer architecture (``qk_norm``, the EAGLE 3.1 norms, ``sliding_window``)."""
        return {**super().import_options(imported), **imported.architecture}

    def import_weights(self, imported: Any) -> None:
        """Load an EAGLE-3 folder (speculators, SafeAILab or SpecForge layout; ``specframe.layouts.imports``) of this
        drafter's shape; without ``embed_tokens`` the target's embedding is used, as vLLM does."""
        if imported.layout != "eagle3":
            raise api.SpecframeError(f"cannot import {imported.directory}: it holds a {imported.layout} drafter, not eagle3")
        imported.check_target(self.target_config)
        imported.check_shape(self.name, layers=self.options.layers, aux_layer_ids=self.aux_layer_ids,
                             draft_vocab_size=self.draft_vocab_size, **self.model.architecture.export_fields())
        state = imported.eagle_state(self.model.state_dict(), self.target_config,
                                     own_embedding_is_target=self._target_head is not None)
        self.model.load_state_dict(state)


@api.hookimpl
def register_drafters(register):
    register(Eagle3Drafter)
