"""Writing an export atomically: ``config.json``, ``model.safetensors`` and the tokenizer files go into a temporary
folder beside the destination, which is then moved into place (an existing export there is swapped out first), so a
reader never sees half an export and a folder that is not an export is never overwritten. ``config.json`` is written
once, with the user's ``Serving`` choice in it, and the ``Manifest`` returned is the one its text gives (nothing read
back from disk).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from specframe.errors import SpecframeError
from specframe.layouts.checks import split_rope
from specframe.layouts.manifest import WEIGHTS, Manifest, Serving, manifest_of, read_manifest
from specframe.layouts.speculators import with_serving


def write(
    directory: str | os.PathLike,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    tokenizer: Any,
    serving: Serving | None = None,
) -> Manifest:
    """Write an export of ``tensors`` and ``config`` (and ``tokenizer``'s files, when given) to ``directory``, replacing
    it atomically; a speculators ``config`` names the verifier and draft tokens ``serving`` chose (``with_serving``:
    a number the export cannot be served at is refused before anything is written). Returns the manifest of the
    ``config.json`` written."""
    from safetensors.torch import save_file

    layer = config.get("transformer_layer_config")
    reason = split_rope(layer if isinstance(layer, Mapping) else config)
    if reason is not None:  # before anything is written: an export vLLM cannot start is no export
        raise SpecframeError(f"cannot export this drafter for vLLM: {reason}")
    directory = Path(directory)
    if serving is not None:
        config = with_serving(config, manifest_of(config, directory), serving)
    text = json.dumps(config, indent=1, sort_keys=True)
    # the manifest of the text as written: what read_manifest would read back, read from memory
    manifest = manifest_of(json.loads(text), directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".tmp"))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would follow the export into place
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(text)
        replace_dir(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def is_export(directory: Path) -> bool:
    """Whether ``directory`` holds an export specframe knows (its manifest reads)."""
    try:
        read_manifest(directory)
    except SpecframeError:
        return False
    return True


def replace_dir(new: Path, directory: Path) -> None:
    """Move ``new`` to ``directory``; an existing export there is swapped out first and removed afterwards."""
    if not directory.exists():
        os.replace(new, directory)
        return
    if any(directory.iterdir()) and not is_export(directory):
        raise SpecframeError(f"{directory} exists and is not a vLLM drafter export; refusing to overwrite it")
    old = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".old"))
    os.replace(directory, old / "export")
    os.replace(new, directory)
    shutil.rmtree(old, ignore_errors=True)
