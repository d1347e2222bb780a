"""The block layouts: DFlash and DSpark, speculators ``dflash`` / ``dspark``, written by ``write_dflash`` /
``write_dspark`` for the ``specframe-dflash`` / ``specframe-dspark`` plugins. DSpark's layout is DFlash's plus its
heads, and its config is built on DFlash's, as vLLM's ``update_dspark`` calls ``update_dflash``.

DFlash (vLLM's ``update_dflash``): the speculators envelope with a Qwen3 ``transformer_layer_config`` (the DFlash
layers have per-head ``q_norm`` / ``k_norm``), and at the top ``draft_vocab_size``, ``target_hidden_size``,
``mask_token_id``, ``aux_hidden_state_layer_ids`` (specframe's aux ids: vLLM reads target layer output id - 1) and
``block_size``. Weights under vLLM's ``DFlashQwen3Model`` names: ``fc.weight`` [H, n_aux * H_target],
``hidden_norm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.{input,post_attention}_layernorm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, and ``embed_tokens.weight`` [vocab, H] and ``lm_head.weight`` [vocab, H] (specframe writes both;
without them vLLM shares the target's, and the importer reads the target's). vLLM serves it with method
``dflash`` (its own block drafting, no ``parallel_drafting`` flag) at ``block_size - 1`` tokens per step only: its
proposer runs a block of K + 1 slots, so fewer would be another network than the one trained (``Manifest.refusal``).

DSpark (vLLM's ``update_dspark``): the DFlash layout (the same backbone weights and layer config, architecture
``Qwen3DSparkModel``) plus ``markov_head.markov_w1.weight`` [vocab, rank], ``markov_head.markov_w2.weight``
[vocab, rank] and, with the confidence head, ``confidence_head.proj.weight`` [1, H (+ rank)] and
``confidence_head.proj.bias`` [1]; top-level ``markov_rank``, ``markov_head_type`` (vLLM builds the vanilla head
only), ``enable_confidence_head``, ``confidence_head_with_markov``, ``use_aux_hidden_state`` and
``sample_from_anchor`` true: the anchor slot is the first prediction, so a block of ``block_size`` slots drafts
``block_size`` tokens, and vLLM's DSpark speculator runs exactly K slots for K tokens, so it serves K = block_size
only (a shorter block is another network: bidirectional attention).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from specframe.errors import SpecframeError
from specframe.layouts.checks import (
    check_int,
    check_layer_count,
    check_layer_order,
    check_shape,
    is_int,
    require_ints,
    tensors as cpu_tensors,
    token_id,
)
from specframe.layouts.manifest import MIN_TOKENS, PROVENANCE, Manifest, Serving
from specframe.layouts.speculators import IDENTITY_KEYS, envelope, layer_config, with_target_hidden_size
from specframe.layouts.table import Layout, Limits, register_layout
from specframe.layouts.writing import write

# the top-level fields of a DFlash speculators config (vLLM's update_dflash reads them), beside its layer config
_DFLASH_FIELDS = ("draft_vocab_size", "target_hidden_size", "mask_token_id", "aux_hidden_state_layer_ids", "block_size")
# the top-level fields of a DSpark speculators config (vLLM's update_dspark reads them), beside its layer config
_DSPARK_FIELDS = _DFLASH_FIELDS + ("markov_rank", "markov_head_type", "enable_confidence_head",
                                   "confidence_head_with_markov", "use_aux_hidden_state", "sample_from_anchor")
#: the ``specframe`` entry's DSpark calibration fields (``write_dspark``), read back into the flat config
DSPARK_CALIBRATION = ("confidence_temperature", "confidence_calibration_rule")
#: vLLM 0.32's ``update_dspark`` reads an absent ``sample_from_anchor`` as false (a bonus-anchor block), as do the
#: speculators releases before its dspark default; every reader here takes that one default
DSPARK_SAMPLE_FROM_ANCHOR_DEFAULT = False


def dspark_samples_from_anchor(config: Mapping[str, Any]) -> bool:
    """Whether a DSpark config's anchor slot predicts (block_size draft tokens), as vLLM reads it."""
    return bool(config.get("sample_from_anchor", DSPARK_SAMPLE_FROM_ANCHOR_DEFAULT))


# ---------------------------------------------------------------------------------------------------------- DFlash


