"""The block-drafting backbone that DFlash and DSpark share (``api.block``, API version 7).

A block drafter reads the target's aux hidden states as context and runs one block of slots (an anchor token and
mask tokens) through Qwen3-style decoder layers whose keys and values are [context | block]. Names follow vLLM's
``DFlashQwen3Model`` (``fc``, ``hidden_norm``, ``layers.i.self_attn.{q,k,v,o}_proj``, ``q_norm`` / ``k_norm``,
``mlp``, ``norm``, ``embed_tokens``, ``lm_head``), which vLLM's ``Qwen3DSparkModel`` extends, so both exports are
rename-free copies of the state dict.

Context: the target's aux hidden states at a position, concatenated, go through ``fc`` and ``hidden_norm`` once; every
layer projects that one state to its own k (with ``k_norm`` and RoPE at the context position) and v. The context never
runs through a layer: this is what lets vLLM write it straight into each layer's KV cache, and what makes a block's
prediction depend on the target's features only, never on another block.

The methods differ only in what the slots predict (DFlash: the mask slots, at their own position; DSpark: every slot,
the anchor included, the next token) and in what runs on the slots' hidden states, so this module stops at the
hidden states: ``block_hidden`` (training, through the segment's mask builder under the block rule) and
``BlockContext`` (inference, the context cached across rounds).

The block anchored at drafter position a (the EAGLE pairing: it reads feature g_a and token x_{a+1}) is
[x_{a+1}, MASK, ...] at positions a + 1 .., and its context is the features at positions <= a of a's document.

What both methods' training does alike before and around the hidden states is here too: ``share_target`` (the
target's embedding and lm_head, and the mask token), ``charged_blocks`` (a segment's charged elements and the blocks
they lie in), ``trained_elements`` (which of them the references train) and ``element_weights`` (their weights in the
loss and its normaliser: the trained ones by the depth decay, the others 0).

And what the two drafter classes declare and record alike (API 14): ``BlockDrafter``, a mixin holding their
target-layer choice, declarations, supervision, checkpoint record, import checks and export preamble once, as
``api.eagle.FamilyDrafter`` does for the EAGLE family; ``resolve_k_infer`` and ``check_decay_gamma``, the option checks
both ``Options`` classes run; ``reference_init``, the references' initialisation of the modules a drafter owns.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from specframe.declarations import Training, positive_int_or_null
from specframe.drafting import modeling, vocab
from specframe.drafting.elements import ElementSet
from specframe.drafting.eagle import shifted_supervision
from specframe.errors import SpecframeError, UsageError
from specframe.features import FeatureSpec
from specframe.values import is_int, is_number

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = ["INIT_STD", "MAX_ANCHORS", "BlockAttention", "BlockContext", "BlockDrafter", "BlockLayer", "BlockModel", "ChargedBlocks",
           "RMSNorm", "block_hidden", "charged_blocks", "check_decay_gamma", "default_aux_layers", "element_docs",
           "element_weights", "full_attention", "max_anchors_field", "position_docs", "reference_init", "resolve_k_infer", "share_target",
           "spaced_aux_layers", "trained_elements"]

#: the std of every Linear / Embedding a block drafter owns at the start (transformers' initializer_range, 0.02 in
#: z-lab's, SpecForge's, speculators' and DeepSpec's configs)
INIT_STD = 0.02


def spaced_aux_layers(num_layers: int, draft_layers: int) -> list[int]:
    """The block drafters' target layers: one per draft layer, evenly spaced over decoder outputs 1 .. L-3 (the
    middle one for a single draft layer), as z-lab's ``build_target_layer_ids`` (DeepSpec's DSpark configs use the
    same: [1, 9, 17, 25, 33] for 5 draft layers on a 36-layer Qwen3-4B); returned as specframe aux ids (the hidden
    state *entering* a layer, i.e. the output index + 1), clamped into the target."""
    if draft_layers == 1:
        outputs = [num_layers // 2]
    else:
        start, end = 1, max(1, num_layers - 3)
        outputs = [int(round(start + i * (end - start) / (draft_layers - 1))) for i in range(draft_layers)]
    return [min(o + 1, num_layers - 1) for o in outputs]


# the old name, kept as an alias for plugins written against it: EAGLE-3's choice of layers had the same name
# (``api.eagle.low_mid_high_layers`` now), for another rule
default_aux_layers = spaced_aux_layers


@torch.no_grad()
def reference_init(model: nn.Module, keep: tuple[nn.Module, ...] = ()) -> None:
    """The references' start: their block drafters are transformers ``PreTrainedModel`` s whose ``post_init`` draws
    every Linear and Embedding N(0, ``INIT_STD``), biases 0, norms 1 (PyTorch's own Linear default is kaiming-uniform,
    std about 1 / sqrt(3 fan_in); its Embedding N(0, 1)). The modules in ``keep`` are left alone and draw nothing
    (DFlash keeps its embedding and lm_head, which ``prepare`` copies the target's over; DSpark draws them too, so
    each draws what it always drew and starts from the same weights)."""
    for module in model.modules():
        if any(module is k for k in keep):
            continue
        if isinstance(module, nn.Linear | nn.Embedding):
            module.weight.normal_(0.0, INIT_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.zero_()


def resolve_k_infer(drafter: str, options: Any, most: int, most_text: str) -> None:
    """Resolve ``options.k_infer`` (None: ``most``, the draft tokens of a full block) and check it lies in 1..``most``
    (``most_text`` names that bound in the message: DFlash's ``block_size - 1``, DSpark's ``block_size``). Resolved
    in the options so that ``specframe generate`` and the export read one number."""
    if options.k_infer is None:
        options.k_infer = most
    k = options.k_infer
    if not is_int(k, 1, most):
        raise UsageError(f"{drafter} option 'k_infer' must be in 1..{most_text} ({most}), got {k!r}")


def check_decay_gamma(drafter: str, gamma: Any) -> None:
    """``loss_decay_gamma`` is a positive number (the depth decay exp(-d / gamma)) or None (uniform)."""
    if gamma is not None and not (is_number(gamma) and gamma > 0):
        raise UsageError(f"{drafter} option 'loss_decay_gamma' must be a positive number or null, got {gamma!r}")


#: anchors a block drafter trains per sequence in a step (a uniform sample when a sequence has more): SpecForge
#: (``dflash_family_model.py`` L147, L179-210), DeepSpec (``dflash_qwen3_4b.py`` L15) and speculators
#: (``models/dflash/core.py`` L248) all sample 512
MAX_ANCHORS = 512


def max_anchors_field(drafter: str) -> Any:
    """The ``max_anchors`` option DFlash and DSpark share (``Training.max_anchors``): a positive integer or null."""
    return attrs.field(default=MAX_ANCHORS, validator=positive_int_or_null(drafter), metadata={
        "help": "anchors (blocks) a training step charges per sequence, a uniform sample when there are more, as "
                "SpecForge, DeepSpec and speculators sample 512; the others stay context (null: every anchor)"})


# One RMSNorm for every drafter's layers (at least fp32, float64 kept); re-exported here as ``api.block.RMSNorm``,
# which DFlash's model names.
RMSNorm = modeling.RMSNorm


class BlockAttention(nn.Module):
    def __init__(self, shape: modeling.LayerShape) -> None:
        super().__init__()
        self.shape = shape
        h, hd = shape.hidden, shape.head_dim
        self.q_proj = nn.Linear(h, shape.heads * hd, bias=False)
        self.k_proj = nn.Linear(h, shape.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, shape.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(shape.heads * hd, h, bias=False)
        # per-head RMSNorm on q and k before RoPE (Qwen3; vLLM's DFlash layer has them)
        self.q_norm = RMSNorm(hd, shape.eps)
        self.k_norm = RMSNorm(hd, shape.eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], n, self.shape.head_dim)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [kv_heads, N, head_dim] of states ``x`` [N, H] (the context, or the block's normed hidden)."""
        k = self.k_norm(self._heads(self.k_proj(x), self.shape.kv_heads))
        v = self._heads(self.v_proj(x), self.shape.kv_heads)
        k = modeling.apply_rotary(k.transpose(0, 1), cos, sin)
        return k, v.transpose(0, 1)

    def forward(self, x, cos, sin, context_kv, attention: Attention) -> torch.Tensor:
        q = self.q_norm(self._heads(self.q_proj(x), self.shape.heads))
        q = modeling.apply_rotary(q.transpose(0, 1), cos, sin)
        k, v = self.keys(x, cos, sin)
        ck, cv = context_kv
        k, v = torch.cat([ck, k], 1), torch.cat([cv, v], 1)
        if not getattr(attention, "grouped_kv", False):
            k, v = modeling.expand_kv(k[None], self.shape.heads)[0], modeling.expand_kv(v[None], self.shape.heads)[0]
        out = attention(q[None], k[None], v[None])[0]  # [heads, N, head_dim]
        return self.o_proj(out.transpose(0, 1).reshape(x.shape[0], -1))


