"""One file holds a whole training run: ``specframe train --config run.yaml`` (or ``.toml``, or a run's
``config.json``).

Top-level keys are ``TrainConfig`` fields (``seq-len`` or ``seq_len``), read generically from ``attrs.fields``, so a
field added to ``TrainConfig`` is a config key at once. The plugin option tables are ``drafter_options``,
``mask_builder_options`` and ``partitioner_options``; the older tables ``[drafter]``, ``[mask_builder]`` and
``[partitioner]`` still work as their aliases (a *string* under those keys is the plugin's name). A plugin's name may
carry its options inline (``--drafter peagle:layers=4,k_infer=3``, ``inline_options``), which go into its table over
the file's. Flags the user typed override the file; the file overrides ``TrainConfig``'s defaults.

``resolve`` fills what the plugin classes decide without loading the target: the training depth (the drafter's
``Drafter.training``), the mask builder for the device, and every plugin option's default. What only the target or the data
can decide stays ``null`` (``warmup_steps``: 10% of the steps; a drafter's ``aux_layer_ids``: from the target's layer
count; a ``draft_vocab_size`` of null is the target's whole vocabulary, and any size is clamped to it when the run
starts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from specframe.engine.config import TrainConfig
from specframe.errors import UsageError, did_you_mean
from specframe.structuring import structure, unstructure

if TYPE_CHECKING:
    from specframe.compose import ResolvedRun

#: option tables of the three trained plugin kinds: TrainConfig field -> the older table name (an alias)
PLUGIN_TABLES = {
    "drafter_options": "drafter", "mask_builder_options": "mask_builder", "partitioner_options": "partitioner",
}
#: keys the engine adds to OUTPUT/config.json (``Trainer.config_dict``) as a record of the run; a file named
#: config.json read back skips them (anywhere else they are unknown keys, so a typo such as ``steps`` is caught)
RECORD_KEYS = frozenset({
    "memory_budget_enforced", "world_size", "target_id", "target_weights_hash", "train_sequences", "val_sequences",
    "conversations", "steps", "changed_on_resume",
})
RUN_RECORD = "config.json"
#: filled only when the run starts (documented in ``--print-config``'s help and the YAML header)
UNRESOLVED_NOTE = (
    "null values are decided when the run starts: warmup_steps (10% of the steps), the run length\n"
    "when max_steps (and epochs) is null, mask_builder with device auto (the machine decides),\n"
    "plugin options that depend on the target (aux_layer_ids; draft_vocab_size: the target's whole vocabulary);\n"
    "draft_vocab_size is clamped to the target's vocabulary. data is null when a cache gives the features."
)


def fields() -> dict[str, attrs.Attribute]:
    return {a.name: a for a in attrs.fields(attrs.resolve_types(TrainConfig))}


def read_file(path: Path) -> dict[str, Any]:
    """The mapping in a TOML, YAML or JSON file (parse errors are one ``UsageError``)."""
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
        if suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
            data = {} if data is None else data
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise UsageError(f"--config {path}: use a .toml, .yaml, .yml or .json file")
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - tomllib, yaml and json raise their own error types
        message = " ".join(str(exc).split())
        if suffix == ".toml" and "Cannot overwrite" in message:
            message += " (a plugin name such as drafter = \"peagle\" and a [drafter] table clash: name the table " \
                       "[drafter_options], [mask_builder_options] or [partitioner_options])"
        raise UsageError(f"--config {path} is not valid: {message}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path} must hold keys and tables, got {type(data).__name__}")
    return data


def normalize(data: dict[str, Any], where: str, record: bool = False) -> dict[str, Any]:
    """File keys as ``TrainConfig`` field names: ``-`` becomes ``_``, the older plugin tables become the
    ``*_options`` fields, record keys of a run's ``config.json`` (``record``) are dropped; an unknown key is a
    ``UsageError``."""
    known = fields()
    aliases = {alias: table for table, alias in PLUGIN_TABLES.items()}
    out: dict[str, Any] = {}
    for raw, value in data.items():
        key = str(raw).replace("-", "_")
        if key in aliases and isinstance(value, dict):  # [drafter] table: the drafter's options
            key = aliases[key]
        elif record and key in RECORD_KEYS:
            continue
        if key not in known:
            raise UsageError(  # ~30 keys are too many to list in one line: point at the command that shows them
                f"{where}: unknown key '{raw}'{did_you_mean(key, [*known, *aliases])}; "
                "'specframe train --print-config' lists every key"
            )
        if key in out:
            raise UsageError(f"{where}: '{raw}' is given twice (as '{key}' and an alias)")
        out[key] = value
    return out


def load(path: str | Path) -> dict[str, Any]:
    """The run settings in ``path`` as ``TrainConfig`` field names (values not yet checked: see ``build``)."""
    path = Path(path)
    return normalize(read_file(path), f"--config {path}", record=path.name == RUN_RECORD)


def check_plugin_tables(values: dict[str, Any]) -> dict[str, Any]:
    """The older layout ``drafter_options`` / ``[drafter]`` must be tables: clear errors before structuring."""
    for table in PLUGIN_TABLES:
        if table in values and not isinstance(values[table], dict):
            raise UsageError(f"'{table}' must be a table of plugin options, got {values[table]!r}")
    return values


#: the plugin kind (``plugins.KINDS``) each name field of a run config holds
PLUGIN_KINDS = {"drafter": "drafter", "mask_builder": "mask builder", "partitioner": "partitioner"}


def inline_options(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each plugin named with its options inline (``drafter: peagle:layers=4``; ``compose.named``)
    split into the name and its table: the inline options go over the table's (the file's ``drafter_options``), as
    a flag goes over the file; values still text, typed by the plugin's ``Options`` when the run is resolved."""
    from specframe import compose

    out = dict(values)
    for field, kind in PLUGIN_KINDS.items():
        if not (isinstance(out.get(field), str) and ":" in out[field]):
            continue
        table = f"{field}_options"  # a table, checked before (check_plugin_tables)
        out[field], given = compose.named(kind, out[field])
        out[table] = {**out.get(table, {}), **given}
    return out