def write_dflash(
    directory: str | os.PathLike,
    weights: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any],
    aux_layer_ids: Sequence[int],
    target_hidden_size: int,
    mask_token_id: int,
    block_size: int,
    target_num_layers: int | None = None,
    tokenizer: Any = None,
    drafter: str | None = "dflash",
    verifier: str | None = None,
    speculative_tokens: int | None = None,
    verifier_architectures: Sequence[str] | None = None,
    min_speculative_tokens: int | None = None,
    serving: Serving | None = None,
) -> Manifest:
    """Write a DFlash drafter (speculators ``dflash``, module docstring): ``weights`` under vLLM's
    ``DFlashQwen3Model`` names, ``config`` the drafter's layer config (``llama_config`` of the target with
    ``num_hidden_layers`` = drafter layers: the sizes are the same, the Qwen3 model type is set here),
    ``aux_layer_ids`` specframe's aux ids (hidden state entering that target layer), ``mask_token_id`` the
    target-vocabulary id of the mask slots and ``block_size`` the anchor plus its mask slots. ``speculative_tokens``
    defaults to ``block_size - 1``, every mask slot. ``min_speculative_tokens``: the fewest tokens per step vLLM may
    serve it at, as the drafter declares (vLLM's proposer runs a block of K + 1 slots, so a drafter trained on full
    blocks serves only K = block_size - 1, the default); recorded in the export and refused below
    (``Manifest.refusal``). ``serving``: the user's verifier and draft tokens, as ``write_eagle3``'s."""
    check_int("block_size", block_size, 2,
              message=f"block_size must be an integer of at least 2 (an anchor and a mask), got {block_size!r}")
    low = block_size - 1 if min_speculative_tokens is None else min_speculative_tokens
    check_int("min_speculative_tokens", low, 1, block_size - 1,
              message=f"min_speculative_tokens must be in 1..block_size - 1 ({block_size - 1}), got {low!r}")
    tokens = block_size - 1 if speculative_tokens is None else speculative_tokens
    check_int("speculative_tokens", tokens, low, block_size - 1,
              message=f"speculative_tokens must be in {low}..block_size - 1 ({block_size - 1}) (the drafter serves no "
                      f"fewer than {low} in vLLM), got {tokens!r}")
    flat = _block_flat(config, target_hidden_size, mask_token_id, aux_layer_ids, block_size)
    tensors = dflash_parts(cpu_tensors(weights), flat, target_num_layers)
    full = _dflash_config(flat, verifier=verifier, speculative_tokens=tokens, drafter=drafter,
                          verifier_architectures=verifier_architectures)
    full[PROVENANCE][MIN_TOKENS] = low
    return write(directory, tensors, full, tokenizer, serving)


def _block_flat(config: Mapping[str, Any], target_hidden_size: int, mask_token_id: int, aux_layer_ids: Sequence[int],
                block_size: int) -> dict[str, Any]:
    """The flat config a block drafter's export (DFlash, DSpark) is checked and written from: the drafter's layer
    config without its model identity (the export sets Qwen3's), plus the block fields vLLM's ``update_dflash`` reads."""
    flat = {k: v for k, v in config.items() if k not in IDENTITY_KEYS}
    flat.update(
        draft_vocab_size=int(flat["vocab_size"]), target_hidden_size=int(target_hidden_size),
        mask_token_id=mask_token_id, aux_hidden_state_layer_ids=[int(i) for i in aux_layer_ids], block_size=block_size,
    )
    return flat


def _dflash_config(
    flat: Mapping[str, Any], *, verifier: str | None, speculative_tokens: int, drafter: str | None,
    verifier_architectures: Sequence[str] | None = None,
) -> dict[str, Any]:
    layer = {k: v for k, v in flat.items() if k not in _DFLASH_FIELDS}
    # Qwen3: vLLM builds DFlash layers from a Qwen3 config (per-head q_norm / k_norm); the sizes are the drafter's own
    layer.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=False)
    config = envelope("dflash", "DFlashDraftModel", layer, verifier=verifier, speculative_tokens=speculative_tokens,
                      drafter=drafter, verifier_architectures=verifier_architectures)
    config.update({k: flat[k] for k in _DFLASH_FIELDS if k in flat})
    return config


