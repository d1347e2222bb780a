"""The ``speculators`` format: vllm-project/speculators folders (``speculators_model_type`` ``eagle3``, ``peagle``,
``dflash``, ``dspark``), which is what ``specframe export`` writes, read as an export is checked (``check_layout``).
The library's ``verifier_*`` copies (older speculators releases saved the verifier's ``verifier_lm_head`` /
``verifier_norm`` beside the drafter) are dropped. A ``dspark`` folder with the RNN Markov head (speculators trains
it; vLLM serves the vanilla head only, so the export check refuses it) is checked with its recurrence set aside.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specframe.errors import SpecframeError
from specframe.layouts.block import dspark_parts
from specframe.layouts.checks import require_ints
from specframe.layouts.export_check import check_layout
from specframe.layouts.formats.base import Format, read_json, recurrence
from specframe.layouts.imported import Imported
from specframe.layouts.manifest import WEIGHTS, read_manifest
from specframe.layouts.speculators import flat_config


def _read(directory: Path, target_config: Any) -> Imported:
    if _is_recurrent_dspark(directory):
        return _read_rnn_dspark(directory, target_config)
    manifest, tensors, flat = check_layout(directory)
    # older speculators releases saved the verifier's own lm_head / norm beside the drafter: not the drafter's
    tensors = {k: v for k, v in tensors.items() if not k.startswith("verifier_")}
    return Imported(directory, "speculators", manifest.layout, flat, tensors, manifest.verifier, manifest.drafter,
                    manifest.speculative_tokens)


def _is_recurrent_dspark(directory: Path) -> bool:
    cfg = read_json(directory)
    return cfg.get("speculators_model_type") == "dspark" and cfg.get("markov_head_type") == "rnn"


def _read_rnn_dspark(directory: Path, target_config: Any) -> Imported:
    """A speculators ``dspark`` folder with the RNN head: the layout's checks with the recurrence set aside."""
    from safetensors.torch import load_file

    from specframe.files import check_safetensors

    cfg = read_json(directory)
    manifest = read_manifest(directory)
    flat = flat_config(cfg)
    rank, hidden = require_ints(flat, "markov_rank", "hidden_size")
    weights = directory / WEIGHTS
    if not weights.is_file():
        raise SpecframeError(f"{WEIGHTS} is missing")
    check_safetensors(weights)
    tensors = {k: v for k, v in load_file(str(weights)).items() if not k.startswith("verifier_")}
    recurrent = recurrence(tensors, "rnn", rank, hidden)
    layers = None if target_config is None else int(target_config.num_hidden_layers)
    tensors = dspark_parts(tensors, {**flat, "markov_head_type": "vanilla"}, layers)
    return Imported(directory, "speculators", "dspark", flat, {**tensors, **recurrent}, manifest.verifier,
                    manifest.drafter, manifest.speculative_tokens)


SPECULATORS = Format("speculators", lambda cfg: "speculators_config" in cfg or "speculators_model_type" in cfg, _read,
                     nested_layer=True, sign="speculators_config")
