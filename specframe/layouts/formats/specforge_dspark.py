"""The ``specforge-dspark`` format: a DSpark drafter as sgl-project/SpecForge saves it (``specforge.export.to_hf``:
``DSparkDraftModel.save_pretrained``, ``specforge/modeling/draft/dspark.py`` on ``dflash.py``'s backbone): a Qwen3
config (``architectures`` ``DSparkDraftModel``; the first release wrote ``DFlashDraftModel`` with
``projector_type`` ``dspark``) with top-level ``block_size``, ``num_target_layers`` and ``draft_vocab_size`` (the
target's vocabulary) and the DSpark fields in ``dflash_config``: ``mask_token_id``, ``target_layer_ids``,
``projector_type``, ``attention_mode``, ``markov_rank``, ``markov_head_type``, ``enable_confidence_head`` (default:
``confidence_head_alpha`` > 0), ``confidence_head_with_markov`` (default false); an unmerged port (TorchSpec's) kept
the head fields at the top level, read when ``dflash_config`` lacks them. Weights: ``fc``, ``hidden_norm``,
``layers.N.*``, ``norm``, ``markov_head.markov_w1`` / ``markov_w2`` (the RNN head's ``markov_head.joint_proj``),
``confidence_head.proj``, no ``embed_tokens`` / ``lm_head`` (the target's are used) and no ``d2t`` / ``t2d``; heads
saved under ``logit_head.`` (SpecForge loads such early checkpoints) are renamed. Its layer id k is target layer
k's output (``hidden_states[k + 1]``; SGLang captures before layer k + 1), specframe's aux id k + 1; absent, the
ids are SpecForge's default for ``num_target_layers``. Its training anchor is the first prediction slot, as
specframe's DSpark. The gated Markov head, a drafter without a Markov head, attention other than GQA / MHA and a
config without ``mask_token_id`` are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specframe.errors import SpecframeError
from specframe.layouts.block import dspark_parts
from specframe.layouts.checks import require_ints
from specframe.layouts.formats.base import Format, load_weights, read_json, recurrence
from specframe.layouts.imported import Imported
from specframe.values import is_int, is_number

#: SpecForge's DSpark drafter (``specforge/modeling/draft/dspark.py``), saved by ``specforge.export.to_hf``
SPECFORGE_DSPARK_ARCHITECTURE = "DSparkDraftModel"
#: SpecForge's DFlash drafter, which carried DSpark (``dflash_config.projector_type`` ``dspark``) in its first release
SPECFORGE_DFLASH_ARCHITECTURE = "DFlashDraftModel"


def _recognise(cfg: Mapping[str, Any]) -> bool:
    """SpecForge's DSpark config: a ``DSparkDraftModel``, or (its first release) a ``DFlashDraftModel`` whose
    ``dflash_config.projector_type`` is ``dspark``; a SpecForge DFlash or Domino folder is neither."""
    architectures = cfg.get("architectures") or []
    if SPECFORGE_DSPARK_ARCHITECTURE in architectures:
        return True
    method = cfg.get("dflash_config")
    return (SPECFORGE_DFLASH_ARCHITECTURE in architectures and isinstance(method, dict)
            and method.get("projector_type") == "dspark")


def layer_ids(target_layers: int, draft_layers: int) -> list[int]:
    """The target layer ids SpecForge's DFlash backbone reads when its config names none (``build_target_layer_ids``
    in ``specforge/modeling/draft/dflash.py``): the middle layer for one draft layer, else one per draft layer spread
    evenly over layer outputs 1 .. L - 3, rounded by Python's round (half to even)."""
    if draft_layers == 1:
        return [target_layers // 2]
    step = (target_layers - 4) / (draft_layers - 1)
    return [round(1 + i * step) for i in range(draft_layers)]


# SpecForge's DSpark head fields: in dflash_config (SpecForge's main line), at the top level (the unmerged TorchSpec port)
_HEAD_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                          "confidence_head_alpha")


