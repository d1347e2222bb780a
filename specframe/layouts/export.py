"""Writers (and the matching reader) for the drafter checkpoint layouts vLLM (0.32 and later) loads: the facade drafter
plugins reach as ``api.vllm_layouts``, and the export check every layout shares.

A drafter plugin's ``export_vllm`` gathers its tensors under the layout's names plus a few config values, and calls
one of ``write_eagle3``, ``write_peagle``, ``write_dflash``, ``write_dspark``, ``write_pard`` or
``write_parallelspec`` with the ``Serving`` choice it was handed. Each writer validates shapes and ids (raising
``SpecframeError`` with the offending name), then writes ``config.json`` (once, naming the chosen verifier and draft
tokens), ``model.safetensors`` and the tokenizer files (when given a tokenizer) into a temporary folder beside
``directory`` and moves it into place (``writing``), so a reader never sees half an export; it returns the
``Manifest``.
``config.json`` alone says what the folder is (``read_manifest``); a ``specframe`` entry in it records which drafter
plugin and specframe version wrote it.

A layout is one module and one row of the layout table (``table``): ``eagle3`` (EAGLE-3 and P-EAGLE, speculators
``eagle3`` / ``peagle``), ``block`` (DFlash and DSpark, speculators ``dflash`` / ``dspark``), ``pard`` (a causal LM
with ``pard_token``) and ``parallelspec`` (an EAGLE backbone with one mask embedding per slot); each module's
docstring specifies its format. The speculators layouts share the envelope of ``speculators``; vLLM serves those from
the folder alone, the others beside the target with an explicit ``speculative_config``. ``manifest`` reads a folder
back, ``checks`` holds the shape and id checks every layout uses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from specframe.errors import SpecframeError
from specframe.layouts import table

# re-exported: what drafter plugins (through api.vllm_layouts), the CLI, vLLM's serving and the tests reach here
from specframe.layouts.block import (  # noqa: F401
    DSPARK_CALIBRATION,
    DSPARK_SAMPLE_FROM_ANCHOR_DEFAULT,
    dspark_samples_from_anchor,
    write_dflash,
    write_dspark,
)
from specframe.layouts.checks import check_export_target, split_rope  # noqa: F401
from specframe.layouts.eagle3 import write_eagle3, write_peagle  # noqa: F401
from specframe.layouts.manifest import (  # noqa: F401
    DEFAULT_SPECULATIVE_TOKENS,
    MIN_TOKENS,
    PARALLELSPEC_ARCHITECTURE,
    PROVENANCE,
    WEIGHTS,
    Manifest,
    Serving,
    layout_of,
    manifest_of,
    read_config,
    read_manifest,
    speculative_config,
)
from specframe.layouts.parallelspec import write_parallelspec  # noqa: F401
from specframe.layouts.pard import write_pard  # noqa: F401
from specframe.layouts.speculators import (  # noqa: F401
    drafter_layer_fields,
    flat_config,
    llama_config,
    set_serving,
    speculators_config,
    verifier_architectures_of,
    verifier_name,
    verifier_of,
    with_serving,
)
from specframe.layouts.target_checks import sliding_window_layers  # noqa: F401

#: the built-in layouts' names, in the table's order
LAYOUTS = table.names()
#: the speculators layouts (``speculators_model_type``) and the architecture name the speculators library gives them
SPECULATORS = table.speculators()


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
