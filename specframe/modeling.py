"""Building blocks shared by the EAGLE-family drafters: Llama-style decoder layers over element sets.

A layer's attention is not a causal mask but an ``api.Attention`` callable from a mask builder, so the same layer
trains on any (anchor, depth) element set and, with a KV cache, drafts at inference. Rotary embeddings are applied
at each element's position (anchor + depth). Parameter names follow the Llama / vLLM ``llama_eagle3`` layout
(``self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm`` ...) so export is a renaming-free copy.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from specframe.target_head import TargetHead, as_target_head

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: the engine's phase timer while ``specframe train --profile`` runs (``specframe.engine.profile``), else None: the
#: loss kernels below time themselves as the "loss" phase
phase_timer: Callable[[str], Any] | None = None


def _phase(name: str) -> Any:
    return phase_timer(name) if phase_timer is not None else contextlib.nullcontext()


@attrs.frozen
class LayerShape:
    """Sizes of one Llama decoder layer, its activation and its rotary embedding (taken from the target's config unless
    a drafter overrides them).

    ``rope`` is the target's ``rope_parameters`` as canonical JSON (frozen, so a shape stays hashable): the rotary
    frequencies come from transformers' own RoPE functions for its ``rope_type`` (default, linear, dynamic, yarn,
    llama3, ...), and the export copies the same parameters into the drafter's config, so a drafter is served with the
    frequencies it was trained with by construction.
    """

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float = 1e-5
    rope_theta: float = 10000.0
    rope: str = ""
    max_positions: int = 2048
    act: str = "silu"

    @classmethod
    def from_config(cls, cfg: Any) -> LayerShape:
        heads = int(cfg.num_attention_heads)
        hidden = int(cfg.hidden_size)
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        return cls(
            hidden=hidden,
            heads=heads,
            kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            intermediate=int(cfg.intermediate_size),
            eps=float(getattr(cfg, "rms_norm_eps", 1e-5)),
            rope_theta=rope_theta(cfg),
            rope=json.dumps(rope_parameters(cfg), sort_keys=True),
            max_positions=int(getattr(cfg, "max_position_embeddings", None) or 2048),
            act=str(getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None) or "silu"),
        )

    def rope_parameters(self) -> dict[str, Any]:
        params = json.loads(self.rope) if self.rope else {}
        params.setdefault("rope_type", "default")
        params["rope_theta"] = self.rope_theta
        return params

    def config_fields(self) -> dict[str, Any]:
        """These sizes under their transformers / vLLM config names (what checkpoints and exports record)."""
        return {
            "hidden_size": self.hidden,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate,
            "rms_norm_eps": self.eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": self.rope_parameters(),
            "max_position_embeddings": self.max_positions,
            "hidden_act": self.act,
        }


def rope_theta(cfg: Any) -> float:
    """The rotary base of a transformers config (v5 keeps it in ``rope_parameters``, v4 on the config)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(cfg, "rope_theta", None) or 10000.0)


def rope_parameters(cfg: Any) -> dict[str, Any]:
    """The target's RoPE parameters (``rope_type`` and its scaling fields; v4's ``rope_scaling`` too)."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    params = dict(params) if isinstance(params, dict) else {}
    if "type" in params and "rope_type" not in params:  # the v4 spelling
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params["rope_theta"] = rope_theta(cfg)
    return params


@functools.lru_cache(maxsize=16)
def _rotary_embedding(shape: LayerShape) -> nn.Module:
    """transformers' rotary embedding layer for ``shape`` (its RoPE init functions do every ``rope_type``)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate,
        max_position_embeddings=shape.max_positions,
        rope_parameters=shape.rope_parameters(),
    )
    return LlamaRotaryEmbedding(config)


class RMSNorm(nn.Module):
    """RMSNorm computed in at least fp32 (bf16 / fp16 in fp32, as vLLM's kernel; float64 stays float64, so the
    exactness tests compare in double precision rather than at fp32's). The one RMSNorm of the EAGLE family's layers
    and the block drafters' (``api.block.RMSNorm`` is this class)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(position: torch.Tensor, shape: LayerShape, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [N, head_dim] at integer positions, in the Llama (rotate-half) layout, with the target's RoPE type
    (including its attention scaling, e.g. YaRN's)."""
    rope = _rotary_embedding(shape)
    probe = torch.empty(0, dtype=torch.float32, device=position.device)
    cos, sin = rope(probe, position.to(torch.long)[None])
    return cos[0].to(dtype), sin[0].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