# -------------------------------------------------------------------------------------------- merging and building
#: pairs of settings of which a run takes one: a flag typed for one displaces the other from the file
ALTERNATIVES = (("data", "cache"), ("max_steps", "epochs"))


def merge(file_values: dict[str, Any], flag_values: dict[str, Any]) -> dict[str, Any]:
    """Typed flags over the file. Alternatives (``data`` / ``cache``, ``max_steps`` / ``epochs``): one typed as a
    flag displaces the other from the file; a cache without data (in either) means ``data = null``."""
    values = dict(file_values)
    for pair in ALTERNATIVES:
        for a, b in (pair, pair[::-1]):
            if flag_values.get(a) is not None and b not in flag_values:
                values.pop(b, None)
    values.update(flag_values)
    if values.get("cache") is not None and "data" not in values:
        values["data"] = None
    return values


def build(values: dict[str, Any], where: str = "--config") -> TrainConfig:
    """A ``TrainConfig`` from merged settings (plugin options inline split off: ``inline_options``), with one clear
    error for a missing, unknown or mistyped key."""
    values = inline_options(check_plugin_tables(values))
    for required in ("drafter", "output"):
        if values.get(required) is None:
            flag = f"--{required}"
            raise UsageError(f"missing {flag}: give the flag or the key '{required}' in --config")
    return structure(values, TrainConfig, where)


def resolve(cfg: TrainConfig, where: str | None = None) -> TrainConfig:
    """What the plugin classes decide, filled in without loading the target (``specframe.compose.plan``): every
    plugin option (checked: an unknown option or a bad value is a ``UsageError``, prefixed with ``where``), the
    training depth and the mask builder for the device."""
    return resolve_run(cfg, where).config


def resolve_run(cfg: TrainConfig, where: str | None = None) -> ResolvedRun:
    """``resolve``'s config beside the ``Plan`` it was resolved from (``compose.ResolvedRun``), which a run hands on
    (to the resume check and the engine, and the engine to the memory estimate) so that one ``train`` resolves its
    names once."""
    from specframe import compose

    return compose.ResolvedRun.of(cfg, where=where)


def _resolved(run: TrainConfig | ResolvedRun) -> ResolvedRun:
    from specframe import compose

    return run if isinstance(run, compose.ResolvedRun) else resolve_run(run)


def as_dict(cfg: TrainConfig) -> dict[str, Any]:
    return unstructure(cfg)


def dump(cfg: TrainConfig | dict[str, Any], fmt: str = "yaml") -> str:
    """The configuration as YAML (with a header comment) or JSON; ``--config`` reads either back unchanged."""
    data = as_dict(cfg) if isinstance(cfg, TrainConfig) else cfg
    if fmt == "json":
        return json.dumps(data, indent=1)
    import yaml

    header = "# specframe train --config FILE (flags typed with it override these values)\n"
    header += "".join(f"# {line}\n" for line in UNRESOLVED_NOTE.splitlines())
    return header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


