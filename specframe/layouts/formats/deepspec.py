"""The ``deepspec`` format: a DSpark drafter as deepseek-ai/DeepSpec's trainer saves it
(``Qwen3DSparkModel.save_pretrained``, ``deepspec/modeling/dspark/qwen3``): the target's config with the draft fields (``num_hidden_layers`` the draft
layers, ``block_size``, ``mask_token_id``, ``target_layer_ids``, ``markov_rank``, ``markov_head_type``,
``enable_confidence_head``, ``confidence_head_with_markov``) and no ``speculators_config``; the weights carry the
names vLLM's ``Qwen3DSparkModel`` took from it (``fc``, ``hidden_norm``, ``layers.N.*``, ``norm``,
``embed_tokens``, ``lm_head``, ``markov_head.markov_w1`` / ``markov_w2``, ``confidence_head.proj``). DeepSpec's
layer id k is the output of target layer k (``hidden_states[k + 1]``, -1 the embeddings), specframe's aux id k + 1;
its anchor is the first prediction slot, as specframe's DSpark. Its RNN head (``markov_head.joint_proj``) is
specframe's, name for name; its gated Markov head has no specframe counterpart and is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specframe.errors import SpecframeError
from specframe.layouts.block import dspark_parts
from specframe.layouts.formats.base import Format, load_weights, read_json, recurrence
from specframe.layouts.imported import Imported
from specframe.values import is_int

#: DeepSpec's DSpark drafter (``deepspec/modeling/dspark/qwen3/modeling.py``), saved by transformers' save_pretrained
DEEPSPEC_DSPARK_ARCHITECTURE = "Qwen3DSparkModel"


def _read(directory: Path, target_config: Any) -> Imported:
    """DeepSpec's DSpark folder (module docstring) as the ``dspark`` layout, checked as a speculators ``dspark``
    export is (``block.dspark_parts``: every weight vLLM's model loads, shaped by the config)."""
    cfg = read_json(directory)
    ids = cfg.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(is_int(i) for i in ids):
        raise SpecframeError("config.json lacks target_layer_ids (the target layers DeepSpec's DSpark reads)")
    if min(ids) < -1:  # DeepSpec's validate_target_layer_ids: -1 (the embeddings) or a layer's output
        raise SpecframeError(f"target_layer_ids {ids} name no target layer output (DeepSpec's ids are >= -1)")
    rank = cfg.get("markov_rank")
    if not is_int(rank, 1):
        raise SpecframeError(f"markov_rank is {rank!r}: a DeepSpec drafter without a Markov head is its DFlash, and "
                             "specframe's dspark always has one")
    head = cfg.get("markov_head_type", "vanilla")
    if head not in ("vanilla", "rnn"):
        raise SpecframeError(f"markov_head_type is {head!r}: specframe's dspark computes DeepSpec's vanilla and RNN "
                             "Markov heads only (the gated head's weights have no counterpart)")
    if cfg.get("sample_from_anchor") is False or cfg.get("dspark_bonus_anchor"):
        raise SpecframeError("the drafter predicts from the mask slots only (a bonus-anchor block); specframe's DSpark "
                             "predicts from the anchor slot (block_size draft tokens)")
    skipped = ("architectures", "auto_map", "model_type", "target_layer_ids", "tie_word_embeddings")
    flat = {k: v for k, v in cfg.items() if k not in skipped}
    flat.update(
        aux_hidden_state_layer_ids=[int(i) + 1 for i in ids], target_hidden_size=int(cfg["hidden_size"]),
        draft_vocab_size=int(cfg["vocab_size"]), markov_head_type=head, sample_from_anchor=True,
        enable_confidence_head=bool(cfg.get("enable_confidence_head", False)),
        confidence_head_with_markov=bool(cfg.get("enable_confidence_head", False)
                                         and cfg.get("confidence_head_with_markov", False)),
    )
    tensors = load_weights(directory)
    layers = None if target_config is None else int(target_config.num_hidden_layers)
    recurrent = recurrence(tensors, head, rank, int(cfg["hidden_size"]))
    tensors = dspark_parts(tensors, {**flat, "markov_head_type": "vanilla"}, layers)
    return Imported(directory, "deepspec", "dspark", flat, {**tensors, **recurrent}, None, None)



# a speculators dspark folder (the same architecture) is the speculators format's, which is tried first
DEEPSPEC = Format("deepspec", lambda cfg: DEEPSPEC_DSPARK_ARCHITECTURE in (cfg.get("architectures") or []), _read,
                  sign=f"architecture {DEEPSPEC_DSPARK_ARCHITECTURE}")