KV = tuple[torch.Tensor, torch.Tensor]


class SelfAttention(nn.Module):
    """Grouped-query attention whose masking is delegated to an ``Attention`` callable, in two steps so a
    ``DecoderLayer`` can run the position-wise one in row chunks: ``project`` (q, k, v) and ``attend``.

    ``past`` (k, v) [B, kv_heads, M, D] are prepended to this call's keys (inference KV cache); the call returns the
    new (k, v) so the caller decides which of them to keep.
    """

    def __init__(self, shape: LayerShape, in_features: int, qk_norm: bool = False) -> None:
        super().__init__()
        self.shape = shape
        d = shape.head_dim
        self.q_proj = nn.Linear(in_features, shape.heads * d, bias=False)
        self.k_proj = nn.Linear(in_features, shape.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(in_features, shape.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(shape.heads * d, shape.hidden, bias=False)
        # Qwen3's attention (transformers' Qwen3Attention, vLLM's Qwen3 layers, speculators' default P-EAGLE layer):
        # one RMSNorm over each head's q and k, shared by the heads, before the rotary embedding
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(d, shape.eps)
            self.k_norm = RMSNorm(d, shape.eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotated q [B, heads, N, D] and k, v [B, kv_heads, N, D] of ``x`` [B, N, in] (position-wise)."""
        b, n, _ = x.shape
        s = self.shape
        q = self.q_proj(x).view(b, n, s.heads, s.head_dim)
        k = self.k_proj(x).view(b, n, s.kv_heads, s.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: Attention, past: KV | None = None
    ) -> tuple[torch.Tensor, KV]:
        """The attention output [B, N, heads * D] (before o_proj) and this call's new (k, v)."""
        b, _, n, _ = q.shape
        s = self.shape
        new = (k, v)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        device = q.device.type
        if torch.is_autocast_enabled(device):
            # rotary tables in fp32 promote q and k back to fp32 while v stays in the autocast dtype; a mask
            # builder's fused kernels want one dtype
            dtype = torch.get_autocast_dtype(device)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        rep = s.heads // s.kv_heads
        if rep > 1 and not getattr(attention, "grouped_kv", False):
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = attention(q, k, v)
        return out.transpose(1, 2).reshape(b, n, s.heads * s.head_dim), new


class MLP(nn.Module):
    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden, shape.intermediate, bias=False)
        self.up_proj = nn.Linear(shape.hidden, shape.intermediate, bias=False)
        self.down_proj = nn.Linear(shape.intermediate, shape.hidden, bias=False)
        # the target's activation (SiLU for Llama / Qwen, tanh-GELU for Gemma), as the export records it
        from transformers.activations import ACT2FN

        self.act = ACT2FN[shape.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm Llama decoder layer. With ``eagle_input=True`` it is EAGLE-3's first layer: its attention reads
    cat(input_layernorm(embedding), hidden_norm(hidden)) (2H wide) and its residual stream starts from ``hidden``
    (``norm_before_residual=False``) or from hidden_norm(hidden) (``norm_before_residual=True``, speculators' trainer
    default; vLLM's ``_norm_before_residual``). ``qk_norm``: Qwen3's per-head RMSNorm on q and k (``SelfAttention``)."""

    def __init__(self, shape: LayerShape, eagle_input: bool = False, *, norm_before_residual: bool = False,
                 qk_norm: bool = False) -> None:
        super().__init__()
        self.eagle_input = eagle_input
        self.norm_before_residual = bool(norm_before_residual)
        self.input_layernorm = RMSNorm(shape.hidden, shape.eps)
        if eagle_input:
            self.hidden_norm = RMSNorm(shape.hidden, shape.eps)
        self.self_attn = SelfAttention(shape, shape.hidden * (2 if eagle_input else 1), qk_norm=qk_norm)
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.eps)
        self.mlp = MLP(shape)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: Attention,
        embeds: torch.Tensor | None = None,
        past: KV | None = None,
        row_chunk: int | None = None,
    ) -> tuple[torch.Tensor, KV]:
        """``row_chunk`` (under autograd): run the position-wise parts (norms, q/k/v, o_proj, MLP) in row chunks,
        each recomputed in backward, so only the attention's inputs and output stay alive for all rows."""
        size = row_chunk if row_chunk and torch.is_grad_enabled() else None
        q, k, v = _by_rows(size, self._project, hidden, embeds, cos, sin)
        attn, kv = self.self_attn.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention, past)
        (hidden,) = _by_rows(size, self._finish, hidden, attn)
        return hidden, kv

    def _project(self, hidden, embeds, cos, sin):
        if self.eagle_input:
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        else:
            x = self.input_layernorm(hidden)
        # token-major [B, N, heads, D], so row chunks concatenate along dim 1
        return tuple(t.transpose(1, 2) for t in self.self_attn.project(x, cos, sin))

    def _finish(self, hidden, attn):
        if self.eagle_input and self.norm_before_residual:
            # recomputed rather than carried from _project, so the row-chunked path keeps only q, k, v alive
            hidden = self.hidden_norm(hidden)
        hidden = hidden + self.self_attn.o_proj(attn)
        return (hidden + self.mlp(self.post_attention_layernorm(hidden)),)


def _by_rows(size: int | None, fn, *tensors):
    """``fn`` (position-wise) over row chunks of [B, N, ...] tensors (``cos`` / ``sin``: [N, D]), each chunk under
    activation checkpointing; ``None`` (or N within one chunk) runs it once on all rows."""
    n = next(t.shape[1] for t in tensors if t is not None and t.dim() >= 3)
    if size is None or n <= size:  # one chunk: nothing to save by recomputing it
        return fn(*tensors)
    parts = []
    for start in range(0, n, size):
        piece = [None if t is None else (t[start : start + size] if t.dim() == 2 else t[:, start : start + size])
                 for t in tensors]
        parts.append(checkpoint(fn, *piece, use_reentrant=False))
    return tuple(torch.cat(outs, dim=1) for outs in zip(*parts))


#: rows per chunk of a checkpointed layer's position-wise parts
ROW_CHUNK = 4096


def run_layers(
    layers: nn.ModuleList,
    hidden: torch.Tensor,
    embeds: torch.Tensor,
    position: torch.Tensor,
    shape: LayerShape,
    attention: Attention,
    past: list[KV] | None = None,
    checkpointing: bool = False,
) -> tuple[torch.Tensor, list[KV]]:
    """Run the layers over one element block; ``checkpointing`` recomputes each layer in backward (activation
    memory O(one layer) instead of O(all layers)), and inside the layer being recomputed the position-wise parts in
    row chunks (only q, k, v and the attention output are held for every row). Returns the last hidden state and
    each layer's new (k, v)."""
    cos, sin = rotary(position, shape, hidden.dtype)
    kvs: list[KV] = []
    for i, layer in enumerate(layers):
        extra = embeds if layer.eagle_input else None
        layer_past = past[i] if past is not None else None
        if checkpointing and torch.is_grad_enabled():
            hidden, kv = checkpoint(layer, hidden, cos, sin, attention, extra, layer_past, ROW_CHUNK,
                                    use_reentrant=False)
        else:
            hidden, kv = layer(hidden, cos, sin, attention, extra, layer_past)
        kvs.append(kv)
    return hidden, kvs


def causal_attention(offset: int, window: int | None = None) -> Attention:
    """Plain causal attention for a block of queries that follow ``offset`` cached keys (inference); key j sits at
    position j. ``window`` W: a query at position p sees keys at positions p - W + 1 .. p only (itself and the W - 1
    before it), as vLLM's and speculators' sliding-window layers attend."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        nq, nk = q.shape[2], k.shape[2]
        qpos = torch.arange(nq, device=q.device)[:, None] + offset
        kpos = torch.arange(nk, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask = mask & (kpos > qpos - window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


@attrs.frozen
class TopKTeacher:
    """A compact teacher in place of ``target_hidden``: the target's top-k next-token ids over its whole vocabulary
    (``ids`` [P, k], best first) and their log-probabilities (``logp`` [P, k]) per position, as a feature cache stores
    them (``specframe prepare --teacher-top-k``). ``to_draft`` [V] maps a target id to its draft-vocabulary id, -1
    outside; ``draft_size`` is Vd. The teacher over the draft vocabulary is the top-k entries inside it, renormalised:
    exact when the target's draft-vocabulary mass lies in its top k (with k = V it equals the dense teacher). A
    position with no top-k entry inside the draft vocabulary teaches nothing. ``position_mask`` and
    ``reference_top1`` receive the positions' full-vocabulary top-1 ids (``ids[:, 0]``) instead of hidden rows."""

    ids: torch.Tensor
    logp: torch.Tensor
    to_draft: torch.Tensor
    draft_size: int

    @property
    def device(self) -> torch.device:
        return self.ids.device

    def __getitem__(self, rows: Any) -> TopKTeacher:
        return TopKTeacher(self.ids[rows], self.logp[rows], self.to_draft, self.draft_size)


@attrs.frozen
class KLResult:
    loss_sum: torch.Tensor
    correct: torch.Tensor  # bool [N]: draft top-1 equals the reference top-1
    dropped: int = 0  # rows ``position_mask`` left out of the loss


def chunked_forward_kl(
    hidden: torch.Tensor,
    head: torch.Tensor,
    target_hidden: torch.Tensor,
    target_head: TargetHead | torch.Tensor | None,
    reference_top1: Callable[[torch.Tensor], torch.Tensor] | None = None,
    chunk: int = 256,
    position_mask: Callable[[torch.Tensor], torch.Tensor] | None = None,
    target_index: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
    ce_weight: float = 0.0,
) -> KLResult:
    """Sum over rows of KL(p_target || q_draft) over the draft vocabulary, in row chunks.

    ``hidden`` [N, H] are the drafter's normalised final states and ``head`` [Vd, H] its lm_head; the target
    distribution is softmax(target_head.logits(target_hidden)) with ``target_head`` the target's head
    (``specframe.target_head.TargetHead``: lm_head, bias, logit scale, soft-capping) restricted to the draft
    vocabulary's rows; a bare [Vd, H] weight is taken as a head that is only the matmul. ``target_index`` [N]
    (optional): ``target_hidden`` then holds one row per *position* and row i is taught by
    ``target_hidden[target_index[i]]``. The teacher (its log-probabilities, ``position_mask`` and
    ``reference_top1``) is computed once per distinct position, in blocks of ``chunk`` positions, and shared by every
    row that reads it: the target's distribution at a position is the same for every depth that predicts it, and a
    parallel drafter has up to K rows per position. Without ``target_index`` every row has a teacher row of its own.
    ``row_weight`` [N] (optional) scales each row's term (EAGLE-3's per-depth weights, in one call for all depths).

    The gradient of a row's KL with respect to its draft logits is w (q sum(p) - p) (log-softmax's backward), so it
    is formed right in the forward chunk by chunk and only the gradients of ``hidden`` [N, H] and ``head`` [Vd, H] are
    kept for backward: no chunk's logits are recomputed and no teacher is held across the step. Memory is
    O(N x H + Vd x H), plus O(chunk x Vd) while a chunk is being worked on.
    ``target_hidden`` may instead be a ``TopKTeacher`` (``target_head`` then unused): the cache's compact teacher,
    so the target's head never runs.
    ``reference_top1(target_hidden_rows)`` gives the draft-vocabulary id a hit must match (default: the target's
    argmax within the draft vocabulary); rows where it returns -1 can never be hit.
    ``position_mask(target_hidden_rows)`` (bool per row) keeps only the rows it marks in the loss, as the EAGLE-3 and
    P-EAGLE reference trainers do with ``t2d[target argmax]``: a row whose target top-1 lies outside the draft
    vocabulary contributes nothing (its hit verdict is still reported); ``dropped`` counts the rows left out.
    ``ce_weight`` w in [0, 1] mixes in hard cross-entropy: each row's term is (1 - w) KL + w CE, the CE label being
    the teacher's own argmax over the draft vocabulary (the target's greedy token as the renormalised teacher ranks
    it, not the data token); w = 1 is plain CE against that argmax. The teacher p is replaced by
    (1 - w) p + w onehot(argmax), whose gradient q sum(p) - p the same loop forms (a position whose teacher has no
    mass in the draft vocabulary, possible with a top-k teacher, keeps teaching nothing).
    """
    n = hidden.shape[0]
    if not 0.0 <= ce_weight <= 1.0:
        raise ValueError(f"ce_weight must be in [0, 1], got {ce_weight!r}")
    if n == 0:
        return KLResult(hidden.new_zeros(()) + 0.0 * head.sum(), torch.zeros(0, dtype=torch.bool))
    with _phase("loss"):
        teacher = _PositionTeacher(target_hidden, target_head, target_index, n, chunk, reference_top1, position_mask,
                                   ce_weight)
        return _kl(hidden, head, teacher, chunk, row_weight)


class _PositionTeacher:
    """The target's side of the KL: the rows grouped by the position that teaches them, and per block of ``chunk``
    positions its log-probabilities over the draft vocabulary, keep mask and reference top-1."""

    def __init__(self, target_hidden, target_head, target_index, n, chunk, reference_top1, position_mask,
                 ce_weight: float = 0.0) -> None:
        self.target_hidden = target_hidden
        self.ce_weight = float(ce_weight)
        self.target_head = None if target_head is None else as_target_head(target_head)
        self.reference_top1, self.position_mask = reference_top1, position_mask
        device = target_hidden.device
        if target_index is None:  # one teacher row per row, in order
            self.positions = None
            self.inverse = torch.arange(n, device=device)
            self.order = self.inverse
            count = n
        else:
            self.positions, self.inverse = torch.unique(target_index.to(device), return_inverse=True)
            # rows sorted by their teacher (stable: the rows of one position keep their order)
            self.order = torch.argsort(self.inverse, stable=True)
            count = int(self.positions.numel())
        starts = torch.arange(0, count, chunk, device=device)
        # first sorted row of each block of positions, and the end
        sorted_inverse = self.inverse[self.order]
        self.row_bounds = [*torch.searchsorted(sorted_inverse, starts).tolist(), n]
        self.blocks = [(int(s), min(int(s) + chunk, count)) for s in starts.tolist()]

    @torch.no_grad()
    def block(self, b: int) -> tuple[torch.Tensor, ...]:
        """Block ``b``'s teacher probabilities p [positions, Vd], sum(p log p) and sum(p) per position, keep mask
        (None: keep all) and reference top-1: what every row the position teaches needs, computed once."""
        lo, hi = self.blocks[b]
        th = self.target_hidden[lo:hi] if self.positions is None else self.target_hidden[self.positions[lo:hi]]
        if isinstance(th, TopKTeacher):
            return self._mix(*self._top_k_block(th))
        t_logp = torch.log_softmax(self.target_head.logits(th).float(), dim=-1)
        p = t_logp.exp()
        plogp = (p * t_logp).sum(-1)
        keep = self.position_mask(th).to(torch.bool) if self.position_mask is not None else None
        ref = self.reference_top1(th) if self.reference_top1 is not None else t_logp.argmax(-1)
        return self._mix(p, plogp, p.sum(-1), keep, ref)

    def _mix(self, p, plogp, psum, keep, ref) -> tuple[torch.Tensor, ...]:
        """(1 - w) KL + w CE as one teacher: p -> (1 - w) p + w onehot(argmax p); the one-hot has no entropy, so
        sum(p log p) scales by (1 - w) and the KL loop's value and gradient are the mix's."""
        w = self.ce_weight
        if w == 0.0:
            return p, plogp, psum, keep, ref
        has = (psum > 0).to(p.dtype)
        onehot = torch.zeros_like(p).scatter_(1, p.argmax(-1, keepdim=True), has[:, None])
        return (1.0 - w) * p + w * onehot, (1.0 - w) * plogp, (1.0 - w) * psum + w * has, keep, ref

    def _top_k_block(self, t: TopKTeacher) -> tuple[torch.Tensor, ...]:
        ids = t.ids.long()
        draft = t.to_draft[ids]
        inside = draft >= 0
        mass = torch.where(inside, t.logp.float().exp(), 0.0)
        total = mass.sum(-1, keepdim=True)
        p = torch.zeros(ids.shape[0], t.draft_size, dtype=torch.float32, device=ids.device)
        # entries outside the draft vocabulary carry zero mass: adding it at id 0 changes nothing
        p.scatter_add_(1, draft.clamp(min=0), mass / total.clamp(min=torch.finfo(torch.float32).tiny))
        plogp = torch.where(p > 0, p * p.clamp(min=torch.finfo(torch.float32).tiny).log(), 0.0).sum(-1)
        top1 = ids[:, 0]
        keep = self.position_mask(top1).to(torch.bool) if self.position_mask is not None else None
        ref = self.reference_top1(top1) if self.reference_top1 is not None else p.argmax(-1)
        return p, plogp, p.sum(-1), keep, ref


class _PrecomputedGrad(torch.autograd.Function):
    """``loss`` whose gradients with respect to ``hidden`` and ``head`` were formed in the forward: backward only
    scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, head, loss, grad_hidden, grad_head):
        ctx.save_for_backward(grad_hidden, grad_head)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        grad_hidden, grad_head = ctx.saved_tensors
        scale = (lambda g: None if g is None else (g * grad).to(g.dtype))
        return scale(grad_hidden), scale(grad_head), None, None, None


def _kl(hidden: torch.Tensor, head: torch.Tensor, teacher: _PositionTeacher, chunk: int,
        row_weight: torch.Tensor | None) -> KLResult:
    n = hidden.shape[0]
    grad_on = torch.is_grad_enabled()
    need_h = grad_on and hidden.requires_grad
    need_head = grad_on and head.requires_grad
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    correct = torch.zeros(n, dtype=torch.bool, device=hidden.device)
    dropped = 0
    grad_h = torch.zeros_like(hidden) if need_h else None
    grad_head = torch.zeros(head.shape, dtype=torch.float32, device=head.device) if need_head else None
    with torch.no_grad():
        for b in range(len(teacher.blocks)):
            p_block, plogp_block, psum_block, keep_block, ref_block = teacher.block(b)
            lo = teacher.blocks[b][0]
            for start in range(teacher.row_bounds[b], teacher.row_bounds[b + 1], chunk):
                rows = teacher.order[start : min(start + chunk, teacher.row_bounds[b + 1])]
                local = teacher.inverse[rows] - lo
                p = p_block[local]
                h = hidden[rows]
                # under autocast the matmul runs in the autocast dtype, as ``h @ head.T`` did under autograd
                z = h @ head.T
                # the [rows, Vd] work is elementwise passes over memory: logq and then q are made in place, and
                # KL = sum p log p - sum p log q takes the first sum from the teacher's block
                logq = z.float()
                logq = logq.sub_(torch.logsumexp(logq, dim=-1, keepdim=True))
                kl = plogp_block[local] - torch.linalg.vecdot(p, logq)
                weight = None
                if keep_block is not None:
                    keep = keep_block[local]
                    dropped += int((~keep).sum())
                    weight = keep.to(kl.dtype)
                if row_weight is not None:
                    w = row_weight[rows].to(kl.dtype)
                    weight = w if weight is None else weight * w
                loss += kl.sum() if weight is None else (kl * weight).sum()
                correct[rows] = logq.argmax(-1) == ref_block[local]
                if need_h or need_head:
                    # d KL / d z = w (q sum(p) - p); subnormal entries are zeroed (see flush_subnormal)
                    g = logq.exp_().mul_(psum_block[local, None]).sub_(p)
                    if weight is not None:
                        g = g.mul_(weight[:, None])
                    gd = _grad_dtype(z.dtype)
                    g = flush_subnormal(g.to(gd))
                    with _no_autocast(z.device):
                        if need_h:
                            grad_h[rows] = (g @ head.to(gd)).to(hidden.dtype)
                        if need_head:
                            grad_head += (g.T @ h.to(gd)).float()
    if need_h or need_head:
        loss = _PrecomputedGrad.apply(hidden, head, loss, grad_h,
                                      None if grad_head is None else grad_head.to(head.dtype))
    return KLResult(loss, correct, dropped)


def chunked_cross_entropy(
    hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, chunk: int = 256,
    row_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over rows of the hard cross-entropy of softmax(hidden @ head.T) at ``labels`` (each row times
    ``row_weight``, when given), and each row's top-1 hit, in row chunks. As in ``chunked_forward_kl`` the logits'
    gradient (q - onehot) is formed in the forward, so each chunk's logits are computed once, not again in backward,
    and no [N, V] tensor is ever alive: memory O(N x H + V x H), O(chunk x V) per chunk. Softmax runs in at least
    fp32 (float64 stays float64, for the exactness tests)."""
    n = hidden.shape[0]
    if n == 0:
        return hidden.sum() * 0.0 + head.sum() * 0.0, torch.zeros(0, dtype=torch.bool)
    with _phase("loss"):
        return _cross_entropy(hidden, head, labels, chunk, row_weight)


def _cross_entropy(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, chunk: int,
                   row_weight: torch.Tensor | None):
    grad_on = torch.is_grad_enabled()
    need_h, need_head = grad_on and hidden.requires_grad, grad_on and head.requires_grad
    wide = torch.promote_types(torch.promote_types(hidden.dtype, head.dtype), torch.float32)
    loss = torch.zeros((), dtype=wide, device=hidden.device)
    hits = []
    grad_h = torch.zeros_like(hidden) if need_h else None
    grad_head = torch.zeros(head.shape, dtype=wide, device=head.device) if need_head else None
    with torch.no_grad():
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start : start + chunk], labels[start : start + chunk]
            z = h @ head.T
            logq = z.to(wide)  # log-softmax in place: the [rows, V] passes over memory are most of this loop
            logq = logq.sub_(torch.logsumexp(logq, dim=-1, keepdim=True))
            nll = -logq.gather(1, y[:, None])[:, 0]
            w = None if row_weight is None else row_weight[start : start + chunk].to(device=z.device, dtype=wide)
            loss += nll.sum() if w is None else (nll * w).sum()
            hits.append(logq.argmax(-1) == y)
            if need_h or need_head:
                g = logq.exp_()
                g[torch.arange(len(y), device=g.device), y] -= 1.0
                if w is not None:
                    g = g.mul_(w[:, None])
                gd = _grad_dtype(z.dtype)
                g = flush_subnormal(g.to(gd))
                with _no_autocast(z.device):
                    if need_h:
                        grad_h[start : start + chunk] = (g @ head.to(gd)).to(hidden.dtype)
                    if need_head:
                        grad_head += (g.T @ h.to(gd)).to(wide)
    if need_h or need_head:
        loss = _PrecomputedGrad.apply(hidden, head, loss, grad_h,
                                      None if grad_head is None else grad_head.to(head.dtype))
    return loss, torch.cat(hits)


def _grad_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """The dtype the chunked losses form the logits' gradient and its two matmuls in: the logits' own, except fp16.

    The gradient is formed in the forward, before the GradScaler's loss scale reaches it (``_PrecomputedGrad`` applies
    the incoming, scaled gradient afterwards), and fp16's smallest normal is 6.1e-5: over a 32K draft vocabulary a
    near-uniform q is ~3e-5, so in fp16 almost every push-down entry would be flushed to zero and the hidden state's
    gradient would become -E_p[head] in place of E_q[head] - E_p[head]. float32 holds it (bf16 has float32's range).
    """
    return torch.float32 if logits_dtype == torch.float16 else logits_dtype


def _no_autocast(device: torch.device):
    # the gradient's matmuls run in the dtype _grad_dtype chose: fp16 autocast would cast them back to fp16 (under
    # bf16 autocast the operands are bf16 already, so nothing changes)
    return torch.autocast(device.type, enabled=False)


def flush_subnormal(x: torch.Tensor) -> torch.Tensor:
    """``x`` with entries whose magnitude is below its dtype's smallest normal number set to zero.

    Applied to the logits' gradient (q - p over the draft vocabulary): once either distribution is peaked (a gap of
    ~87 nats in float32) most entries are subnormal, and the two matmuls that consume it ran about 200x slower on x86
    CPUs (microcode assists; ``torch.set_flush_denormal`` only reaches the calling thread, not the OpenMP workers).
    Entries below the smallest normal number move the gradient by less than that number times a weight, so zeroing
    them changes nothing a float can hold.
    """
    if not x.is_floating_point():
        return x
    # hardshrink: one pass and one output, no mask or abs() temporaries of the [chunk, Vd] size
    return F.hardshrink(x, torch.finfo(x.dtype).tiny)


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat grouped-query k / v heads [B, kv_heads, N, D] up to ``heads`` (``api.expand_kv``)."""
    rep = heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)
