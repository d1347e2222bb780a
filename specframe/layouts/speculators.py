"""The speculators format (vllm-project/speculators; vLLM's ``transformers_utils/configs/speculators``) every
speculators layout shares: the envelope of its ``config.json`` (``speculators_model_type``, ``speculators_config``
with ``proposal_methods[0].speculative_tokens`` and ``verifier.name_or_path``, ``transformer_layer_config``, the
``specframe`` provenance entry), how a verifier is named, the drafter's Llama layer config built from the target's,
and the two dispatches by layout over the table: ``speculators_config`` (a flat config into its ``config.json``) and
its inverse ``flat_config``, which ``set_serving`` runs to re-target an existing folder. A new export is written with
its ``Serving`` choice at once (``with_serving``, called by the atomic writer), not re-targeted after.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specframe import __version__
from specframe.errors import SpecframeError
from specframe.layouts import table
from specframe.layouts.checks import check_int
from specframe.layouts.manifest import (
    DEFAULT_SPECULATIVE_TOKENS,
    PROVENANCE,
    Manifest,
    Serving,
    read_config,
    read_manifest,
)

#: the target config fields a drafter's Llama layer config copies (``llama_config``)
LLAMA_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "hidden_act",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
#: the keys of a layer config that say which model it is, not how it computes (a flat config drops them)
IDENTITY_KEYS = ("architectures", "model_type", "tie_word_embeddings")


def verifier_name(target: str | os.PathLike) -> str:
    """How a speculators config names ``target``: an existing local folder as its absolute path, else as given (a
    hub id)."""
    path = Path(target)
    return str(path.resolve()) if path.is_dir() else str(target)


def verifier_of(target_config: Any) -> str | None:
    """The verifier name of the target a transformers config was loaded from (its ``_name_or_path``), or None."""
    source = getattr(target_config, "_name_or_path", None) or getattr(target_config, "name_or_path", None)
    return verifier_name(source) if source else None


def verifier_architectures_of(target_config: Any) -> list[str]:
    """The target's own ``architectures`` (``Qwen2ForCausalLM``, ...), as speculators' VerifierConfig records them;
    empty when its config names none."""
    if isinstance(target_config, Mapping):
        names = target_config.get("architectures")
    else:
        names = getattr(target_config, "architectures", None)
    return [str(a) for a in names or ()]


def llama_config(target_config: Any, num_hidden_layers: int, **overrides: Any) -> dict[str, Any]:
    """A drafter's Llama config dict: the layer shapes of ``target_config`` (a transformers config or a dict), with
    ``num_hidden_layers`` drafter layers and ``overrides`` applied (e.g. a different ``intermediate_size``)."""
    source = target_config if isinstance(target_config, Mapping) else target_config.to_dict()
    config = {k: source[k] for k in LLAMA_KEYS if source.get(k) is not None}
    # every field the drafter's layers compute with, as they read it (modeling.LayerShape): a family that names one
    # otherwise (Gemma-3's hidden_activation) or leaves it to a default would else be served with vLLM's (silu)
    config.update(drafter_layer_fields(target_config))
    # specframe's drafter layers have no biases, whatever the target's: vLLM builds biased q/k/v/o and MLP
    # projections from these keys, so a target's attention_bias: true copied here made an export vLLM cannot load
    config.update(attention_bias=False, mlp_bias=False)
    config.update(num_hidden_layers=int(num_hidden_layers), **overrides)
    return config


def drafter_layer_fields(target_config: Any) -> dict[str, Any]:
    """The layer fields a drafter built on ``target_config`` (a transformers config or a dict) computes with
    (``modeling.LayerShape.from_config``: sizes, head size, activation, norm epsilon, RoPE), under their config
    names."""
    from types import SimpleNamespace

    from specframe.drafting.modeling import LayerShape

    cfg = SimpleNamespace(**target_config) if isinstance(target_config, Mapping) else target_config
    return LayerShape.from_config(cfg).config_fields()


def set_dtype(cfg: dict[str, Any]) -> None:
    """Name the weights' dtype ``dtype``, as transformers 5 does: ``torch_dtype`` is its deprecated spelling (it warns
    on it), which an older export carries and which transformers, vLLM 0.32 and speculators all read as ``dtype``."""
    legacy = cfg.pop("torch_dtype", None)
    cfg.setdefault("dtype", legacy or "float32")


def with_target_hidden_size(flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` with an absent or null ``target_hidden_size`` read as the drafter's own width."""
    # speculators writes target_hidden_size null (its default), meaning "the drafter's own width": vLLM reads an absent
    # or null one as the draft config's hidden_size (llama_eagle3, qwen3_dflash) and speculators sizes fc from it too;
    # whether that is the target's width is check_target's business
    if flat.get("target_hidden_size") is None and flat.get("hidden_size") is not None:
        flat["target_hidden_size"] = flat["hidden_size"]
    return flat


