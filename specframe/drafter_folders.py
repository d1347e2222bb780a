"""One way in to a drafter folder, whatever wrote it.

A folder holding a drafter is one of two kinds: specframe's own (a training checkpoint, or a run folder whose
``latest`` names one: ``engine.checkpoint``'s layout), or a foreign layout ``specframe.layouts.imports`` reads
(speculators EAGLE-3 / P-EAGLE / DFlash / DSpark, SafeAILab and SpecForge EAGLE-3 / P-EAGLE, PARD, specframe's own
exports). ``open_drafter`` decides which, once, and gives everything a caller needs: the drafter, the
folder it came from, the kind, the target it belongs to and that target's tokenizer. ``bench``, ``generate``,
``export``, ``serve`` and the benchmarks all come in here; ``load_drafter`` is the same for a caller that holds the
target's config already (the trainer's memory probe, tests).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

from specframe.errors import SpecframeError, read_json

#: the kind of a specframe training checkpoint or run folder; a foreign folder's kind is its ``imports.FORMATS`` name
CHECKPOINT = "checkpoint"


@attrs.frozen
class OpenDrafter:
    """A drafter opened from its folder, with where it came from."""

    drafter: Any
    #: the folder the weights were read from: a run folder's latest checkpoint, or the foreign folder itself
    directory: Path
    #: ``CHECKPOINT`` or the foreign layout (``specframe.layouts.imports.FORMATS``)
    kind: str
    #: the loadable target (folder or hub id; the packaged default converted) and its config and tokenizer
    target_source: str
    target_config: Any
    tokenizer: Any


def locate(path: str | os.PathLike) -> tuple[str, Path]:
    """The folder's kind (``CHECKPOINT`` or its foreign layout) and the folder its weights are read from (a run
    folder's latest checkpoint, else ``path`` itself), decided in one look; one clear error when it is neither."""
    from specframe.engine import checkpoint as ckpt
    from specframe.layouts import imports

    if not Path(path).exists():
        raise SpecframeError(f"checkpoint {path} does not exist")
    fmt = imports.format_of(path)
    if fmt is not None:
        return fmt, Path(path)
    return CHECKPOINT, ckpt.resolve(path)  # resolve raises, naming what the folder lacks, when it is no checkpoint


def folder_kind(path: str | os.PathLike) -> str:
    """``CHECKPOINT`` or the foreign layout of the folder at ``path``."""
    return locate(path)[0]


def weights_folder(path: str | os.PathLike) -> Path:
    """The folder the drafter's weights are read from: a run folder's latest checkpoint, else ``path`` itself."""
    return locate(path)[1]


def recorded_target(path: str | os.PathLike) -> str | None:
    """The target the folder names: the run config's ``target`` of a checkpoint, the verifier a speculators config
    names; None when it names none."""
    return _recorded_target(*locate(path))


def _recorded_target(kind: str, directory: Path) -> str | None:
    from specframe.layouts import imports

    if kind != CHECKPOINT:
        return imports.named_target(directory)
    config = directory / "config.json"
    if not config.exists():
        return None
    target = read_json(config, "the checkpoint's run config").get("target")
    return str(target) if target else None


def load_drafter(path: str | os.PathLike, target_config: Any, tokenizer: Any = None) -> Any:
    """The drafter the folder at ``path`` holds, built for ``target_config`` and loaded with its weights (a foreign
    folder is checked against the target and, when given or found beside the target, its tokenizer)."""
    return _load_drafter(*locate(path), target_config, tokenizer)


def _load_drafter(kind: str, directory: Path, target_config: Any, tokenizer: Any) -> Any:
    from specframe import compose, plugins
    from specframe.files import check_files
    from specframe.layouts import imports

    if kind == CHECKPOINT:
        check_files(directory)
        config = read_json(directory / "config.json", "the checkpoint's run config")
        drafter = compose.component("drafter", config["drafter"], config.get("drafter_options", {}), target_config)
        drafter.load(directory)
        return drafter
    imported = imports.read(directory, target_config)
    tokenizer = tokenizer if tokenizer is not None else imports.target_tokenizer(target_config)
    if tokenizer is not None:
        try:
            imports.check_tokenizer(imported.directory, tokenizer)
        except SpecframeError as e:
            raise SpecframeError(f"cannot import {directory}: {e}") from None
    # the options the drafter declares for the folder's shape (``Drafter.import_options``), structured as any other
    drafter = compose.component("drafter", imported.plugin, plugins.get("drafter", imported.plugin).import_options(
        imported), target_config)
    drafter.import_weights(imported)
    return drafter


def open_drafter(path: str | os.PathLike, target: str | None = None) -> OpenDrafter:
    """Open the drafter folder at ``path`` for ``target`` (default: the target the folder names). The drafter is as
    loaded; one that is run, not exported, goes into eval mode first (``bench.checkpoint_method``)."""
    from transformers import AutoConfig, AutoTokenizer

    from specframe.targets import target_source

    kind, directory = locate(path)
    if target is None:
        target = _recorded_target(kind, directory)
        if not target:
            raise SpecframeError(f"{directory} does not record its target; pass --target")
    source = target_source(target)
    try:
        target_config = AutoConfig.from_pretrained(source)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise SpecframeError(f"cannot load target '{target}': {exc}") from exc
    drafter = _load_drafter(kind, directory, target_config, tokenizer)
    return OpenDrafter(drafter=drafter, directory=directory, kind=kind, target_source=source,
                       target_config=target_config, tokenizer=tokenizer)


