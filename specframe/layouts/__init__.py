"""The files layer for drafter folders: the layouts specframe writes and reads, and nothing that runs them.

- ``specframe.layouts.export``: writers for the speculators EAGLE-3 / P-EAGLE / DFlash / DSpark format, the PARD
  causal LM and the ParallelSpec layout (drafter plugins call them through ``api.vllm_layouts`` from
  ``Drafter.export_vllm``), the manifest read back from an export's ``config.json``, the vLLM
  ``speculative_config`` built from it, and the export check. A layout is one module (``eagle3``, ``block``,
  ``pard``, ``parallelspec``) and one row of the layout table (``table``), which every dispatch on a layout reads.
- ``specframe.layouts.imports``: reads speculators, SafeAILab / SpecForge EAGLE-3 / P-EAGLE, PARD, ParallelSpec and
  DeepSpec / SpecForge DSpark folders (one module per format in ``formats``) and checks them against the target
  (``target_checks``), for ``Drafter.import_weights`` and ``train --init-from``.

None of them imports the API, the engine, the plugin registry or vLLM (an import-linter contract in pyproject.toml):
which drafter a folder holds is decided above, in ``specframe.drafter_folders``; running an export is
``specframe.vllm``'s.
"""

# the built-in layouts register their table rows when imported, in this order (the order ``table.names()`` lists,
# which the error naming the known layouts shows); importing them here fills the table before any submodule is used
from specframe.layouts import eagle3, pard, parallelspec, block  # noqa: E402, F401, I001
