"""The check every exported layout shares (``check_layout``, ``check_export``): an export folder read back and held to
its layout's own shape and id checks (its row of ``table``), so a damaged or mismatched folder is named in one line
instead of vLLM's traceback after minutes of start-up. The readers of foreign folders (``formats``) use it too, which
is why it is its own module and not the writers' facade (``export``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from specframe.errors import SpecframeError
from specframe.layouts import table
from specframe.layouts.checks import check_export_target
from specframe.layouts.manifest import WEIGHTS, Manifest, manifest_of, read_config


def check_layout(
    directory: str | os.PathLike, target_config: Any = None, manifest: Manifest | None = None, *,
    config: dict | None = None,
) -> tuple[Manifest, dict, dict]:
    """Read and validate the export at ``directory`` (for a target with ``target_config``, when given): returns its
    manifest (``manifest`` when the caller read it already; ``config`` its ``config.json`` likewise), its tensors under
    the layout's names and its flat config;
    one ``SpecframeError`` (without the folder prefix) names the problem otherwise. Reads weights through safetensors
    only; the layout's own check is its table row's."""
    from safetensors.torch import load_file

    from specframe.files import check_safetensors

    directory = Path(directory)
    cfg = config if config is not None else read_config(directory)
    manifest = manifest if manifest is not None else manifest_of(cfg, directory)
    weights_path = directory / WEIGHTS
    if not weights_path.is_file():
        raise SpecframeError(f"{WEIGHTS} is missing (re-run `specframe export`)")
    check_safetensors(weights_path)
    tensors = load_file(str(weights_path))
    tensors, flat = table.get(manifest.layout).check(tensors, cfg, getattr(target_config, "num_hidden_layers", None))
    if target_config is not None:
        check_export_target(flat, target_config)
    return manifest, tensors, flat


def check_export(directory: str | os.PathLike, target_config: Any = None, manifest: Manifest | None = None, *,
                 config: dict | None = None) -> Manifest:
    """Check that vLLM can load the export at ``directory`` (for a target with ``target_config``, when given) and
    return its manifest (``manifest`` and ``config`` when the caller read them already); raise one ``SpecframeError``
    naming the problem otherwise.

    vLLM meets a damaged or mismatched drafter folder with a long traceback from deep inside model loading, often
    after minutes of start-up; this runs the writers' own shape and id checks on what is on disk instead."""
    from specframe.files import check_safetensors

    if (Path(directory) / WEIGHTS).is_file():
        check_safetensors(Path(directory) / WEIGHTS)  # its message names the file already
    try:
        return check_layout(directory, target_config, manifest, config=config)[0]
    except SpecframeError as e:
        raise SpecframeError(f"{directory} cannot be served by vLLM: {e}") from None