def layer_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``transformer_layer_config`` of a speculators ``config.json`` (refused when it has none)."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise SpecframeError("config.json lacks transformer_layer_config (the drafter's layer config)")
    return layer


def envelope(
    kind: str,
    architecture: str,
    layer: dict[str, Any],
    *,
    verifier: str | None,
    speculative_tokens: int,
    drafter: str | None,
    verifier_architectures: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The speculators ``config.json`` of a ``kind`` drafter (architecture ``architecture``) around its layer config
    ``layer`` (its ``dtype`` set here), naming ``verifier`` and drafting ``speculative_tokens`` per step; the layout
    adds its own top-level fields."""
    set_dtype(layer)
    return {
        "architectures": [architecture],
        "speculators_model_type": kind,
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or ())},
        },
        "transformer_layer_config": layer,
        "dtype": layer["dtype"],
        PROVENANCE: {"drafter": drafter, "version": __version__},
    }


def speculators_config(
    flat: Mapping[str, Any],
    layout: str,
    *,
    verifier: str | None,
    speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
    drafter: str | None = None,
    verifier_architectures: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The speculators ``config.json`` of a ``layout`` drafter from its flat config (Llama layer fields plus the
    layout's own: EAGLE-3's ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` and,
    P-EAGLE, ``mask_token_id``; the block layouts' fields), naming ``verifier`` (the target: a local folder path or
    hub id) with its ``verifier_architectures`` (``verifier_architectures_of`` the target's config; none known: empty)
    and drafting ``speculative_tokens`` tokens per step by default. ``flat_config`` reads it back."""
    record = table.get(layout)
    if record is None or record.config is None:
        raise SpecframeError(f"layout {layout!r} has no speculators format (speculators layouts: "
                             f"{', '.join(table.speculators())})")
    check_int("speculative_tokens", speculative_tokens, 1)
    return record.config(flat, verifier=verifier, speculative_tokens=speculative_tokens, drafter=drafter,
                         verifier_architectures=verifier_architectures)


def flat_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The flat drafter config (``transformer_layer_config`` plus the layout's fields) of a speculators
    ``config.json``; refuses variants specframe's layers do not compute (``norm_before_residual`` true, ``fc_norm``,
    ...), naming the field."""
    layer_config(config)
    kind = config.get("speculators_model_type")
    record = table.get(kind)
    if record is None or record.flat is None:
        raise SpecframeError(f"speculators_model_type {kind!r} is not a speculators layout specframe reads "
                             f"({', '.join(table.speculators())})")
    return record.flat(config)


def with_serving(config: dict[str, Any], manifest: Manifest, serving: Serving) -> dict[str, Any]:
    """``config``, the speculators ``config.json`` a writer is about to write (its ``manifest``), naming the verifier
    and default draft tokens ``serving`` chose where it chose them (the envelope's two serving fields, which
    ``speculators_config`` would have built with them); a number of draft tokens the export cannot be served at is
    refused first, with ``Manifest.refusal``'s reason. Another layout records neither: ``config`` as it is."""
    if not manifest.speculators:
        return config
    if serving.speculative_tokens is not None:
        manifest.check_tokens(serving.speculative_tokens)
    spec = config["speculators_config"]
    if serving.verifier is not None:
        spec["verifier"]["name_or_path"] = serving.verifier
    if serving.speculative_tokens is not None:
        spec["proposal_methods"][0]["speculative_tokens"] = serving.speculative_tokens
    return config


def set_serving(
    directory: str | os.PathLike, *, verifier: str | None = None, speculative_tokens: int | None = None
) -> Manifest:
    """Rewrite the verifier and / or default number of draft tokens of the speculators export at ``directory``
    (``config.json`` replaced atomically); returns the new manifest. For re-targeting a folder already written (and
    for an API 13 drafter's export, written before the choice could reach it): a new export is written with its
    ``Serving`` at once."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if verifier is None and speculative_tokens is None:
        return manifest
    if speculative_tokens is not None:
        manifest.check_tokens(speculative_tokens)
    if not manifest.speculators:
        raise SpecframeError(f"{directory} is a {manifest.layout} export, which names no verifier (not speculators format)")
    cfg = read_config(directory)
    flat = flat_config(cfg)
    new = speculators_config(
        flat, manifest.layout, verifier=verifier if verifier is not None else manifest.verifier,
        speculative_tokens=speculative_tokens if speculative_tokens is not None else manifest.speculative_tokens,
        drafter=manifest.drafter,
        verifier_architectures=(cfg.get("speculators_config") or {}).get("verifier", {}).get("architectures"),
    )
    if isinstance(cfg.get(PROVENANCE), dict):  # what the writing drafter declared there (MIN_TOKENS) stays
        new[PROVENANCE] = {**cfg[PROVENANCE], **new[PROVENANCE]}
    tmp = directory / "config.json.tmp"
    tmp.write_text(json.dumps(new, indent=1, sort_keys=True))
    os.replace(tmp, directory / "config.json")
    return read_manifest(directory)
