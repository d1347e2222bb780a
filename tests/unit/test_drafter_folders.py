"""``specframe.drafter_folders``: the one way in to a drafter folder (issue 31 item 2). A run folder, a checkpoint and
every foreign layout open through ``open_drafter`` with their kind, weights folder and target; bench, export and
generate use it, and no other core module decides "ours or foreign?"."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from specframe import plugins
from specframe.drafter_folders import (
    CHECKPOINT,
    folder_kind,
    open_drafter,
    recorded_target,
    weights_folder,
)
from specframe.engine import checkpoint as ckpt
from specframe.errors import SpecframeError
from tests.train_fixtures import trained_peagle
from tests.vllm_fixtures import AUX, build_target, mask_token, target_parts

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    target, out, _ = trained_peagle(tmp_path_factory.mktemp("folders"), "layers = 1\ndraft_vocab_size = 100")
    return target, out


def test_a_run_folder_opens_its_latest_checkpoint_for_the_target_it_recorded(run):
    target, out = run
    opened = open_drafter(out)
    assert opened.kind == CHECKPOINT
    assert opened.directory == ckpt.resolve(out) != out  # the step folder `latest` names, not the run folder
    assert opened.target_source == str(target)
    assert opened.drafter.name == "peagle" and opened.drafter.options.layers == 1
    assert opened.tokenizer.vocab_size == opened.target_config.vocab_size
    again = open_drafter(opened.directory)  # the checkpoint itself opens the same
    for a, b in zip(again.drafter.module().state_dict().values(), opened.drafter.module().state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)


def test_a_speculators_export_opens_for_the_verifier_it_names_and_pard_needs_a_target(tmp_path):
    path = build_target(tmp_path / "t")
    config, tok = target_parts(path)
    cls = plugins.get("drafter", "eagle3")
    eagle = cls(config, cls.Options(layers=1, aux_layer_ids=AUX))
    eagle.export_vllm(tmp_path / "eagle3", tok)
    opened = open_drafter(tmp_path / "eagle3")
    assert (opened.kind, opened.drafter.name, opened.directory) == ("speculators", "eagle3", tmp_path / "eagle3")
    assert opened.target_source == str(path.resolve())

    cls = plugins.get("drafter", "pard")
    pard = cls(config, cls.Options(layers=1, init_from_target=False))
    pard.mask_token_id = mask_token(tok)
    pard.export_vllm(tmp_path / "pard", tok)
    assert folder_kind(tmp_path / "pard") == "pard" and recorded_target(tmp_path / "pard") is None
    with pytest.raises(SpecframeError, match="does not record its target; pass --target"):
        open_drafter(tmp_path / "pard")
    assert open_drafter(tmp_path / "pard", str(path)).drafter.name == "pard"


def test_a_folder_that_holds_no_drafter_is_one_clear_error(tmp_path):
    with pytest.raises(SpecframeError, match="does not exist"):
        folder_kind(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecframeError, match="neither a checkpoint nor a training output directory"):
        weights_folder(tmp_path / "empty")


def test_no_other_core_module_decides_ours_or_foreign():
    """Reading a folder's foreign format or building a drafter from a folder happens in drafter_folders alone (the
    layouts themselves excepted): a second dispatch elsewhere is how bench and export drifted apart before."""
    owners = {"specframe/drafter_folders.py", "specframe/layouts/imports.py"}
    found = []
    for path in sorted((ROOT / "specframe").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute | ast.Name):
                name = node.attr if isinstance(node, ast.Attribute) else node.id
                if name in ("format_of", "named_target") and rel not in owners:
                    found.append(f"{rel}:{node.lineno}: {name}")
            if isinstance(node, ast.FunctionDef) and node.name == "load_drafter" and rel not in owners:
                found.append(f"{rel}:{node.lineno}: def load_drafter")
    assert not found, found


def test_a_drafter_hashes_the_same_wherever_its_run_lived_and_differs_when_its_weights_do(run, tmp_path):
    """Results files name a trained drafter by ``drafter_hash``: a run retrained or moved elsewhere (its
    ``config.json`` names its output and cache paths) or resumed (optimizer, RNG, step) is the same drafter; its
    weights or its own JSON are not."""
    import json
    import shutil

    from specframe import bench

    target, out = run
    original = ckpt.resolve(out)
    first = bench.checkpoint_method(out, open_drafter(out).target_config).checkpoint_hash
    moved = tmp_path / "elsewhere" / original.name
    shutil.copytree(original, moved)
    config = json.loads((moved / "config.json").read_text())
    config.update(output=str(tmp_path / "elsewhere"), cache=str(tmp_path / "cache"))
    (moved / "config.json").write_text(json.dumps(config))
    (moved / "rng.safetensors").write_bytes((moved / "rng.safetensors").read_bytes() + b" ")
    assert ckpt.drafter_hash(moved) == ckpt.drafter_hash(original) == first

    for name in ("drafter.json", "model.safetensors"):
        changed = tmp_path / name / original.name
        shutil.copytree(original, changed)
        data = bytearray((changed / name).read_bytes())
        data[-2] ^= 1  # inside a JSON value's text or the last weight's bytes
        (changed / name).write_bytes(bytes(data))
        assert ckpt.drafter_hash(changed) != first, name


def test_a_folder_that_is_not_a_training_checkpoint_is_hashed_whole(tmp_path):
    """An exported or foreign drafter's ``config.json`` is the drafter's own configuration: it counts."""
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "config.json").write_text('{"block_size": 7}')
    first = ckpt.drafter_hash(folder)
    (folder / "config.json").write_text('{"block_size": 8}')
    assert ckpt.drafter_hash(folder) != first


def test_a_refused_verifier_replaces_nothing(tmp_path):
    """``--verifier`` applies to speculators layouts only, and which layout a drafter writes is known once it is
    written: the export is staged beside ``--output`` and moved into place only when the layout takes the verifier,
    so a refused command leaves the folder a user already had as it was (and no staging folder behind)."""
    from specframe.drafter_folders import export_checkpoint
    from specframe.layouts.export import read_manifest

    path = build_target(tmp_path / "t")
    config, tok = target_parts(path)
    cls = plugins.get("drafter", "eagle3")
    cls(config, cls.Options(layers=1, aux_layer_ids=AUX)).export_vllm(tmp_path / "eagle3", tok)
    cls = plugins.get("drafter", "pard")
    pard = cls(config, cls.Options(layers=1, init_from_target=False))
    pard.mask_token_id = mask_token(tok)
    pard.export_vllm(tmp_path / "pard", tok)

    out = tmp_path / "served"
    exported = export_checkpoint(tmp_path / "eagle3", out, verifier="my-verifier")
    assert exported.manifest.verifier == "my-verifier" == read_manifest(out).verifier
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SpecframeError, match=r"^--verifier applies to speculators exports \(dflash, dspark, eagle3, "
                                             r"peagle\), not pard$"):
        export_checkpoint(tmp_path / "pard", out, str(path), verifier="my-verifier")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eagle3", "pard", "served", "t"]


def test_export_notes_a_verifier_named_by_this_machines_path(tmp_path):
    """A speculators export names a local target by its absolute path (valid on this machine only): export says so on
    stderr; a hub id given with --verifier draws no note."""
    from click.testing import CliRunner

    from specframe.cli import main

    path = build_target(tmp_path / "t")
    config, tok = target_parts(path)
    cls = plugins.get("drafter", "eagle3")
    cls(config, cls.Options(layers=1, aux_layer_ids=AUX)).export_vllm(tmp_path / "eagle3", tok)
    source = ["export", "--checkpoint", str(tmp_path / "eagle3"), "--output"]
    local = CliRunner().invoke(main, [*source, str(tmp_path / "a")])
    assert local.exit_code == 0, local.output
    assert f"note: the export names its verifier by this machine's path {path.resolve()}" in local.stderr
    hub = CliRunner().invoke(main, [*source, str(tmp_path / "b"), "--verifier", "HuggingFaceTB/SmolLM2-135M-Instruct"])
    assert hub.exit_code == 0, hub.output
    assert "note:" not in hub.stderr


def test_the_refusal_of_an_unknown_folder_names_every_import_format(tmp_path):
    """What a folder must look like to be imported is read off the format table (``imports._FORMATS``), so a format
    added there is named in the refusal too (it listed 4 of 7 by hand)."""
    from specframe.errors import SpecframeError
    from specframe.layouts import imports

    (tmp_path / "config.json").write_text('{"architectures": ["SomethingElse"]}')
    with pytest.raises(SpecframeError) as info:
        imports._read(tmp_path, None)
    for fmt in imports._FORMATS:
        assert fmt.sign and f"{fmt.sign} ({fmt.name})" in str(info.value), fmt.name
