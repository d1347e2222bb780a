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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from specframe.drafting import modeling, vocab
from specframe.drafting.elements import ElementSet

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = ["BlockAttention", "BlockContext", "BlockLayer", "BlockModel", "ChargedBlocks", "RMSNorm", "block_hidden",
           "charged_blocks", "default_aux_layers", "element_weights", "full_attention", "position_docs",
           "share_target", "trained_elements"]


def default_aux_layers(num_layers: int, draft_layers: int) -> list[int]:
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


def position_docs(elements: ElementSet) -> torch.Tensor:
    """Document of each drafter position, from the depth-0 elements (every position has one, COD or not)."""
    doc = torch.full((elements.seq_len,), -1, dtype=torch.long)
    roots = elements.depth == 0
    doc[elements.anchor[roots]] = elements.doc[roots]
    return doc


def block_hidden(model: BlockModel, aux: torch.Tensor, input_ids: torch.Tensor, elements: ElementSet,
                 blocks: torch.Tensor, slots: int, mask_token_id: int, attention: Any) -> torch.Tensor:
    """Hidden states [len(blocks) * slots, H] of the blocks anchored at drafter positions ``blocks`` (sorted,
    unique), slot s of block i at row i * slots + s, as training runs them.

    The attention is expressed as element sets under the block rule (context = depth 0 at its own position; block
    slot s = depth s + 1) and asked of the segment's mask builder (``attention.subset``), so the configured builder's
    memory behaviour carries over; a block sees the context of its own document at positions <= its anchor, and
    itself. ``aux`` [L, n_aux * H_target]: the target's aux hidden states of the sequence, in the model's dtype."""
    device = model.fc.weight.device
    doc_of = position_docs(elements)
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
