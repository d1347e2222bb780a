"""The PARD layout: a plain causal LM (``LlamaForCausalLM`` names: ``model.embed_tokens.weight``,
``model.layers.{i}.*``, ``model.norm.weight``, ``lm_head.weight``) whose config has ``pard_token``, written by
``write_pard`` and served by vLLM as ``{"method": "draft_model", "parallel_drafting": true}``. vLLM 0.32 has no
speculators type for it, so it needs the target and an explicit ``speculative_config``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from specframe import __version__
from specframe.layouts.checks import check_layer_count, check_shape, require_ints, tensors as cpu_tensors, token_id
from specframe.layouts.manifest import PROVENANCE, Manifest, Serving
from specframe.layouts.speculators import set_dtype
from specframe.layouts.table import Layout, register_layout
from specframe.layouts.writing import write


def write_pard(
    directory: str | os.PathLike,
    weights: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any],
    pard_token: int,
    tokenizer: Any = None,
    drafter: str | None = "pard",
    serving: Serving | None = None,
) -> Manifest:
    """Write a PARD drafter for ``{"method": "draft_model", "parallel_drafting": true}``: a plain causal LM
    (``LlamaForCausalLM`` names unless ``config["architectures"]`` says otherwise) whose config carries
    ``pard_token``, the mask token its parallel slots read. ``config["vocab_size"]`` must be the target's.
    ``serving`` is taken for every writer's signature and records nothing: vLLM takes the target and the number of
    draft tokens from its command line for this layout."""
    cfg = dict(config)
    cfg.setdefault("architectures", ["LlamaForCausalLM"])
    cfg.setdefault("model_type", "llama")
    set_dtype(cfg)
    tensors = cpu_tensors(weights)
    pard_parts(tensors, cfg, pard_token)
    cfg[PROVENANCE] = {"drafter": drafter, "version": __version__}
    return write(directory, tensors, cfg, tokenizer, serving)


def pard_parts(tensors: dict[str, torch.Tensor], cfg: dict[str, Any], pard_token: Any) -> None:
    """Check a PARD causal LM's tensors (a Llama one's shapes) and its ``pard_token`` (set in ``cfg``)."""
    vocab, hidden, layers = require_ints(cfg, "vocab_size", "hidden_size", "num_hidden_layers")
    if cfg.get("architectures") == ["LlamaForCausalLM"]:
        check_shape(tensors, "model.embed_tokens.weight", (vocab, hidden))
        check_shape(tensors, "model.norm.weight", (hidden,))
        if cfg.get("tie_word_embeddings"):
            tensors.pop("lm_head.weight", None)
        else:
            check_shape(tensors, "lm_head.weight", (vocab, hidden))
        check_layer_count(tensors, "model.layers.", layers)
    cfg["pard_token"] = token_id("pard_token", pard_token, vocab)


def _check_pard(tensors: dict, cfg: Mapping[str, Any], target_num_layers: int | None) -> tuple[dict, dict]:
    flat = {k: v for k, v in cfg.items() if k != PROVENANCE}
    pard_parts(tensors, flat, flat.get("pard_token"))
    return tensors, flat


PARD = register_layout(Layout(
    name="pard", method="draft_model", parallel_drafting=True, check=_check_pard,
    # any causal LM with pard_token, unless a more specific layout (ParallelSpec's config has one too) claims it
    recognise=lambda cfg: "pard_token" in cfg, fallback=True, aux_hidden_states=False,
    mask_token_key="pard_token",
))
