"""The ParallelSpec layout: an EAGLE backbone plus one learned mask embedding per draft slot, written by
``write_parallelspec`` as a flat Llama config with architecture ``ParallelSpecLlamaForCausalLMEagle3`` (specframe's
vLLM general plugin model, ``specframe.vllm.vllm_plugin``), served by vLLM's eagle3 method with
``parallel_drafting`` beside the target (no speculators type exists for it), at most ``masks + 1`` draft tokens.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from specframe import __version__
from specframe.errors import SpecframeError
from specframe.layouts.checks import require_ints, token_id
from specframe.layouts.eagle3 import FIXED_FLAGS, eagle3_parts, eagle_backbone
from specframe.layouts.manifest import PARALLELSPEC_ARCHITECTURE, PROVENANCE, Manifest, Serving
from specframe.layouts.table import Layout, Limits, register_layout
from specframe.layouts.writing import write


def write_parallelspec(
    directory: str | os.PathLike,
    weights: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any],
    aux_layer_ids: Sequence[int],
    target_hidden_size: int,
    mask_token_ids: Sequence[int],
    target_num_layers: int | None = None,
    tokenizer: Any = None,
    drafter: str | None = "parallelspec",
    serving: Serving | None = None,
) -> Manifest:
    """Write a ParallelSpec drafter (EAGLE backbone) for vLLM's eagle3 method with ``parallel_drafting``, served by
    specframe's vLLM general plugin model ``ParallelSpecLlamaForCausalLMEagle3`` (``specframe.vllm.vllm_plugin``):
    ``write_eagle3``'s tensors plus ``mask_embeddings`` [masks, H] (slot d's own [MASK]_d embedding), a flat Llama
    config with that architecture, ``pard_token`` (the id vLLM feeds every mask slot: ``mask_token_ids[0]``) and
    ``parallelspec_num_masks``. vLLM needs the target beside it and an explicit ``speculative_config`` (no
    speculators type exists for it); at most ``masks + 1`` draft tokens. ``serving`` records nothing, as
    ``write_pard``'s."""
    weights = dict(weights)
    masks = weights.pop("mask_embeddings", None)
    tensors, cfg = eagle3_parts(weights, config, aux_layer_ids, target_hidden_size, target_num_layers)
    parallelspec_parts(tensors, cfg, masks, mask_token_ids)
    cfg.update(architectures=[PARALLELSPEC_ARCHITECTURE], model_type="llama", tie_word_embeddings=False, **FIXED_FLAGS)
    cfg[PROVENANCE] = {"drafter": drafter, "version": __version__}
    return write(directory, tensors, cfg, tokenizer, serving)


def parallelspec_parts(
    tensors: dict[str, torch.Tensor], cfg: dict[str, Any], masks: torch.Tensor | None, mask_token_ids: Sequence[int]
) -> None:
    """Check the mask embeddings (one row per mask token id) and set ParallelSpec's fields in ``cfg``."""
    hidden, vocab = require_ints(cfg, "hidden_size", "vocab_size")
    ids = [token_id("mask token id", i, vocab) for i in mask_token_ids]
    if masks is None:
        raise SpecframeError("a ParallelSpec export needs 'mask_embeddings' ([masks, H], one row per draft slot)")
    if masks.dim() != 2 or masks.shape[1] != hidden or masks.shape[0] != len(ids) or not ids:
        raise SpecframeError(
            f"mask_embeddings has shape {list(masks.shape)}, expected [{len(ids)}, {hidden}] (one row per mask token id)"
        )
    tensors["mask_embeddings"] = masks.detach().cpu().contiguous()
    width = len(cfg["eagle_aux_hidden_state_layer_ids"]) * int(cfg["target_hidden_size"])
    # vLLM's parallel drafting requires mask_hidden; the plugin model replaces it by the anchor's hidden state
    tensors.setdefault("mask_hidden", torch.zeros(1, 1, width))
    cfg.update(pard_token=ids[0], parallelspec_mask_token_ids=ids, parallelspec_num_masks=len(ids))


def _check_parallelspec(tensors: dict, cfg: Mapping[str, Any], target_num_layers: int | None) -> tuple[dict, dict]:
    flat = {k: v for k, v in cfg.items() if k not in (PROVENANCE, "architectures", "model_type", *FIXED_FLAGS)}
    masks = tensors.pop("mask_embeddings", None)
    tensors, flat = eagle_backbone(tensors, flat, target_num_layers)
    parallelspec_parts(tensors, flat, masks, list(flat.get("parallelspec_mask_token_ids") or []))
    return tensors, flat


def _limits(cfg: Mapping[str, Any], provenance: Mapping[str, Any]) -> Limits:
    masks = cfg.get("parallelspec_num_masks")
    return (int(masks) + 1 if isinstance(masks, int) else None), None, None


PARALLELSPEC = register_layout(Layout(
    name="parallelspec", method="eagle3", parallel_drafting=True, check=_check_parallelspec,
    recognise=lambda cfg: PARALLELSPEC_ARCHITECTURE in (cfg.get("architectures") or []),
    limits=_limits, over_limit="its mask tokens + 1",
))