@attrs.frozen
class Exported:
    """What ``export_checkpoint`` wrote: the export's manifest (as its ``config.json`` says, written once) and where
    it came from."""

    manifest: Any
    #: the export folder, absolute
    output: str
    #: the loadable target the drafter was exported for
    target: str
    #: the folder the drafter's weights were read from
    checkpoint: str

    def as_dict(self) -> dict[str, Any]:
        """The manifest's fields plus ``output``, ``target`` and ``checkpoint`` (what ``specframe export --json``
        prints)."""
        return {**self.manifest.as_dict(), "output": self.output, "target": self.target, "checkpoint": self.checkpoint}


def export_checkpoint(
    checkpoint: str | Path,
    output: str | Path,
    target: str | None = None,
    *,
    verifier: str | None = None,
    k: int | None = None,
) -> Exported:
    """Export the drafter of ``checkpoint`` (a checkpoint, a run's output folder or an importable foreign folder) to
    ``output`` for vLLM; the target defaults to the one the run trained against. A speculators export names
    ``verifier`` (default: the target) and drafts ``k`` tokens (default: the drafter's): the drafter's
    ``export_vllm`` is handed that ``Serving`` and writes ``config.json`` once with it. Returns the ``Exported``
    (the writer's manifest, ``output``, ``target`` and ``checkpoint``)."""
    from specframe.layouts import export

    if k is not None and k < 1:
        raise SpecframeError(f"--k must be positive, got {k}")
    opened = open_drafter(checkpoint, target)
    drafter, source = opened.drafter, opened.target_source
    serving = export.Serving(verifier=verifier or export.verifier_name(source), speculative_tokens=k)
    output = Path(output)
    if verifier is None:
        manifest = write_export(drafter, output, opened.tokenizer, serving)
    else:
        manifest = _staged_speculators_export(drafter, output, opened.tokenizer, serving)
    return Exported(manifest=manifest, output=str(Path(output).resolve()), target=source,
                    checkpoint=str(opened.directory))


def _staged_speculators_export(drafter: Any, output: Path, tokenizer: Any, serving: Any) -> Any:
    """``write_export`` for an explicit ``--verifier``, which only a speculators layout takes. The layout is known
    once the drafter has written its export, so it is written beside ``output`` first and moved into place only if
    the layout takes the verifier: a refused command leaves ``output`` as it was."""
    import shutil
    import tempfile

    from specframe.layouts import table
    from specframe.layouts.writing import replace_dir

    output.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.", suffix=".stage"))
    try:
        manifest = write_export(drafter, stage / "export", tokenizer, serving)
        if not manifest.speculators:
            raise SpecframeError(f"--verifier applies to speculators exports "
                                 f"({', '.join(sorted(table.speculators()))}), not {manifest.layout}")
        replace_dir(stage / "export", output)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return manifest


def takes_serving(export_vllm: Any) -> bool:
    """Whether a drafter's ``export_vllm`` takes the ``serving`` choice (API 14), read from its signature: an API 13
    drafter's has only ``directory`` and ``tokenizer``."""
    import inspect

    try:
        parameters = inspect.signature(export_vllm).parameters.values()
    except (TypeError, ValueError):  # a callable whose signature cannot be read: called the API 13 way, which works
        return False
    return any(p.name == "serving" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def write_export(drafter: Any, output: Path, tokenizer: Any, serving: Any) -> Any:
    """Write ``drafter``'s vLLM export to ``output`` with the ``serving`` choice and return its ``Manifest``. An API
    14 drafter writes ``config.json`` once, with the choice; an API 13 one (``takes_serving`` false) writes its own
    guesses, which a speculators export then has re-targeted (``set_serving``, as every export was up to API 13).
    The manifest a drafter returns may be a ``Manifest`` or, from an API 13 drafter, its dict."""
    from specframe.layouts import export

    if takes_serving(drafter.export_vllm):
        manifest = _manifest(drafter, drafter.export_vllm(output, tokenizer, serving=serving))
    else:
        manifest = _manifest(drafter, drafter.export_vllm(output, tokenizer))
        if manifest.layout in export.SPECULATORS:
            manifest = export.set_serving(output, verifier=serving.verifier, speculative_tokens=serving.speculative_tokens)
    return manifest


def _manifest(drafter: Any, returned: Any) -> Any:
    """The ``Manifest`` an ``export_vllm`` returned (a dict with ``method``, from an API 13 drafter, taken as one);
    anything else is refused, naming the drafter."""
    from collections.abc import Mapping

    from specframe.layouts.export import Manifest

    if isinstance(returned, Manifest):
        return returned
    if not isinstance(returned, Mapping) or "method" not in returned:
        raise SpecframeError(f"drafter '{drafter.name}' export_vllm returned {returned!r}, not a layout manifest")
    return Manifest.from_mapping(returned)