def _read(directory: Path, target_config: Any) -> Imported:
    """SpecForge's DSpark folder (module docstring) as the ``dspark`` layout: its ``dflash_config`` mapped onto the
    fields the speculators ``dspark`` layout carries, then checked as that export is (``block.dspark_parts``)."""
    cfg = read_json(directory)
    method = cfg.get("dflash_config") or {}
    if not isinstance(method, dict):
        raise SpecframeError(f"dflash_config is {method!r}, not the table of SpecForge's DFlash / DSpark fields")
    hidden, vocab, layers = require_ints(cfg, "hidden_size", "vocab_size", "num_hidden_layers")

    def head_field(name: str, default: Any) -> Any:
        if name in method and name in cfg and method[name] != cfg[name]:
            raise SpecframeError(f"dflash_config.{name} is {method[name]!r} and the top-level {name} is {cfg[name]!r}: "
                                 "SpecForge's DSpark reads the first, the TorchSpec port the second")
        return method[name] if name in method else cfg.get(name, default)

    projector = method.get("projector_type", "dspark")
    if projector != "dspark":
        raise SpecframeError(f"dflash_config.projector_type is {projector!r}: SpecForge's DSparkDraftModel requires "
                             "'dspark'")
    modes = method.get("attention_modes", [method.get("attention_mode", "gqa")])
    bad = [m for m in (modes if isinstance(modes, list | tuple) else [modes]) if str(m).lower() not in ("gqa", "mha")]
    if bad:
        raise SpecframeError(f"dflash_config attention mode {bad[0]!r}: specframe's DSpark layers are GQA / MHA "
                             "attention, as SpecForge's DSpark (its DFlash backbone's other modes have no counterpart)")
    rank = head_field("markov_rank", 0)
    if not is_int(rank, 1):
        raise SpecframeError(f"markov_rank is {rank!r}: a SpecForge DSpark drafter without a Markov head (markov_rank "
                             "0, its default) has no counterpart; specframe's dspark always has one")
    head = str(head_field("markov_head_type", "vanilla")).lower()
    if head not in ("vanilla", "rnn"):
        raise SpecframeError(f"markov_head_type is {head!r}: specframe's dspark computes SpecForge's vanilla and RNN "
                             "Markov heads only (the gated head's markov_head.gate_proj has no counterpart)")
    alpha = head_field("confidence_head_alpha", 0.0) or 0.0
    if not is_number(alpha):
        raise SpecframeError(f"confidence_head_alpha is {alpha!r}, not a number")
    enable = head_field("enable_confidence_head", None)
    enable = bool(alpha > 0.0 if enable is None else enable)  # SpecForge's default: the head exists when weighted
    with_markov = enable and bool(head_field("confidence_head_with_markov", False))
    mask = method.get("mask_token_id")
    if mask is None:
        raise SpecframeError(
            "config.json records no dflash_config.mask_token_id: SpecForge resolves the mask token when training "
            "starts and exports the draft config it was given, so the token its mask slots were trained on is not in "
            "the folder; add \"mask_token_id\": <the id it trained with> to dflash_config")
    block = cfg.get("block_size")
    if not is_int(block, 1):
        raise SpecframeError(f"block_size is {block!r}: SpecForge's DSpark config carries its block size there")
    n_target = cfg.get("num_target_layers")
    if target_config is not None and isinstance(n_target, int) and n_target != int(target_config.num_hidden_layers):
        raise SpecframeError(f"num_target_layers {n_target} differs from the target's {target_config.num_hidden_layers} "
                             "layers (the folder was trained for another target)")
    ids = method.get("target_layer_ids")
    if ids is None:
        if not is_int(n_target):
            raise SpecframeError("config.json has neither dflash_config.target_layer_ids nor num_target_layers (the "
                                 "target layers SpecForge's DSpark reads)")
        ids = layer_ids(n_target, layers)
    if not isinstance(ids, list) or not ids or not all(is_int(i, 0) for i in ids):
        raise SpecframeError(f"dflash_config.target_layer_ids is {ids!r}, not a list of target layer outputs (>= 0)")
    tensors = load_weights(directory)
    maps = sorted(k for k in tensors if k in ("d2t", "t2d"))
    if maps:
        raise SpecframeError(f"tensor {maps[0]!r}: SpecForge's DSpark drafts over the target's whole vocabulary with "
                             "its lm_head, and specframe's dspark has no draft vocabulary to map")
    for name in [k for k in tensors if k.startswith(("logit_head.markov_head.", "logit_head.confidence_head."))]:
        tensors.setdefault(name[len("logit_head."):], tensors.pop(name))  # as SpecForge loads them: direct names win
    skipped = ("architectures", "auto_map", "model_type", "dflash_config", "tie_word_embeddings", "num_target_layers",
               *_HEAD_FIELDS)
    flat = {k: v for k, v in cfg.items() if k not in skipped}
    flat.update(
        aux_hidden_state_layer_ids=[i + 1 for i in ids], target_hidden_size=hidden, draft_vocab_size=vocab,
        mask_token_id=mask, markov_rank=rank, markov_head_type=head, sample_from_anchor=True,
        enable_confidence_head=enable, confidence_head_with_markov=with_markov,
    )
    recurrent = recurrence(tensors, head, rank, hidden)
    target_layers = None if target_config is None else int(target_config.num_hidden_layers)
    tensors = dspark_parts(tensors, {**flat, "markov_head_type": "vanilla"}, target_layers)
    return Imported(directory, "specforge-dspark", "dspark", flat, {**tensors, **recurrent}, None, None)


SPECFORGE_DSPARK = Format("specforge-dspark", _recognise, _read, sign=(
    f"architecture {SPECFORGE_DSPARK_ARCHITECTURE}, or {SPECFORGE_DFLASH_ARCHITECTURE} with projector_type dspark"))
