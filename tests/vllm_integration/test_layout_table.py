"""The layout table (issue 55, item 1): a layout is one module and one table row. A fixture layout registered here,
and nothing else edited, is recognised by the manifest reader, refused past its limits, enveloped and un-flattened,
checked, re-targeted, imported and pre-start checked; and the lists of layouts in ``specframe export --help`` and the
serving guide are the table's (fast, no vLLM)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from specframe.cli import main
from specframe.errors import SpecframeError
from specframe.layouts import export, imports, table
from specframe.layouts.checks import check_shape, require_ints
from specframe.layouts.speculators import IDENTITY_KEYS, envelope, layer_config, with_target_hidden_size
from specframe.layouts.writing import write
from specframe.vllm import support

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide" / "serving-vllm.md"


# ------------------------------------------------------------------------------------------- the fixture layout:
# what a new layout's module would hold, written against the layouts' public helpers only

_FIELDS = ("toy_width", "block_size")


def _config(flat: Mapping[str, Any], *, verifier: str | None, speculative_tokens: int, drafter: str | None,
            verifier_architectures: Sequence[str] | None = None) -> dict[str, Any]:
    layer = {k: v for k, v in flat.items() if k not in _FIELDS}
    layer.update(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False)
    full = envelope("toy", "ToyDraftModel", layer, verifier=verifier, speculative_tokens=speculative_tokens,
                    drafter=drafter, verifier_architectures=verifier_architectures)
    full.update({k: flat[k] for k in _FIELDS if k in flat})
    return full


def _flat(config: Mapping[str, Any]) -> dict[str, Any]:
    flat = {k: v for k, v in layer_config(config).items() if k not in IDENTITY_KEYS}
    flat.update({k: config[k] for k in _FIELDS if config.get(k) is not None})
    return with_target_hidden_size(flat)


def _check(tensors: dict, cfg: Mapping[str, Any], target_num_layers: int | None) -> tuple[dict, dict]:
    flat = _flat(cfg)
    hidden, width = require_ints(flat, "hidden_size", "toy_width")
    check_shape(tensors, "toy.weight", (width, hidden))
    return tensors, flat


def _limits(cfg: Mapping[str, Any], provenance: Mapping[str, Any]) -> table.Limits:
    block = cfg.get("block_size")
    return (block, block - 1, block) if isinstance(block, int) else (None, None, None)


TOY = table.Layout(name="toy", method="toy_method", parallel_drafting=True, check=_check, speculators="ToyDraftModel",
                   config=_config, flat=_flat, limits=_limits, over_limit="its toy block", aux_hidden_states=False)


@pytest.fixture
def toy():
    table.register_layout(TOY)
    yield TOY
    table.unregister_layout(TOY.name)


FLAT = {"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 32, "toy_width": 4,
        "block_size": 3}


def _write_toy(directory: Path, *, width: int = 4) -> dict[str, Any]:
    config = _config(FLAT, verifier="some/target", speculative_tokens=3, drafter="toy")
    return write(directory, {"toy.weight": torch.zeros(width, 8)}, config, None)


def test_a_layout_registered_in_the_table_is_read_limited_checked_and_served_without_another_edit(toy, tmp_path):
    out = tmp_path / "toy"
    written = _write_toy(out)
    assert written["layout"] == "toy"  # the writer's manifest is read back through the table
    manifest = export.read_manifest(out)
    assert (manifest.layout, manifest.method, manifest.parallel_drafting, manifest.speculators) == (
        "toy", "toy_method", True, True)
    assert (manifest.verifier, manifest.speculative_tokens, manifest.drafter) == ("some/target", 3, "toy")
    assert (manifest.max_speculative_tokens, manifest.min_speculative_tokens, manifest.block_size) == (3, 2, 3)
    assert "toy" in table.names() and table.speculators()["toy"] == "ToyDraftModel"

    # refusal and limits come from the row
    assert manifest.refusal(3) is None
    assert "drafts at most 3 tokens per step (its toy block)" in manifest.refusal(4)
    assert "toy_method proposer drafts K tokens from a block of K + 1 slots" in manifest.refusal(1)
    assert export.speculative_config(out, 2) == {"method": "toy_method", "model": str(out.resolve()),
                                                 "num_speculative_tokens": 2, "parallel_drafting": True}

    # the speculators envelope and its inverse dispatch to the row
    cfg = export.speculators_config(FLAT, "toy", verifier="v", speculative_tokens=2)
    assert cfg["speculators_model_type"] == "toy" and cfg["architectures"] == ["ToyDraftModel"]
    assert export.flat_config(cfg) == {**FLAT, "dtype": "float32", "target_hidden_size": 8}

    # the export check runs the row's tensor check
    manifest, tensors, flat = export.check_layout(out)
    assert set(tensors) == {"toy.weight"} and flat["toy_width"] == 4
    assert export.check_export(out).layout == "toy"
    _write_toy(tmp_path / "bad", width=5)
    with pytest.raises(SpecframeError, match=r"cannot be served by vLLM: weight 'toy.weight' has shape \[5, 8\]"):
        export.check_export(tmp_path / "bad")

    # re-targeting a folder, importing it (the speculators format reads any speculators layout) and the vLLM
    # pre-start check read the same row
    assert export.set_serving(out, verifier="other/target", speculative_tokens=2).verifier == "other/target"
    imported = imports.read(out)
    assert (imported.format, imported.layout, imported.verifier, imported.speculative_tokens) == (
        "speculators", "toy", "other/target", 2)
    assert support.problems("toy", ["AnyForCausalLM"], "gelu") == []  # no aux states, not vLLM's llama_eagle3


def test_a_layout_out_of_the_table_is_unknown_again(tmp_path):
    table.register_layout(TOY)
    try:
        _write_toy(tmp_path / "toy")
    finally:
        table.unregister_layout(TOY.name)
    with pytest.raises(SpecframeError, match="speculators_model_type 'toy'; known layouts: eagle3, peagle, pard, "
                                             "parallelspec, dflash, dspark"):
        export.read_manifest(tmp_path / "toy")
    with pytest.raises(SpecframeError, match="layout 'toy' has no speculators format"):
        export.speculators_config(FLAT, "toy", verifier="v")


def test_a_layout_name_is_registered_once():
    with pytest.raises(ValueError, match="registered twice"):
        table.register_layout(table.Layout(name="eagle3", method="eagle3", parallel_drafting=False, check=_check))


# ------------------------------------------------------------------------------------ the lists kept to the table


def test_the_export_help_lists_every_layout_and_format():
    # help rendered unwrapped: click wraps at hyphens too, and "specforge-\ndspark" would not read as the name
    result = CliRunner().invoke(main, ["export", "--help"], terminal_width=10_000, max_content_width=10_000)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for name in table.names():
        assert re.search(rf"\b{re.escape(name)}\b", text), f"`specframe export --help` does not name layout {name}"
    for name in imports.FORMATS:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"--help does not name format {name}"


def test_the_serving_guide_lists_exactly_the_layouts_of_the_table():
    rows = {}
    for line in GUIDE.read_text().splitlines():
        if m := re.match(r"\| `([a-z0-9_]+)` \| [^|]+ \| `([a-z0-9_]+)`(, `parallel_drafting`)? \|", line):
            rows[m.group(1)] = (m.group(2), bool(m.group(3)))
    assert rows == {r.name: (r.method, r.parallel_drafting) for r in table.layouts()}, (
        f"{GUIDE.relative_to(ROOT)}'s table of layouts differs from specframe.layouts.table")
