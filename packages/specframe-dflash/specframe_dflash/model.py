"""The DFlash draft network: Qwen3-style decoder layers whose keys and values are the target's context plus the block.

Names follow vLLM's ``DFlashQwen3Model`` (``fc``, ``hidden_norm``, ``layers.i.self_attn.{q,k,v,o}_proj``,
``q_norm`` / ``k_norm``, ``mlp``, ``norm``), so the export is a rename-free copy of the state dict.

Context: the target's aux hidden states at a position, concatenated, go through ``fc`` and ``hidden_norm`` once; every
layer projects that one state to its own k (with ``k_norm`` and RoPE at the context position) and v. The context never
runs through a layer: this is what lets vLLM write it straight into each layer's KV cache, and what makes a block's
prediction depend on the target's features only, never on another block.

Block: the anchor token and the mask tokens, embedded with the (frozen) target embedding, run through the layers;
each layer's queries attend to [context keys | block keys] through the ``attention`` callable (the mask builder's,
which applies the block visibility rule in training; plain full attention at inference, where one block sees all of
the context).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from specframe import api

modeling = api.modeling
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """RMSNorm computed in at least fp32 (bf16 / fp16 in fp32, as vLLM's kernel; float64 stays float64, so the
    exactness tests compare in double precision rather than at fp32's)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DFlashAttention(nn.Module):
    def __init__(self, shape) -> None:
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
            k, v = api.expand_kv(k[None], self.shape.heads)[0], api.expand_kv(v[None], self.shape.heads)[0]
        out = attention(q[None], k[None], v[None])[0]  # [heads, N, head_dim]
        return self.o_proj(out.transpose(0, 1).reshape(x.shape[0], -1))


class DFlashLayer(nn.Module):
    def __init__(self, shape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden, shape.eps)
        self.self_attn = DFlashAttention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.eps)
        self.mlp = modeling.MLP(shape)

    def forward(self, h, cos, sin, context_kv, attention) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context_kv, attention)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(nn.Module):
    def __init__(self, shape, vocab_size: int, n_aux: int, layers: int, target_hidden: int) -> None:
        super().__init__()
        self.shape = shape
        self.fc = nn.Linear(n_aux * target_hidden, shape.hidden, bias=False)
        self.hidden_norm = RMSNorm(shape.hidden, shape.eps)
        self.layers = nn.ModuleList(DFlashLayer(shape) for _ in range(layers))
        self.norm = RMSNorm(shape.hidden, shape.eps)
        # the target's embedding and lm_head, frozen (DFlash shares them with the target; kept here so a checkpoint
        # and its export are complete without the target's weights)
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
