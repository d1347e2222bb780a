"""An export is written once (issue 55, item 3; API 14): ``Drafter.export_vllm`` is handed the ``Serving`` the user
chose and its layout's writer writes ``config.json`` once with it, without reading the folder back, and returns the
``Manifest``; a drafter written for API 13 (no ``serving`` parameter) still exports with the user's verifier and K;
the lists of writers and import formats in the API's docstrings are the layout table's (fast, no vLLM)."""

from __future__ import annotations

import inspect
import json
import re
import types
from pathlib import Path

import pytest

from specframe import api, plugins
from specframe.drafter_folders import takes_serving, write_export
from specframe.errors import SpecframeError
from specframe.layouts import export, imports, table
from specframe.layouts.manifest import Manifest, Serving
from specframe.testing import training_example

ROOT = Path(__file__).resolve().parents[2]

#: small options per built-in drafter (those of benchmarks/same_outputs.py), and a number of draft tokens each serves
OPTIONS = {
    "eagle3": ({"layers": 1, "draft_vocab_size": 128, "aux_layer_ids": [1, 2, 3]}, 2),
    "peagle": ({"layers": 1, "draft_vocab_size": 128, "aux_layer_ids": [1, 2, 3], "k_train": 3}, 2),
    "pard": ({"layers": 1, "k_train": 3}, 2),
    "parallelspec": ({"draft_vocab_size": 128, "k_train": 3}, 2),
    "dflash": ({"layers": 2, "aux_layer_ids": [1, 3], "block_size": 4}, 3),
    "dspark": ({"layers": 2, "aux_layer_ids": [1, 3], "block_size": 4, "markov_rank": 8}, 4),
}


def prepared(name: str, target) -> api.Drafter:
    """The drafter ``name`` built on the tiny target and prepared as training prepares it (mask tokens, draft
    vocabulary), ready to export."""
    if name not in plugins.load().names("drafter"):
        pytest.skip(f"drafter {name} is not installed")
    cls = plugins.get("drafter", name)
    drafter = cls(target.config, cls.Options(**OPTIONS[name][0]))
    training_example(target, drafter)
    return drafter


class ConfigAccess:
    """Counts the opens for writing and for reading of the ``config.json`` of the export at ``out`` (or of the
    temporary folder the writer fills beside it: ``.NAME.*``): every Python open goes through ``io.open`` (pathlib's
    ``write_text`` / ``read_text`` too) or the builtin ``open``."""

    def __init__(self, monkeypatch, out: Path) -> None:
        import builtins
        import io

        self.out, self.writes, self.reads = out, 0, 0

        def mine(path) -> bool:
            if not isinstance(path, (str, Path)):
                return False
            path = Path(path)
            folder = path.parent
            return (path.name.startswith("config.json") and folder.parent == out.parent
                    and (folder.name == out.name or folder.name.startswith(f".{out.name}.")))

        def counting(real):
            def counted(file, mode="r", *args, **kwargs):
                if mine(file):
                    if any(c in mode for c in "wax+"):
                        self.writes += 1
                    else:
                        self.reads += 1
                return real(file, mode, *args, **kwargs)
            return counted

        monkeypatch.setattr(io, "open", counting(io.open))
        monkeypatch.setattr(builtins, "open", counting(builtins.open))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_one_export_writes_its_config_json_once_with_the_users_choice(name, specframe_tiny_target, tmp_path,
                                                                      monkeypatch):
    target = specframe_tiny_target
    drafter = prepared(name, target)
    assert takes_serving(drafter.export_vllm)
    out = tmp_path / name
    k = OPTIONS[name][1]
    access = ConfigAccess(monkeypatch, out)
    manifest = write_export(drafter, out, target.tokenizer, Serving(verifier="org/chosen", speculative_tokens=k))
    assert (access.writes, access.reads) == (1, 0), f"{name}: config.json written {access.writes}x, read {access.reads}x"
    monkeypatch.undo()
    assert isinstance(manifest, Manifest) and manifest.layout == name
    assert manifest == export.read_manifest(out)  # the writer's manifest is the folder's
    if manifest.speculators:
        assert (manifest.verifier, manifest.speculative_tokens) == ("org/chosen", k)
    else:  # vLLM takes the target and K from its command line for these layouts
        assert (manifest.verifier, manifest.speculative_tokens) == (None, None)
    assert export.check_export(out, target.config) == manifest


def test_a_number_of_draft_tokens_the_export_cannot_serve_is_refused_before_anything_is_written(
        specframe_tiny_target, tmp_path):
    drafter = prepared("dflash", specframe_tiny_target)
    out = tmp_path / "dflash"
    with pytest.raises(SpecframeError, match=r"cannot serve this dflash export at 2 draft tokens per step"):
        drafter.export_vllm(out, specframe_tiny_target.tokenizer, serving=Serving(speculative_tokens=2))
    assert not out.exists() and not list(tmp_path.iterdir())


