"""Read drafter checkpoints of the ecosystem's formats into specframe's drafter plugins.

What ``read`` recognises (``config.json`` decides; weights are read through safetensors only, a folder carrying
pickles such as ``pytorch_model.bin`` is refused before anything is loaded, with how to convert it: specframe never
unpickles, and SafeAILab's published EAGLE-3 drafters are ``pytorch_model.bin`` folders) is one module per format in
``specframe.layouts.formats``, tried in the order of ``_FORMATS`` below: ``speculators`` (vllm-project/speculators
EAGLE-3 / P-EAGLE / DFlash / DSpark, what ``specframe export`` writes), ``eagle3-flat`` and ``peagle-flat``
(SafeAILab's and SpecForge's flat EAGLE configs), ``deepspec`` and ``specforge-dspark`` (DSpark), ``parallelspec``
and ``pard``. The checks against the target are ``specframe.layouts.target_checks``; the ``Imported`` a reader
returns, and what a drafter's ``import_weights`` does with it, ``specframe.layouts.imported``.

speculators' trainer defaults import into the EAGLE family's options of the same names (``layouts.flat_config``,
``Imported.architecture``): Qwen3 layers (``qk_norm``), ``norm_before_residual``, EAGLE 3.1's ``norm_before_fc`` and
``norm_output``, and a sliding window on every layer (``sliding_window``, honoured in training, drafting and export).
A pickle beside the safetensors weights (its checkpoints' ``optimizer_state_dict.pt``, ``scheduler_state_dict.pt``) is
never opened and named in one line on stderr. Layer variants specframe's drafter layers do not compute are refused,
one line naming the field and both values: ``fc_norm``, a window on some layers only (or in a non-speculators
folder), DFlash's ``sample_from_anchor``, biased projections, another activation or norm epsilon than the target's.

RoPE is compared in full with the target's (``rope_type``, ``rope_theta`` and every scaling field such as ``factor``,
``low_freq_factor``, ``original_max_position_embeddings``): specframe's drafters run the target's RoPE, so a drafter
trained with other frequencies is refused. A missing theta is transformers' (and SpecForge's) default, 10000, not "any
theta".

``read`` returns an ``Imported`` (flat config, tensors under specframe's / vLLM's layout names, verifier when named);
``check_target`` compares it with the target (hidden size, layer shape, RoPE, vocabulary, aux layer range,
tokenizer) and raises one ``SpecframeError`` naming the field; ``specframe.drafter_folders.load_drafter`` builds
the drafter plugin the folder holds and loads it (``Drafter.import_weights``), for ``generate`` / ``bench`` /
``export``; ``specframe train --init-from`` calls ``warm_start``, which loads it into the drafter the run built.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from specframe.errors import SpecframeError
from specframe.layouts import export as layouts
from specframe.layouts.formats import deepspec, flat_eagle3, pard, specforge_dspark, speculators
from specframe.layouts.formats.base import Format
from specframe.layouts.formats.flat_eagle3 import FLAT_EAGLE3_ARCHITECTURE, FLAT_PEAGLE_ARCHITECTURE  # noqa: F401
from specframe.layouts.formats.specforge_dspark import layer_ids as _specforge_layer_ids  # noqa: F401 (a test's)
from specframe.layouts.imported import (  # noqa: F401 (re-exported: what callers and plugins' imports reach)
    Imported,
    check_shape,
    eagle_state,
    missing_embedding,
    with_shared_target_weights,
)
from specframe.layouts.target_checks import (  # noqa: F401 (re-exported)
    DEFAULT_ROPE_THETA,
    check_target,
    check_tokenizer,
    sliding_window_layers,
    target_embedding,
    target_lm_head,
    target_tokenizer,
)

# the formats in the order they are tried: the first that recognises a config.json reads the folder (a speculators
# dspark folder has DeepSpec's architecture, and ParallelSpec's config PARD's pard_token, so those go first)
_FORMATS: tuple[Format, ...] = (
    speculators.SPECULATORS, flat_eagle3.EAGLE3_FLAT, flat_eagle3.PEAGLE_FLAT, deepspec.DEEPSPEC,
    specforge_dspark.SPECFORGE_DSPARK, pard.PARALLELSPEC, pard.PARD,
)
FORMATS = tuple(f.name for f in _FORMATS)


def _format(directory: str | os.PathLike) -> Format | None:
    directory = Path(directory)
    path = directory / "config.json"
    if (directory / "state.json").exists() or not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(cfg, dict):
        return None
    return next((f for f in _FORMATS if f.recognise(cfg)), None)


def format_of(directory: str | os.PathLike) -> str | None:
    """Which importable format ``directory`` holds (None when it is none of them, e.g. a training checkpoint)."""
    fmt = _format(directory)
    return None if fmt is None else fmt.name


def named_target(directory: str | os.PathLike) -> str | None:
    """The verifier a speculators folder names (its target), else None."""
    if format_of(directory) != speculators.SPECULATORS.name:
        return None
    try:
        return layouts.read_manifest(directory).verifier
    except SpecframeError:
        return None


def read(directory: str | os.PathLike, target_config: Any = None) -> Imported:
    """Read and validate the drafter folder at ``directory``; with ``target_config`` also ``check_target``. Every
    refusal is one ``SpecframeError`` starting with the folder and naming the field or tensor."""
    directory = Path(directory)
    try:
        imported = _read(directory, target_config)
        if target_config is not None:
            check_target(imported, target_config)
            imported = with_shared_target_weights(imported, target_config)
    except SpecframeError as e:
        raise SpecframeError(f"cannot import {directory}: {e}") from None
    return imported


def _read(directory: Path, target_config: Any) -> Imported:
    fmt = _format(directory)
    if fmt is None:
        raise SpecframeError("not a drafter folder specframe imports (a config.json with "
                             + "; ".join(f"{f.sign} ({f.name})" for f in _FORMATS) + ")")
    _refuse_pickles(directory)
    _check_safetensors(directory)
    imported = fmt.read(directory, target_config)
    _refuse_layer_variants(directory, fmt)
    return imported


def _refuse_pickles(directory: Path) -> None:
    """A folder of pickled weights (``pytorch_model.bin``: SafeAILab's published EAGLE-3 drafters) refused with why and
    how to convert, before anything in it is read. Beside safetensors weights a pickle is something else (speculators'
    checkpoints keep ``optimizer_state_dict.pt`` and ``scheduler_state_dict.pt`` there): never opened, named in one
    line on stderr, and no reason to refuse the drafter."""
    from specframe.files import PICKLE_SUFFIXES

    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles and any(directory.glob("*.safetensors")):
        sys.stderr.write(f"note: {directory}: left unread (pickles, never opened; the drafter's weights are the "
                         f"safetensors): {', '.join(pickles)}\n")
        return
    if pickles:
        raise SpecframeError(
            f"{pickles[0]} is a pickle file, and specframe reads weights through safetensors only (unpickling can run "
            "code from the file; nothing was loaded): convert it once, e.g. safetensors.torch.save_file(torch.load("
            f"'{pickles[0]}', weights_only=True), 'model.safetensors'), and move {pickles[0]} out of the folder")


def _check_safetensors(directory: Path) -> None:
    """``files.check_files`` without its pickle refusal (``_refuse_pickles`` decided about those): every safetensors
    file in the folder is checked before anything is loaded."""
    from specframe.files import check_safetensors

    for path in sorted(directory.rglob("*.safetensors")):
        check_safetensors(path)


def _refuse_layer_variants(directory: Path, fmt: Format) -> None:
    """Refuse a drafter whose layer config asks for attention or projections specframe's drafter layers do not
    compute (a sliding window, biases), naming the field; the layout's own checks (norm variants, Qwen3 layers) ran
    first."""
    cfg = json.loads((directory / "config.json").read_text())
    layer = cfg.get("transformer_layer_config") if fmt.nested_layer else cfg
    if not isinstance(layer, dict):
        return  # check_layout names the missing layer config
    for key in ("attention_bias", "mlp_bias"):
        if layer.get(key):
            raise SpecframeError(
                f"{key} is true: vLLM and speculators build biased {'q/k/v/o' if key == 'attention_bias' else 'MLP'} "
                "projections from it, and specframe's drafter layers have none (attention_bias = mlp_bias = false)")
    sliding, window = sliding_window_layers(layer)
    if sliding and not fmt.nested_layer:  # a speculators folder's window is read into the drafter's sliding_window
        every = " ".join(map(str, range(int(layer.get("num_hidden_layers") or len(sliding)))))
        raise SpecframeError(
            f"sliding_window {window}: its layer_types make drafter layers {sliding} sliding_attention, which vLLM and "
            f"speculators run over the last {window} positions only, and specframe's drafters attend to the whole "
            "context in training and decoding (a window they would neither apply nor export); import a drafter "
            f"trained with full attention (speculators train --full-attention-indices {every})")


def warm_start(drafter: Any, directory: str | os.PathLike, target_config: Any, tokenizer: Any = None) -> None:
    """``train --init-from``: load the folder at ``directory`` into a built and prepared ``drafter`` (its draft
    vocabulary and mask token come from the folder), after checking it against the target and tokenizer."""
    imported = read(directory, target_config)
    if imported.plugin != drafter.name and imported.layout != drafter.name:
        raise SpecframeError(
            f"cannot import {directory}: it holds a {imported.layout} drafter, and this run trains '{drafter.name}' "
            f"(pass --drafter {imported.layout})"
        )
    if tokenizer is not None:
        try:
            check_tokenizer(imported.directory, tokenizer)
        except SpecframeError as e:
            raise SpecframeError(f"cannot import {directory}: {e}") from None
    drafter.import_weights(imported)