def _layer_flat(config: Mapping[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """A block layout's flat config: its layer config without the model identity, plus its top-level ``fields``."""
    flat = {k: v for k, v in layer_config(config).items() if k not in IDENTITY_KEYS}
    flat.update({k: config[k] for k in fields if config.get(k) is not None})
    return flat


def _dflash_flat(config: Mapping[str, Any]) -> dict[str, Any]:
    layer_config(config)
    if config.get("sample_from_anchor"):
        raise SpecframeError(
            "sample_from_anchor is true: the drafter also predicts from the anchor slot (block_size draft tokens); "
            "specframe's DFlash drafts from the mask slots only (sample_from_anchor = false, block_size - 1 tokens)")
    return with_target_hidden_size(_layer_flat(config, _DFLASH_FIELDS))


def dflash_parts(tensors: dict[str, torch.Tensor], cfg: Mapping[str, Any], target_num_layers: int | None,
                 min_aux: int = 1) -> dict:
    """Check a DFlash export's tensors against its flat config (every weight vLLM's DFlash model loads, shaped);
    ``min_aux``: the least aux id the layout's vLLM model reads (DSpark's reads 0, the embeddings)."""
    h, heads, kv, head_dim, inter, vocab, layers, h_t = require_ints(
        cfg, "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
        "vocab_size", "num_hidden_layers", "target_hidden_size")
    aux = cfg.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux:
        raise SpecframeError("config.json lacks aux_hidden_state_layer_ids (the target layers DFlash reads)")
    # vLLM reads target layer output id - 1 (update_dflash), so aux id 0 (the embeddings) has no DFlash meaning
    top = None if target_num_layers is None else target_num_layers - 1
    bad = [i for i in aux if not is_int(i, min_aux, top)]
    if bad:
        bound = f"{min_aux}..{target_num_layers - 1}" if target_num_layers is not None else f">= {min_aux}"
        raise SpecframeError(f"aux_hidden_state_layer_ids {bad} are not target layers DFlash can read ({bound})")
    check_layer_order(aux, "aux_hidden_state_layer_ids")
    token_id("mask_token_id", cfg.get("mask_token_id"), vocab)
    if int(cfg.get("draft_vocab_size", vocab)) != vocab:
        raise SpecframeError("a DFlash export drafts over the target's whole vocabulary (draft_vocab_size = vocab_size)")
    check_shape(tensors, "fc.weight", (h, len(aux) * h_t))
    for name, shape in (("hidden_norm.weight", (h,)), ("norm.weight", (h,))):
        check_shape(tensors, name, shape)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in tensors:  # absent: vLLM shares the target's (speculators' DFlash folders carry no embed_tokens)
            check_shape(tensors, name, (vocab, h))
    check_layer_count(tensors, "layers.", layers)
    for i in range(layers):
        p = f"layers.{i}."
        for name, shape in (
            ("self_attn.q_proj.weight", (heads * head_dim, h)), ("self_attn.k_proj.weight", (kv * head_dim, h)),
            ("self_attn.v_proj.weight", (kv * head_dim, h)), ("self_attn.o_proj.weight", (h, heads * head_dim)),
            ("self_attn.q_norm.weight", (head_dim,)), ("self_attn.k_norm.weight", (head_dim,)),
            ("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,)),
            ("mlp.gate_proj.weight", (inter, h)), ("mlp.up_proj.weight", (inter, h)), ("mlp.down_proj.weight", (h, inter)),
        ):
            check_shape(tensors, p + name, shape)
    extra = sorted(set(tensors) - {"fc.weight", "hidden_norm.weight", "norm.weight", "embed_tokens.weight",
                                   "lm_head.weight"} - {k for k in tensors if k.startswith("layers.")})
    if extra:
        raise SpecframeError(f"weights vLLM's DFlash model does not load: {', '.join(extra)}")
    return tensors


def _dflash_limits(cfg: Mapping[str, Any], provenance: Mapping[str, Any]) -> Limits:
    if not isinstance(cfg.get("block_size"), int):
        return None, None, None
    block = int(cfg["block_size"])
    limit = block - 1  # a block is the anchor token plus block_size - 1 mask slots
    # what the drafter that wrote the folder declared; a folder without it (speculators', z-lab's) was trained on full
    # blocks, as every DFlash trainer does
    declared = provenance.get(MIN_TOKENS)
    return limit, declared if is_int(declared) else limit, block


# ---------------------------------------------------------------------------------------------------------- DSpark


def write_dspark(
    directory: str | os.PathLike,
    weights: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any],
    aux_layer_ids: Sequence[int],
    target_hidden_size: int,
    mask_token_id: int,
    block_size: int,
    markov_rank: int,
    markov_head_type: str,
    enable_confidence_head: bool,
    confidence_head_with_markov: bool,
    target_num_layers: int | None = None,
    tokenizer: Any = None,
    drafter: str | None = "dspark",
    verifier: str | None = None,
    verifier_architectures: Sequence[str] | None = None,
    confidence_temperature: Sequence[float] | None = None,
    confidence_calibration_rule: str | None = None,
    serving: Serving | None = None,
) -> Manifest:
    """Write a DSpark drafter (speculators ``dspark``, module docstring): the DFlash backbone's weights under vLLM's
    names plus the Markov head (``markov_head.markov_w1`` / ``markov_w2``) and the confidence head
    (``confidence_head.proj``), ``config`` the drafter's layer config (as ``write_dflash``'s), ``block_size`` the
    slots of a block (the anchor and ``block_size - 1`` masks; every slot predicts, ``sample_from_anchor``), so it
    drafts ``block_size`` tokens per step, the only K vLLM serves it at. ``confidence_temperature`` (one per slot)
    and ``confidence_calibration_rule``: the confidence's fitted calibration and the verification it was fitted for,
    kept in the ``specframe`` entry (vLLM has no field for them: its adaptive verification reads the raw sigmoid)
    and read back by an import. ``serving``: the user's verifier and draft tokens, as ``write_eagle3``'s."""
    check_int("block_size", block_size, 1)
    if markov_head_type != "vanilla":
        # vLLM 0.32's Qwen3DSparkModel builds markov_w1 / markov_w2 only (no gate, no recurrent state), whatever
        # markov_head_type says: another head would load with its extra weights refused or be served as vanilla
        raise SpecframeError(f"vLLM serves the vanilla Markov head only (its Qwen3DSparkModel has markov_w1 / markov_w2 "
                             f"and nothing else); this drafter's head is {markov_head_type!r}")
    flat = _block_flat(config, target_hidden_size, mask_token_id, aux_layer_ids, block_size)
    flat.update(
        markov_rank=int(markov_rank), markov_head_type=markov_head_type,
        enable_confidence_head=bool(enable_confidence_head),
        confidence_head_with_markov=bool(enable_confidence_head and confidence_head_with_markov),
        use_aux_hidden_state=True, sample_from_anchor=True,
    )
    tensors = dspark_parts(cpu_tensors(weights), flat, target_num_layers)
    full = _dspark_config(flat, verifier=verifier, speculative_tokens=block_size, drafter=drafter,
                          verifier_architectures=verifier_architectures)
    full[PROVENANCE][MIN_TOKENS] = block_size
    if confidence_temperature is not None and enable_confidence_head:
        temperatures = [float(t) for t in confidence_temperature]
        if len(temperatures) != block_size or not all(0 < t < float("inf") for t in temperatures):
            raise SpecframeError(f"confidence_temperature {temperatures} is not {block_size} positive numbers")
        full[PROVENANCE].update(confidence_temperature=temperatures,
                                confidence_calibration_rule=confidence_calibration_rule)
    return write(directory, tensors, full, tokenizer, serving)


def _dspark_config(
    flat: Mapping[str, Any], *, verifier: str | None, speculative_tokens: int, drafter: str | None,
    verifier_architectures: Sequence[str] | None = None,
) -> dict[str, Any]:
    # the calibration a flat config read back carries (``_dspark_flat``) stays in the ``specframe`` entry: it is no
    # layer field (set_serving's round trip used to copy it into transformer_layer_config)
    config = _dflash_config({k: v for k, v in flat.items()
                             if (k not in _DSPARK_FIELDS or k in _DFLASH_FIELDS) and k not in DSPARK_CALIBRATION},
                            verifier=verifier, speculative_tokens=speculative_tokens, drafter=drafter,
                            verifier_architectures=verifier_architectures)
    # vLLM's update_dspark keeps this architecture (and defaults to it); there is no speculators class
    config["architectures"] = ["Qwen3DSparkModel"]
    config["speculators_model_type"] = "dspark"
    config["speculators_config"]["algorithm"] = "dspark"
    config.update({k: flat[k] for k in _DSPARK_FIELDS if k in flat})
    return config


def _dspark_flat(config: Mapping[str, Any]) -> dict[str, Any]:
    flat = _layer_flat(config, _DSPARK_FIELDS)
    provenance = config.get(PROVENANCE) if isinstance(config.get(PROVENANCE), dict) else {}
    flat.update({k: provenance[k] for k in DSPARK_CALIBRATION if provenance.get(k) is not None})
    return with_target_hidden_size(flat)


def dspark_parts(tensors: dict[str, torch.Tensor], cfg: Mapping[str, Any], target_num_layers: int | None) -> dict:
    """Check a DSpark export's tensors against its flat config: the DFlash backbone's, and the heads vLLM's
    ``Qwen3DSparkModel`` loads (shaped)."""
    h, vocab = require_ints(cfg, "hidden_size", "vocab_size")
    rank = require_ints(cfg, "markov_rank")[0]
    if rank < 1:
        raise SpecframeError(f"markov_rank must be positive (vLLM always builds the Markov head), got {rank}")
    if cfg.get("markov_head_type", "vanilla") != "vanilla":
        raise SpecframeError(f"markov_head_type is {cfg.get('markov_head_type')!r}; vLLM serves the vanilla head only")
    if not dspark_samples_from_anchor(cfg):
        said = "is false" if "sample_from_anchor" in cfg else "is absent, which vLLM reads as false"
        raise SpecframeError(f"sample_from_anchor {said} (a bonus-anchor block); specframe's DSpark predicts from "
                             "the anchor slot (sample_from_anchor = true, block_size draft tokens)")
    heads = {"markov_head.markov_w1.weight": (vocab, rank), "markov_head.markov_w2.weight": (vocab, rank)}
    if cfg.get("enable_confidence_head"):
        width = h + (rank if cfg.get("confidence_head_with_markov") else 0)
        heads.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    for name, shape in heads.items():
        check_shape(tensors, name, shape)
    backbone = {k: v for k, v in tensors.items() if k not in heads}
    extra = sorted(k for k in backbone if k.startswith(("markov_head.", "confidence_head.")))
    if extra:
        raise SpecframeError(f"weights vLLM's DSpark model does not load: {', '.join(extra)}")
    # vLLM's DSpark takes aux ids as they are (update_dspark -> eagle_aux_hidden_state_layer_ids, read first by
    # eagle3_utils.get_eagle3_aux_layers_from_config) and the target collects id 0 before its first layer
    # (qwen2.py): the embeddings, as specframe's features and DeepSpec's -1 mean it
    dflash_parts(backbone, cfg, target_num_layers, min_aux=0)
    return tensors


def _checked(flat_of: Callable[[Mapping[str, Any]], dict], parts: Callable[..., dict]):
    """A block layout's table check: its flat config (``flat_of`` the config.json), then ``parts``' tensor checks."""

    def check(tensors: dict, cfg: Mapping[str, Any], target_num_layers: int | None) -> tuple[dict, dict]:
        flat = flat_of(cfg)
        return parts(tensors, flat, target_num_layers), flat

    return check


def _dspark_limits(cfg: Mapping[str, Any], provenance: Mapping[str, Any]) -> Limits:
    if not isinstance(cfg.get("block_size"), int):
        return None, None, None
    block = int(cfg["block_size"])
    # sample_from_anchor: every slot predicts, block_size tokens; a bonus-anchor folder drafts block_size - 1
    limit = block if dspark_samples_from_anchor(cfg) else block - 1
    return limit, limit, block  # vLLM's DSpark speculator runs exactly the slots the K tokens need: full blocks only


DFLASH = register_layout(Layout(
    # vLLM's DFlash proposer drafts a block by itself: method dflash, without the parallel_drafting flag
    name="dflash", method="dflash", parallel_drafting=False, check=_checked(_dflash_flat, dflash_parts),
    speculators="DFlashDraftModel", config=_dflash_config, flat=_dflash_flat, limits=_dflash_limits,
    over_limit="its block size - 1", fills_target_weights=True,
))
DSPARK = register_layout(Layout(
    # vLLM's DSpark speculator: its own block drafting plus the sequential Markov stage
    name="dspark", method="dspark", parallel_drafting=False, check=_checked(_dspark_flat, dspark_parts),
    speculators="Qwen3DSparkModel", config=_dspark_config, flat=_dspark_flat, limits=_dspark_limits,
    over_limit="its block size",
    block_slots="K slots (the anchor predicts too)", fills_target_weights=True,
))
