"""What the foreign readers share: the ``Format`` record each contributes, reading a folder's ``config.json`` and its
safetensors weights, and the DSpark RNN head's recurrence, which three of them set aside before the export check.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from specframe.errors import SpecframeError
from specframe.layouts.checks import check_shape
from specframe.layouts.imported import Imported


@attrs.frozen
class Format:
    """One drafter folder format: its name (``Imported.format``), whether a ``config.json`` is in it, and its reader
    (``read(directory, target_config)``, one ``SpecframeError`` naming the field or tensor it refuses); ``sign``: what
    its ``config.json`` shows, in words (the refusal of a folder no format recognises lists every format's)."""

    name: str
    recognise: Callable[[Mapping[str, Any]], bool]
    read: Callable[[Path, Any], Imported]
    #: the layer config is the folder's ``transformer_layer_config`` (not the config itself), and a sliding window in
    #: it is read into the drafter's ``sliding_window`` rather than refused (speculators)
    nested_layer: bool = False
    sign: str = ""


def read_json(directory: Path) -> dict[str, Any]:
    """The folder's ``config.json`` (its format was recognised from it, so it is a JSON object)."""
    return json.loads((directory / "config.json").read_text())


def load_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's ``*.safetensors`` files (pickled weights are never read)."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise SpecframeError("no *.safetensors weights in the folder (pickled weights are not read)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def recurrence(tensors: dict[str, torch.Tensor], head: str, rank: int, hidden: int) -> dict[str, torch.Tensor]:
    """The RNN head's recurrence (``markov_head.joint_proj`` over [state; W1[x_prev]; h] -> gate, candidate, output:
    DeepSpec's, SpecForge's and speculators' ``RNNHead`` alike, and specframe's), checked and taken out of
    ``tensors``, so the rest is checked as the vanilla head vLLM serves (the export check knows no other)."""
    recurrent = {}
    if head == "rnn":
        for name, shape in (("markov_head.joint_proj.weight", (3 * rank, 2 * rank + hidden)),
                            ("markov_head.joint_proj.bias", (3 * rank,))):
            check_shape(tensors, name, shape)
            recurrent[name] = tensors.pop(name)
    return recurrent
