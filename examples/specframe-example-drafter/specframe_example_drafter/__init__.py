"""The ``skipgram`` drafter: an example of a third-party specframe plugin.

It needs no target features. For element (a, d) it predicts data token x_{a+d+1} from token x_a alone, with one output
table per depth, so one forward drafts a whole chain. It is deliberately tiny; what it shows is the plugin contract:
an ``api.Drafter`` subclass with an attrs ``Options`` class, registered through the ``register_drafters`` hook.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from specframe import api


@attrs.define
class SkipgramOptions:
    """Skipgram settings (the ``[drafter_options]`` table of ``specframe train --config``)."""

    dim: int = attrs.field(default=64, metadata={"help": "width of the token embedding and the depth tables"})
    max_depth: int = attrs.field(default=8, metadata={
        "help": "depth tables: the deepest training depth and tokens per draft it supports"})


class SkipgramModel(torch.nn.Module):
    def __init__(self, vocab_size: int, dim: int, max_depth: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, dim)
        self.heads = torch.nn.Parameter(torch.randn(max_depth, dim, vocab_size) * dim**-0.5)

    def forward(self, tokens: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)  # [N, dim]
        return torch.einsum("nd,ndv->nv", h, self.heads[depth])


class SkipgramDrafter(api.Drafter):
    name = "skipgram"
    Options = SkipgramOptions
    parallel = True

    # What the core reads instead of option names (API 6): the depth tables are the default training depth and K,
    # and an equal-depth comparison sets max_depth (the full grid, no COD; no draft vocabulary to set).
    @classmethod
    def training(cls, options: SkipgramOptions) -> api.Training:
        return api.Training(depth=options.max_depth, k=options.max_depth)

    @classmethod
    def comparison_options(cls, depth: int, draft_vocab_size: int, k: int) -> dict:
        return {"max_depth": depth}

    def __init__(self, target_config, options=None) -> None:
        super().__init__(target_config, options)
        self.model = SkipgramModel(target_config.vocab_size, self.options.dim, self.options.max_depth)
        self._last: int | None = None

    def feature_spec(self) -> api.FeatureSpec:
        return api.FeatureSpec(aux_layers=None, final_hidden=False)

    def module(self) -> torch.nn.Module:
        return self.model

    def layer_shapes(self) -> tuple:
        # API 9: what the memory estimate charges activations for. An embedding and a table per depth: no decoder
        # layers (a drafter built from api.modeling.DecoderLayer s needs no declaration: they are found)
        return ()

    # Drafter position i holds data token x_i and predicts x_{i+1} at depth 0, so the loss bit of element (a, d)
    # is the data loss mask at a + d + 1.
    def supervision(self, example: api.TrainingExample) -> torch.Tensor:
        return example.loss_mask[1:].clone()

    def loss(self, example, elements, segment, attention) -> api.LossTerms:
        sub = elements.subset(segment.elements)
        # charged: this segment's elements whose reference position carries a loss
        charged = segment.loss_mask & self.supervision(example)[sub.position]
        anchor, depth = sub.anchor[charged], sub.depth[charged]
        if len(depth) and int(depth.max()) >= self.options.max_depth:
            raise api.UsageError(
                f"the skipgram drafter has {self.options.max_depth} depth tables; training depth "
                f"{elements.max_depth} needs the option max_depth >= {elements.max_depth}"
            )
        logits = self.model(example.input_ids[anchor], depth)
        labels = example.input_ids[anchor + depth + 1]
        losses = F.cross_entropy(logits, labels, reduction="none")
        k = elements.max_depth
        hits = (logits.argmax(-1) == labels).long()
        correct = torch.zeros(k, dtype=torch.long).index_add_(0, depth, hits)
        total = torch.zeros(k, dtype=torch.long).index_add_(0, depth, torch.ones_like(hits))
        return api.LossTerms(losses.sum(), int(charged.sum()), correct, total)

    def start(self, prompt_ids: torch.Tensor, features) -> None:
        self._last = int(prompt_ids[-1])

    @torch.no_grad()
    def propose(self, k: int, generator: torch.Generator | None = None) -> api.Draft:
        k = min(k, self.options.max_depth)
        depth = torch.arange(k)
        tokens = torch.full((k,), self._last, dtype=torch.long)
        return api.Draft(self.model(tokens, depth).argmax(-1))

    def accept(self, emitted: torch.Tensor, features) -> None:
        self._last = int(emitted[-1])


@api.hookimpl
def register_drafters(register):
    register(SkipgramDrafter)
