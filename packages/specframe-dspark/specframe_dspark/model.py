"""DSpark's network: the block backbone (``api.block.BlockModel``) plus the sequential stage's heads (the Markov
head's low-rank transition or the RNN head's gated state) and the confidence head, with vLLM's names."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from specframe import api

from .options import DSparkOptions

#: the std of every Linear / Embedding at the start (transformers' initializer_range, DeepSpec's Qwen3 config)
INIT_STD = api.block.INIT_STD


class MarkovHead(nn.Module):
    """The vanilla head: bias = markov_w2(markov_w1[x_prev]) (names as vLLM's ``DSparkMarkovHead``)."""

    def __init__(self, vocab: int, rank: int, hidden: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def latents(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced latents [B, S, r] of blocks whose slot s follows ``prev[:, s]``; the bias is w2(latent)."""
        return self.markov_w1(prev)

    def step(self, state: Any, prev: torch.Tensor, hidden: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """One drafting step: (new state, latent) for the slot with backbone state ``hidden`` after token ``prev``."""
        return state, self.markov_w1(prev)


class RNNHead(MarkovHead):
    """The RNN head (DeepSpec's ``RNNHead``): a gated state s_k = g s_{k-1} + (1 - g) c over the block, from
    [s_{k-1}; W1[x_{k-1}]; h_k] through one joint projection to (gate, candidate, output); latent tanh(output)."""

    def __init__(self, vocab: int, rank: int, hidden: int) -> None:
        super().__init__(vocab, rank, hidden)
        self.rank = rank
        self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def step(self, state, prev, hidden):
        if state is None:
            state = hidden.new_zeros(*hidden.shape[:-1], self.rank)
        gate, cand, out = self.joint_proj(torch.cat([state, self.markov_w1(prev), hidden], -1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(cand)
        return state, torch.tanh(out)

    def latents(self, prev, hidden):
        state, out = None, []
        for s in range(prev.shape[1]):
            state, latent = self.step(state, prev[:, s], hidden[:, s])
            out.append(latent)
        return torch.stack(out, 1)


class ConfidenceHead(nn.Module):
    """Linear logit of the acceptance probability (names as vLLM's ``DSparkConfidenceHead``: ``proj``, with bias)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkModel(api.block.BlockModel):
    """The DFlash block backbone (``api.block.BlockModel``, vLLM's names) plus ``markov_head`` and
    ``confidence_head`` (vLLM's ``Qwen3DSparkModel``)."""

    def __init__(self, shape, vocab_size: int, n_aux: int, options: DSparkOptions) -> None:
        super().__init__(shape, vocab_size, n_aux, options.layers, shape.hidden)
        cls = RNNHead if options.markov_head_type == "rnn" else MarkovHead
        self.markov_head = cls(vocab_size, options.markov_rank, shape.hidden)
        self.with_markov = options.confidence_head_with_markov
        self.confidence_head = None
        if options.confidence_head:
            self.confidence_head = ConfidenceHead(shape.hidden + (options.markov_rank if self.with_markov else 0))
        self.reference_init()

    @torch.no_grad()
    def reference_init(self) -> None:
        """DeepSpec's start (its drafter is a transformers ``PreTrainedModel``, ``post_init``; SpecForge and
        speculators alike), ``api.block.reference_init`` over every module: PyTorch's defaults would start
        ``markov_w1`` at N(0, 1), a random bias of about +-0.6 nats on every logit from the previous token. The
        embedding and lm_head draw too, then ``prepare`` copies the target's over them."""
        api.block.reference_init(self)

    def confidence_logit(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        feats = torch.cat([hidden, self.markov_head.embed(prev).to(hidden.dtype)], -1) if self.with_markov else hidden
        return self.confidence_head(feats)