class BlockLayer(nn.Module):
    def __init__(self, shape: modeling.LayerShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden, shape.eps)
        self.self_attn = BlockAttention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.eps)
        self.mlp = modeling.MLP(shape)

    def forward(self, h, cos, sin, context_kv, attention) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context_kv, attention)
        return h + self.mlp(self.post_attention_layernorm(h))


class BlockModel(nn.Module):
    def __init__(self, shape: modeling.LayerShape, vocab_size: int, n_aux: int, layers: int,
                 target_hidden: int) -> None:
        super().__init__()
        self.shape = shape
        self.fc = nn.Linear(n_aux * target_hidden, shape.hidden, bias=False)
        self.hidden_norm = RMSNorm(shape.hidden, shape.eps)
        self.layers = nn.ModuleList(BlockLayer(shape) for _ in range(layers))
        self.norm = RMSNorm(shape.hidden, shape.eps)
        # the target's embedding and lm_head, frozen (both methods share them with the target; kept here so a
        # checkpoint and its export are complete without the target's weights)
        self.embed_tokens = nn.Embedding(vocab_size, shape.hidden)
        self.lm_head = nn.Linear(shape.hidden, vocab_size, bias=False)
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    def rotary(self, position: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return modeling.rotary(position, self.shape, dtype)

    def context_states(self, aux: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(aux)) [N, H]: one context state per target position."""
        return self.hidden_norm(self.fc(aux))

    def context_kv(self, states: torch.Tensor, position: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's context (k, v) [kv_heads, N, head_dim] at ``position`` (no layer runs on the context)."""
        cos, sin = self.rotary(position, states.dtype)
        return [layer.self_attn.keys(states, cos, sin) for layer in self.layers]

    def forward(self, tokens, position, context_kv, attention: Attention) -> torch.Tensor:
        """Final-normed hidden states [N, H] of the block slots ``tokens`` at ``position``."""
        h = self.embed_tokens(tokens)
        cos, sin = self.rotary(position, h.dtype)
        for layer, kv in zip(self.layers, context_kv, strict=True):
            h = layer(h, cos, sin, kv, attention)
        return self.norm(h)


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One block at inference sees all of the context and all of itself: no mask."""
    return F.scaled_dot_product_attention(q, k, v)


def share_target(model: BlockModel, target: Any, examples: Any) -> int:
    """Copy the target's embedding and lm_head into ``model`` (frozen: both methods share them with the target) and
    return the mask token, picked by ``specframe.drafting.vocab``'s rule (a special or reserved token never seen in
    ``examples``, the training data): what DFlash's and DSpark's ``prepare`` do alike."""
    vocab_size = model.embed_tokens.num_embeddings
    emb = target.model.get_input_embeddings().weight.detach()
    head = target.model.get_output_embeddings().weight.detach()
    counts = vocab.count_tokens(list(examples), vocab_size, masked_only=False)
    mask_token_id = vocab.mask_token_ids(target.tokenizer, 1, data_counts=counts, embedding_rows=vocab_size)[0]
    with torch.no_grad():
        model.embed_tokens.weight.copy_(emb[:vocab_size].to(model.embed_tokens.weight.dtype))
        model.lm_head.weight.copy_(head[:vocab_size].to(model.lm_head.weight.dtype))
    return mask_token_id


@attrs.frozen
class ChargedBlocks:
    """The elements (a, d) a block drafter's segment is charged with, and the blocks they lie in.

    ``anchor`` / ``depth`` [n]: the charged elements, in the order of ``elements.subset(segment.elements)`` (the order
    ``LossTerms.hit`` reports in); ``blocks``: their anchors, sorted and unique (the only blocks the loss runs: blocks
    are independent given the target's features); ``block_of`` [n]: each element's block, an index into ``blocks``."""

    anchor: torch.Tensor
    depth: torch.Tensor
    blocks: torch.Tensor
    block_of: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.anchor.numel())


def charged_blocks(elements: ElementSet, segment: Any, supervised: torch.Tensor) -> ChargedBlocks:
    """The elements of ``segment`` (an ``api.Segment`` of ``elements``) it is charged with: its loss mask, and
    ``supervised`` (the drafter's ``supervision``) at each element's position; with the blocks they lie in. A segment
    may be charged with nothing (``count`` 0): its loss is then ``LossTerms.empty``."""
    sub = elements.subset(segment.elements)
    pos = sub.anchor + sub.depth
    charged = segment.loss_mask.cpu() & supervised[pos]
    anchor, depth = sub.anchor[charged], sub.depth[charged]
    blocks, block_of = torch.unique(anchor, return_inverse=True)
    return ChargedBlocks(anchor, depth, blocks, block_of)


def trained_elements(loss_mask: torch.Tensor, supervised: torch.Tensor, anchor: torch.Tensor,
                     depth: torch.Tensor) -> torch.Tensor:
    """Which charged elements (a, d) a block drafter's loss trains, as the reference samplers choose them: the block's
    anchor token x_{a+1} is supervised (``loss_mask``, the data's: drafting only ever anchors on a generated token)
    as is its first target x_{a+2} (SpecForge's ``_sample_anchor_positions``, DeepSpec's
    ``build_anchor_candidate_mask``), and depth d only while the targets of depths 0..d are all ``supervised`` (the
    drafter's supervision; DeepSpec's ``build_eval_mask``: a block stops at its first unsupervised slot, as a draft
    never runs past the end of an answer). The engine's supervision is per position, so the elements outside this
    rule stay charged (counted, verdicts reported) with weight 0."""
    lm = loss_mask.to(torch.bool)
    # unsupervised positions before i: positions a..a+d are all supervised iff none lies in [a, a + d]
    gaps = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum((~supervised.to(torch.bool)).long(), 0)])
    contiguous = gaps[anchor + depth + 1] == gaps[anchor]
    return lm[anchor + 1] & contiguous


def element_weights(loss_mask: torch.Tensor, supervised: torch.Tensor, anchor: torch.Tensor, depth: torch.Tensor,
                    gamma: float | None) -> torch.Tensor:
    """Each element's weight (float64) in a block drafter's loss and in its normaliser (``Drafter.element_weights``,
    API 14): ``exp(-d / gamma)`` (1 with ``gamma`` None) on the elements ``trained_elements`` keeps, 0 on the others.
    The engine then divides the step's sum of w * loss by the sum of w over its charged elements: the references'
    ``sum(w * CE) / sum(w)`` over the trained slots (SpecForge ``dflash_family_model.py`` L350-362, L455-458;
    DeepSpec ``loss.py`` L112-114), where dividing by the charged count would scale every step by sum(w) / count."""
    weight = trained_elements(loss_mask, supervised, anchor, depth).to(torch.float64)
    if gamma is not None:
        weight = weight * torch.exp(-depth.to(torch.float64) / gamma)
    return weight


def element_docs(elements: ElementSet) -> torch.Tensor:
    """Document of each drafter position, read off the depth-0 elements of ``elements`` (every position has one, COD
    or not). Not ``specframe.drafting.elements.position_docs(doc, n)``, which derives them from the data's documents."""
    doc = torch.full((elements.seq_len,), -1, dtype=torch.long)
    roots = elements.depth == 0
    doc[elements.anchor[roots]] = elements.doc[roots]
    return doc


# the old name, kept as an alias for plugins written against it: ``specframe.drafting.elements.position_docs(doc, n)``
# has the same name for another function
position_docs = element_docs


def block_hidden(model: BlockModel, aux: torch.Tensor, input_ids: torch.Tensor, elements: ElementSet,
                 blocks: torch.Tensor, slots: int, mask_token_id: int, attention: Any) -> torch.Tensor:
    """Hidden states [len(blocks) * slots, H] of the blocks anchored at drafter positions ``blocks`` (sorted,
    unique), slot s of block i at row i * slots + s, as training runs them.

    The attention is expressed as element sets under the block rule (context = depth 0 at its own position; block
    slot s = depth s + 1) and asked of the segment's mask builder (``attention.subset``), so the configured builder's
    memory behaviour carries over; a block sees the context of its own document at positions <= its anchor, and
    itself. ``aux`` [L, n_aux * H_target]: the target's aux hidden states of the sequence, in the model's dtype."""
    device = model.fc.weight.device
    doc_of = element_docs(elements)
    last = int(blocks.max())
    ctx_pos = torch.arange(last + 1)
    width = slots + 1
    ctx_set = ElementSet(ctx_pos, torch.zeros_like(ctx_pos), doc_of[ctx_pos], elements.seq_len, width,
                         visibility="block")
    b_anchor = blocks.repeat_interleave(slots)
    b_slot = torch.arange(slots).repeat(blocks.numel())
    block_set = ElementSet(b_anchor, b_slot + 1, doc_of[b_anchor], elements.seq_len, width, visibility="block")
    key_set = ElementSet(
        torch.cat([ctx_set.anchor, block_set.anchor]), torch.cat([ctx_set.depth, block_set.depth]),
        torch.cat([ctx_set.doc, block_set.doc]), elements.seq_len, width, visibility="block",
    )
    attend = attention.subset(block_set, key_set) if hasattr(attention, "subset") else attention
    states = model.context_states(aux[: last + 1].to(device=device, dtype=model.fc.weight.dtype))
    context_kv = model.context_kv(states, ctx_pos.to(device))
    tokens = torch.full((b_anchor.numel(),), mask_token_id, dtype=torch.long)
    tokens[b_slot == 0] = input_ids[blocks + 1]  # the anchor token x_{a+1}
    return model(tokens.to(device), (b_anchor + 1 + b_slot).to(device), context_kv, attend)


class BlockContext:
    """The inference side: the context's per-layer (k, v), extended by each round's new (token, feature) pairs, and
    one block run against all of it."""

    def __init__(self, model: BlockModel) -> None:
        self.model = model
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.cached = 0  # context positions held: the features of positions 0 .. cached - 1

    def extend(self, aux: torch.Tensor) -> None:
        model = self.model
        device = model.fc.weight.device
        p = int(aux.shape[0])
        states = model.context_states(aux.to(device=device, dtype=model.fc.weight.dtype))
        new = model.context_kv(states, torch.arange(self.cached, self.cached + p, device=device))
        if self.kv is None:
            self.kv = new
        else:
            self.kv = [(torch.cat([ck, nk], 1), torch.cat([cv, nv], 1))
                       for (ck, cv), (nk, nv) in zip(self.kv, new, strict=True)]
        self.cached += p

    def run(self, anchor: int, slots: int, mask_token_id: int) -> torch.Tensor:
        """Hidden states [slots, H] of the block [anchor, MASK x (slots - 1)] at positions cached .. (the anchor is
        the token after the last cached feature's position, x_{t+1} for features up to t)."""
        if self.kv is None:
            raise RuntimeError("BlockContext.run before any context was added")
        device = self.model.fc.weight.device
        block = torch.full((slots,), mask_token_id, dtype=torch.long, device=device)
        block[0] = anchor
        position = torch.arange(self.cached, self.cached + slots, device=device)
        return self.model(block, position, self.kv, full_attention)


class BlockDrafter:
    """What DFlash's and DSpark's drafter classes declare and record alike: a mixin that goes first in the bases,
    before ``api.eagle.QueuedInference`` and ``api.Drafter``. The class sets ``anchor_predicts`` (whether the anchor
    slot is a prediction, so a block of ``block_size`` slots drafts ``block_size`` tokens, or only its mask slots
    are) and the words its messages name the bound with; its ``__init__`` calls ``init_block`` before it builds its
    ``model`` (a ``BlockModel``) and its options carry ``layers``, ``block_size``, ``k_infer``, ``aux_layer_ids``,
    ``loss_chunk``, ``loss_decay_gamma`` and ``max_anchors`` (``max_anchors_field``)."""

    #: DSpark: the anchor slot is the first prediction position; DFlash: only the block_size - 1 mask slots predict
    anchor_predicts: ClassVar[bool] = False
    #: the depth bound and the slots it counts, as the messages name them ("block_size - 1", "mask slots")
    depth_text: ClassVar[str] = "block_size - 1"
    depth_slots: ClassVar[str] = "mask slots"
    #: whether the loss reads the target's final hidden states (DSpark's l1 term and confidence)
    final_hidden: ClassVar[bool] = False

    @classmethod
    def block_depth(cls, block_size: int) -> int:
        """Draft tokens (and training depths) of a block of ``block_size`` slots."""
        return block_size if cls.anchor_predicts else block_size - 1

    @classmethod
    def training(cls, options: Any) -> Training:
        # every predicting slot of a block is a depth; the whole block trains (no COD), and the layers keep activations
        return Training(depth=cls.block_depth(options.block_size), k=options.k_infer, loss_chunk=options.loss_chunk,
                        max_anchors=options.max_anchors)

    @classmethod
    def comparison_options(cls, depth: int, draft_vocab_size: int, k: int) -> dict[str, Any]:
        # a block holds one predicting slot per depth; both draft over the full target vocabulary
        return {"block_size": depth + (0 if cls.anchor_predicts else 1), "k_infer": min(k, depth)}

    @classmethod
    def import_options(cls, imported: Any) -> dict[str, Any]:
        values = super().import_options(imported)
        if isinstance(imported.config.get("block_size"), int):  # the block it was trained on
            values["block_size"] = int(imported.config["block_size"])
        return values

    def init_block(self, target_config: Any) -> None:
        """The target layers the context reads (``aux_layer_ids``, else ``spaced_aux_layers``), checked against the
        target, its layer ``shape`` and ``vocab_size``, and no mask token until ``prepare`` or a checkpoint sets it."""
        opts = self.options
        n_layers = int(target_config.num_hidden_layers)
        ids = opts.aux_layer_ids if opts.aux_layer_ids is not None else spaced_aux_layers(n_layers, opts.layers)
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < n_layers]
        if not ids or bad:
            raise UsageError(
                f"{self.name} aux layer ids {ids} are invalid for a target with {n_layers} layers (valid: "
                f"0..{n_layers - 1})"
            )
        self.aux_layer_ids = ids
        self.shape = modeling.LayerShape.from_config(target_config)
        self.vocab_size = int(target_config.vocab_size)
        self.mask_token_id: int | None = None

    # ------------------------------------------------------------------------------------------------ description
    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(aux_layers=tuple(self.aux_layer_ids), final_hidden=self.final_hidden)

    def module(self) -> nn.Module:
        return self.model

    @property
    def depth(self) -> int:
        return self.block_depth(self.options.block_size)

    @property
    def vllm_speculative_tokens(self) -> range:
        """The draft tokens per step vLLM can serve this drafter at: a full block's only. vLLM's proposers run a block
        of as many slots as the tokens asked (DFlash's K + 1, ``num_query_per_req = 1 + num_speculative_tokens``;
        DSpark's ``sample_from_anchor`` K) and cannot be told to run the full block and keep K, as ``propose`` does;
        the block is bidirectional, so a shorter one is a network this drafter was never trained as (GPU-path review
        item 3). The export records the bound, and vLLM serving refuses fewer."""
        return range(self.depth, self.depth + 1)

    # ---------------------------------------------------------------------------------------------------- training
    def check_training(self, depth: int, mask_builder: str, partitioner: str) -> None:
        # element (a, d) is predicting slot d of a block: a deeper grid has no slot to train
        if depth > self.depth:
            raise UsageError(f"{self.name} trains at most {self.depth_text} = {self.depth} depths (its "
                             f"{self.depth_slots}), got --depth {depth}")

    def forwarded_rows(self, elements: int, anchors: int) -> int:
        # every slot of each anchor's block runs through the layers (the anchor token and all block_size - 1 masks:
        # the block attends to itself bidirectionally), however few of its depths the grid trains
        return anchors * self.options.block_size

    def target_layers(self, num_layers: int) -> list[int]:
        """API 15: none of the target's body (``share_target`` reads its embedding and lm_head only)."""
        return []

    def prepare(self, target: Any, examples: Any) -> None:
        """Take the target's embedding and lm_head (frozen, shared) and pick the mask token (``share_target``)."""
        self.mask_token_id = share_target(self.model, target, examples)

    def supervision(self, example: Any) -> torch.Tensor:
        # position i reads x_{i+1} with g_i and is charged with x_{i+2}: the EAGLE indexing, so the EAGLE rule
        return shifted_supervision(example.loss_mask, example.doc)

    @staticmethod
    def trained_elements(example: Any, sup: torch.Tensor, anchor: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """Which charged elements (a, d) the loss trains, as the reference samplers choose them (``trained_elements``:
        a block anchored on a supervised token whose first target is supervised, up to its first unsupervised slot);
        the others stay charged with weight 0."""
        return trained_elements(example.loss_mask, sup, anchor, depth)

    def element_weights(self, example: Any, elements: ElementSet) -> torch.Tensor:
        """Each element's weight in the loss and the engine's normaliser (API 14): the depth decay on the trained
        elements, 0 on the others (``element_weights``), so a step's loss is SpecForge's and DeepSpec's
        ``sum(w * terms) / sum(w)`` over the trained slots."""
        return element_weights(example.loss_mask, self.supervision(example), elements.anchor, elements.depth,
                               self.options.loss_decay_gamma)

    def charged(self, example: Any, elements: ElementSet, segment: Any) -> tuple[int, torch.Tensor, ChargedBlocks]:
        """(the grid's depth k, the supervision, the segment's ``charged_blocks``) at the start of ``loss``, the depth
        checked against the block's."""
        k = elements.max_depth
        if k > self.depth:
            raise UsageError(f"{self.name}: element depth {k} exceeds {self.depth_text} = {self.depth}")
        sup = self.supervision(example)
        return k, sup, charged_blocks(elements, segment, sup)

    # --------------------------------------------------------------------------------------------------- inference
    def _reset_inference(self) -> None:
        super()._reset_inference()
        self._context = BlockContext(self.model)

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
            raise SpecframeError(
                f"{directory} was trained with aux layers {info.get('aux_layer_ids')}, this drafter has "
                f"{self.aux_layer_ids}"
            )

    def restore_checkpoint(self, info: dict[str, Any]) -> None:
        self.mask_token_id = info["mask_token_id"]

    def check_import(self, imported: Any, ours: dict[str, Any], theirs: dict[str, Any]) -> None:
        """Refuse a folder (``import_weights``'s) of another layout, or whose layers, aux layers, block size or the
        further fields ``ours`` / ``theirs`` name differ from this drafter's."""
        where = f"cannot import {imported.directory}"
        if imported.layout != self.name:
            raise SpecframeError(f"{where}: it holds a {imported.layout} drafter, not {self.name}")
        ours = {"layers": self.options.layers, "aux_layer_ids": list(self.aux_layer_ids),
                "block_size": self.options.block_size, **ours}
        theirs = {"layers": imported.num_layers, "aux_layer_ids": list(imported.aux_layer_ids),
                  "block_size": imported.config.get("block_size"), **theirs}
        for key, value in ours.items():
            if theirs[key] != value:
                raise SpecframeError(f"{where}: its {key} is {theirs[key]!r}, this {self.name} drafter's is {value!r} "
                                     f"(set drafter.{key} to match)")

    def load_import(self, imported: Any) -> None:
        """Load a checked folder's block state dict and its mask token. A folder without ``embed_tokens`` /
        ``lm_head`` shares the target's: the reader fills them from the target's files, else (``--init-from``, a
        prepared drafter) they are this drafter's own, which are the target's."""
        state = imported.block_state(self.model.state_dict(), own_shared_are_target=self.mask_token_id is not None)
        self.model.load_state_dict(state)
        self.mask_token_id = imported.mask_token_id

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The state dict ``export_vllm`` writes (it already carries vLLM's names), after refusing a drafter with no
        mask token or with aux layers vLLM cannot serve."""
        if self.mask_token_id is None:
            raise SpecframeError(f"{self.name}: no mask token chosen (train the drafter or load a checkpoint first)")
        ids = self.aux_layer_ids
        if len(set(ids)) != len(ids):
            # vLLM collects each target layer's hidden state once, so a repeated id leaves the drafter short of inputs
            raise SpecframeError(
                f"{self.name}: aux layers {ids} repeat a target layer, which vLLM cannot serve (it collects each layer "
                f"once); a {self.target_config.num_hidden_layers}-layer target is too shallow for the default spacing "
                f"of {self.options.layers} draft layers: train with distinct drafter.aux_layer_ids"
            )
        return {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
