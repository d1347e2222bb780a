"""Llama-style decoder layers over element sets: the trunk of the EAGLE-family drafters (and the shapes, norm and
rotary embedding the block drafters' layers share). Plugins reach it as ``api.modeling``, which re-exports it.

A layer's attention is not a causal mask but an ``api.Attention`` callable from a mask builder, so the same layer
trains on any (anchor, depth) element set and, with a KV cache, drafts at inference. Rotary embeddings are applied
at each element's position (anchor + depth). Parameter names follow the Llama / vLLM ``llama_eagle3`` layout
(``self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm`` ...) so export is a renaming-free copy.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat grouped-query k / v heads [B, kv_heads, N, D] up to ``heads`` (``api.expand_kv``)."""
    rep = heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)