def test_an_api_13_drafter_still_exports_with_the_users_verifier_and_k(specframe_tiny_target, tmp_path, monkeypatch):
    """A drafter whose ``export_vllm`` has no ``serving`` parameter and returns the dict writers returned up to API 13
    writes its own guesses; the core re-targets the folder with the user's choice, as every export was before."""
    target = specframe_tiny_target
    built = prepared("eagle3", target)

    def api13_export_vllm(self, directory, tokenizer):
        return type(self).export_vllm(self, directory, tokenizer).as_dict()

    old = prepared("eagle3", target)
    old.model.load_state_dict(built.model.state_dict())
    old.export_vllm = types.MethodType(api13_export_vllm, old)
    assert not takes_serving(old.export_vllm)
    access = ConfigAccess(monkeypatch, tmp_path / "old")
    manifest = write_export(old, tmp_path / "old", target.tokenizer, Serving(verifier="org/chosen", speculative_tokens=2))
    assert access.writes == 2  # written with its guesses, then re-targeted (what the counter above sees once)
    monkeypatch.undo()
    assert isinstance(manifest, Manifest)
    assert (manifest.verifier, manifest.speculative_tokens) == ("org/chosen", 2) == (
        export.read_manifest(tmp_path / "old").verifier, export.read_manifest(tmp_path / "old").speculative_tokens)
    # the same folder as an API 14 drafter writes at once
    new = write_export(built, tmp_path / "new", target.tokenizer, Serving(verifier="org/chosen", speculative_tokens=2))
    assert new == manifest
    assert (tmp_path / "old" / "config.json").read_bytes() == (tmp_path / "new" / "config.json").read_bytes()
    assert (tmp_path / "old" / "model.safetensors").read_bytes() == (tmp_path / "new" / "model.safetensors").read_bytes()

    old.export_vllm = lambda directory, tokenizer: "done"
    with pytest.raises(SpecframeError, match="drafter 'eagle3' export_vllm returned 'done', not a layout manifest"):
        write_export(old, tmp_path / "broken", target.tokenizer, Serving())


def test_re_targeting_a_dspark_export_changes_only_its_serving_fields(specframe_tiny_target, tmp_path):
    """set_serving (re-targeting a folder in place) rewrites the verifier and K, and nothing else: the calibration in
    the ``specframe`` entry stays there (its round trip used to copy it into the layer config)."""
    drafter = prepared("dspark", specframe_tiny_target)
    drafter.confidence_temperature, drafter.calibration_rule = [1.5, 1.0, 1.0, 1.0], "greedy"
    out = tmp_path / "dspark"
    drafter.export_vllm(out, specframe_tiny_target.tokenizer, serving=Serving(verifier="org/a"))
    before = json.loads((out / "config.json").read_text())
    export.set_serving(out, verifier="org/b")
    after = json.loads((out / "config.json").read_text())
    assert after["speculators_config"]["verifier"]["name_or_path"] == "org/b"
    after["speculators_config"]["verifier"]["name_or_path"] = "org/a"
    assert after == before


def test_a_manifest_answers_as_the_api_13_dict_did(tmp_path):
    from tests.vllm_fixtures import build_drafter, build_target

    written = export.write_pard  # every writer returns the Manifest
    assert inspect.signature(written).return_annotation in (Manifest, "Manifest")
    target = build_target(tmp_path / "target")
    build_drafter("eagle3", target, tmp_path / "e", k=3)
    manifest = export.read_manifest(tmp_path / "e")
    assert manifest["layout"] == manifest.layout == "eagle3" and manifest.get("speculative_tokens") == 3
    assert manifest.get("nothing", "x") == "x"
    with pytest.raises(KeyError):
        manifest["nothing"]
    assert dict(manifest) == {**manifest} == manifest.as_dict()
    assert Manifest.from_mapping({**manifest.as_dict(), "extra": 1}) == manifest


def test_serve_builds_its_command_from_the_manifest_it_is_handed(tmp_path, monkeypatch):
    from specframe.vllm import serving
    from tests.vllm_fixtures import build_drafter, build_target

    target = build_target(tmp_path / "target")
    out = build_drafter("pard", target, tmp_path / "pard")
    config = export.read_config(out)
    manifest = export.manifest_of(config, out)

    def no_read(*args):
        raise AssertionError("the command builder read the export again")

    monkeypatch.setattr(serving, "read_config", no_read)
    monkeypatch.setattr(serving, "manifest_of", no_read)
    argv, _ = serving.serve_command(str(target), out, 3, manifest=manifest, config=config)
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == manifest.speculative_config(out, 3)


# ------------------------------------------------------------------------------ the lists kept to the layout table


def _writers(text: str) -> set[str]:
    return set(re.findall(r"\bwrite_[a-z0-9_]+", text))


def test_the_apis_lists_of_writers_and_import_formats_are_the_tables():
    writers = {f"write_{name}" for name in table.names()}
    assert all(hasattr(export, w) for w in writers)
    api_source = (ROOT / "specframe" / "api.py").read_text()
    assert _writers(api_source) == writers, "specframe/api.py's comment on vllm_layouts names other writers"
    assert _writers(inspect.getdoc(api.Drafter.export_vllm)) == writers
    doc = " ".join(inspect.getdoc(api.Drafter.import_weights).split())
    listed = re.search(r"\(``imports.FORMATS``\): (.*?);", doc)
    assert listed, "Drafter.import_weights no longer lists the import formats"
    assert tuple(re.findall(r"``([a-z0-9-]+)``", listed.group(1))) == imports.FORMATS
    config_source = " ".join((ROOT / "specframe" / "engine" / "config.py").read_text().split())
    comment = re.search(r"#: warm start: (.*?) init_from:", config_source)
    assert comment, "TrainConfig.init_from's comment moved"
    for name in imports.FORMATS:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", comment.group(1)), f"--init-from comment lacks {name}"


def test_the_train_help_names_every_import_format():
    from click.testing import CliRunner

    from specframe.cli import main

    result = CliRunner().invoke(main, ["train", "--help"])
    assert result.exit_code == 0, result.output
    # click wraps the help at hyphens too ("peagle-" / "flat")
    text = " ".join(re.sub(r"(?<=\w-)\n\s*", "", result.output).split())
    for name in imports.FORMATS:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"`train --help` does not name format {name}"
