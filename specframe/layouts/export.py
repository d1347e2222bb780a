"""Writers (and the matching reader) for the drafter checkpoint layouts vLLM (0.32 and later) loads: the facade drafter
plugins reach as ``api.vllm_layouts``, re-exporting the export check every layout shares (``export_check``).

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
from specframe.layouts.export_check import check_export, check_layout  # noqa: F401
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