# ------------------------------------------------------------------------------------------------------ resuming a run
#: the flag that resumes a run under settings other than those it was started with
ALLOW_CHANGED = "--allow-changed-settings"
#: the record key (in OUTPUT/config.json and each checkpoint's) listing every resume that changed settings
CHANGED_RECORD = "changed_on_resume"
#: settings a resumed run may change without ``ALLOW_CHANGED``: none of them changes the steps the run takes (the
#: loss, the gradients, the data and the learning-rate schedule). They say where it runs (the device, device_map,
#: FSDP or DDP at any world size: batch_size counts sequences over all ranks and checkpoints are in the one-process
#: format), how fast (data_workers, prefetch, the vLLM engine's size), what is logged, saved and guarded (output,
#: log_every, report_to, save_every, eval_every, keep_drafter_at, memory_budget), or how the same loss is computed:
#: every mask builder (and sized_attention's choice among them) builds the same visibility and a partition's segments add up to the one-pass gradient
#: (docs/design.md section 3), so those, like the device, change only the order of floating-point sums.
#: trust_remote_code only lets the same target load; init_from is read only when a run starts, never on resume.
#: Every other setting, a new one included, is compared: the features' engine too (vLLM's states pass a parity gate,
#: not an equality).
RESUME_FREE = frozenset({
    "output", "device", "device_map", "fsdp", "data_workers", "prefetch", "log_every", "report_to", "save_every",
    "eval_every", "keep_drafter_at", "memory_budget", "trust_remote_code", "init_from", "mask_builder",
    "mask_builder_options", "partitioner", "partitions", "partitioner_options", "gate_sequences", "vllm_kv_cache_gib",
    "vllm_tensor_parallel_size", "vllm_gpu_memory_utilization", "sized_attention",
})
#: settings that name a file or folder: the same path written another way is the same setting
PATH_SETTINGS = frozenset({"target", "data", "cache", "chat_template"})


def _same(name: str, old: Any, new: Any) -> bool:
    if old == new:
        return True
    if name in PATH_SETTINGS and isinstance(old, str) and isinstance(new, str):
        a, b = Path(old).expanduser(), Path(new).expanduser()
        return a.exists() and b.exists() and a.resolve() == b.resolve()
    return False


def resume_changes(recorded: dict[str, Any], cfg: TrainConfig | ResolvedRun) -> list[tuple[str, Any, Any]]:
    """(setting, recorded value, new value) for every setting outside ``RESUME_FREE`` in which ``cfg`` differs from a
    run's recorded config (a checkpoint's config.json). Plugin options are compared one by one (``drafter_options.
    layers``). ``cfg`` is resolved first, as the run's record was (the depth, every option's default), so the same
    flags, or a --config file or the record itself, compare equal. A setting the record lacks (added to specframe
    after the run started) is not compared. ``cfg`` may come resolved already (``resolve_run``)."""
    new = json.loads(json.dumps(as_dict(_resolved(cfg).config)))
    changes: list[tuple[str, Any, Any]] = []
    for name in fields():
        if name in RESUME_FREE or name not in recorded:
            continue
        old, value = recorded[name], new[name]
        if name in PLUGIN_TABLES and isinstance(old, dict) and isinstance(value, dict):
            changes += [(f"{name}.{key}", old[key], value[key]) for key in value
                        if key in old and not _same(f"{name}.{key}", old[key], value[key])]
        elif not _same(name, old, value):
            changes.append((name, old, value))
    return changes


def describe_changes(changes: list[tuple[str, Any, Any]]) -> str:
    """``--lr 0.001 -> 0.0003, drafter option layers 2 -> 3``: each setting as the command line names it."""
    def label(name: str) -> str:
        table, _, key = name.partition(".")
        if key:
            return f"{table.removesuffix('_options').replace('_', ' ')} option {key}"
        return "--" + name.replace("_", "-")

    return ", ".join(f"{label(name)} {json.dumps(old)} -> {json.dumps(new)}" for name, old, new in changes)


def check_resume(resume: str | Path, cfg: TrainConfig | ResolvedRun, allow_changed: bool = False,
                 ) -> tuple[Path, dict[str, Any], list[tuple[str, Any, Any]]]:
    """The checkpoint ``resume`` names, its recorded config and how ``cfg`` changes it; refused (before a target is
    loaded or a file written) when it is another drafter's, or when it changes a setting outside ``RESUME_FREE``
    without ``allow_changed``. ``cfg`` may come resolved already (``resolve_run``), else it is resolved here."""
    from specframe.engine import checkpoint
    from specframe.errors import SpecframeError, read_json

    directory = checkpoint.resolve(resume)
    checkpoint.check_files(directory)
    record = directory / RUN_RECORD
    saved = read_json(record, "the checkpoint's run config")
    run = _resolved(cfg)
    if saved.get("drafter") != run.config.drafter:
        raise SpecframeError(
            f"--resume {resume} is a checkpoint of drafter '{saved.get('drafter')}', not '{run.config.drafter}' "
            "(nothing was overwritten)"
        )
    changes = resume_changes(saved, run)
    if changes and not allow_changed:
        # a resume continues the run as it was started (its schedule, data and drafter); a new run from its weights
        # is a warm start
        raise UsageError(
            f"--resume {resume}: the run was started with other settings: {describe_changes(changes)} (nothing was "
            f"written); resume it with its own (--config {record} gives them), pass {ALLOW_CHANGED} to continue "
            "under the new ones, or warm start a new run from an export of it with --init-from"
        )
    return directory, saved, changes
