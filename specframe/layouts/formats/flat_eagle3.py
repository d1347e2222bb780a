"""The flat EAGLE formats: ``eagle3-flat``, a flat ``LlamaForCausalLMEagle3`` config as SafeAILab/EAGLE (EAGLE-3) and
SpecForge (sgl-project) save their EAGLE-3 drafters (Llama config fields plus ``draft_vocab_size``; the aux layers
under ``eagle_aux_hidden_state_layer_ids`` or SpecForge's ``eagle_config.eagle_aux_hidden_state_layer_ids``,
otherwise the original default (2, L//2, L-3) of the target; the decoder layer named ``midlayer.*`` or
``layers.N.*``; a config whose ``mask_token_id`` is set with a ``mask_hidden`` tensor is read as P-EAGLE), and
``peagle-flat``, SpecForge's P-EAGLE (``PEagleDraftModel``), read the same way; SpecForge does not save its mask
token, so a folder whose config lacks ``mask_token_id`` is refused with that reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specframe.errors import SpecframeError
from specframe.layouts.eagle3 import eagle3_parts, peagle_parts
from specframe.layouts.formats.base import Format, load_weights, read_json
from specframe.layouts.imported import Imported
from specframe.layouts.speculators import LLAMA_KEYS

FLAT_EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
#: SpecForge's P-EAGLE drafter (``specforge/modeling/draft/peagle.py``), saved as a flat Llama config
FLAT_PEAGLE_ARCHITECTURE = "PEagleDraftModel"


def _reader(fmt: str, peagle: bool):
    def read(directory: Path, target_config: Any) -> Imported:
        return _read_flat_eagle3(directory, target_config, fmt, peagle)

    return read


def _read_flat_eagle3(directory: Path, target_config: Any, fmt: str, peagle: bool) -> Imported:
    from specframe.features import low_mid_high_layers

    cfg = read_json(directory)
    if peagle and cfg.get("mask_token_id") is None:
        raise SpecframeError(
            f"a SpecForge P-EAGLE folder ({FLAT_PEAGLE_ARCHITECTURE}) whose config.json records no mask_token_id: "
            "SpecForge passes the mask token to its trainer and does not save it, and the token its mask slots were "
            "trained on cannot be guessed; add \"mask_token_id\": <the id it trained with> to config.json")
    tensors = load_weights(directory)
    tensors = {k: v for k, v in tensors.items() if not k.startswith("verifier_")}
    if "fc.bias" in tensors:
        raise SpecframeError("tensor 'fc.bias': specframe's EAGLE-3 fc has no bias")
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux is None and isinstance(cfg.get("eagle_config"), dict):
        aux = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        if target_config is None:
            raise SpecframeError(
                "eagle_aux_hidden_state_layer_ids is not recorded; the default (2, L//2, L-3) needs the target"
            )
        aux = list(low_mid_high_layers(int(target_config.num_hidden_layers)))
    kept = (*LLAMA_KEYS, "num_hidden_layers", "torch_dtype", "dtype")
    flat = {k: v for k, v in cfg.items() if k in kept}
    if cfg.get("target_hidden_size") is not None:  # null: the drafter's own width, as vLLM reads it
        h_t = int(cfg["target_hidden_size"])
    else:
        fc = tensors.get("fc.weight")
        if fc is None or fc.shape[1] % max(len(aux), 1):
            raise SpecframeError("missing tensor 'fc.weight' (or its width is not a multiple of the aux layers)")
        h_t = int(fc.shape[1]) // len(aux)
    layers = None if target_config is None else int(target_config.num_hidden_layers)
    tensors, flat = eagle3_parts(tensors, flat, aux, h_t, layers)
    layout = "eagle3"
    if "mask_hidden" in tensors or peagle:
        layout = "peagle"
        peagle_parts(tensors, flat, cfg.get("mask_token_id"))
    return Imported(directory, fmt, layout, flat, tensors, None, None)


EAGLE3_FLAT = Format("eagle3-flat", lambda cfg: FLAT_EAGLE3_ARCHITECTURE in (cfg.get("architectures") or []),
                     _reader("eagle3-flat", peagle=False), sign=f"architecture {FLAT_EAGLE3_ARCHITECTURE}")
PEAGLE_FLAT = Format("peagle-flat", lambda cfg: FLAT_PEAGLE_ARCHITECTURE in (cfg.get("architectures") or []),
                     _reader("peagle-flat", peagle=True), sign=f"architecture {FLAT_PEAGLE_ARCHITECTURE}")
