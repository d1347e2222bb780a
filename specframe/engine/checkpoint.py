"""Atomic, pickle-free training checkpoints.

Layout of an output directory::

    OUT/train.lock            held (flock) by the run writing OUT
    OUT/config.json           the resolved run config
    OUT/metrics.jsonl         one JSON object per log / evaluation
    OUT/latest                name of the newest complete checkpoint
    OUT/kept/step-00000020/   a copy of an earlier checkpoint kept whole (``--keep-drafter-at``), never removed
    OUT/step-00000040/        one checkpoint: the drafter's own files (``Drafter.save``: weights safetensors +
                              JSON), config.json, optimizer.safetensors + optimizer.json, scheduler.json,
                              rng.safetensors, state.json (step, data position), and with --dtype fp16
                              scaler.json (the gradient scaler's scale and growth tracker)

A checkpoint is written into a temporary sibling, fsynced, renamed into place with ``os.replace``, and only then is
``latest`` switched (itself by ``os.replace``) and the previous checkpoint removed: a kill at any point leaves the
last good checkpoint intact. Saving a step whose folder ``latest`` already names points ``latest`` at the complete
staging copy before the old folder goes (``resolve`` follows it to the final name once renamed).
``rng.safetensors`` holds torch's CPU generator state and, with CUDA, every device's (uint8 tensors).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specframe.errors import SpecframeError, read_json
# the files layer's safety checks, also this module's names (the engine and its tests call them from here)
from specframe.files import PICKLE_SUFFIXES, check_files, check_safetensors  # noqa: F401

LATEST = "latest"
LOCK = "train.lock"


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory from either a checkpoint or a run output directory (its latest checkpoint)."""
    p = Path(path)
    if (p / "state.json").exists():
        return p
    if (p / LATEST).exists():
        name = (p / LATEST).read_text().strip()
        if not (p / name).exists() and name.startswith(".") and name.endswith(".tmp"):
            # a save replacing a checkpoint of the same step pointed `latest` at its complete staging copy and was
            # killed after renaming that copy into place: the checkpoint is under its final name
            name = name[1 : -len(".tmp")]
        if not (p / name / "state.json").exists():
            raise SpecframeError(f"{p / LATEST} names {name}, which is not a complete checkpoint in {p}")
        return p / name
    raise SpecframeError(f"{p} is neither a checkpoint nor a training output directory with a checkpoint")


#: A checkpoint's files that only resume training: the run's arguments (``config.json``, which names where the run
#: lived: its output and cache paths), the optimizer, LR schedule, RNG, gradient scaler and step. Drafting reads none.
TRAINING_STATE_FILES = frozenset({"config.json", "optimizer.safetensors", "optimizer.json", "scheduler.json",
                                  "rng.safetensors", "scaler.json", "state.json"})


def drafter_hash(directory: Path) -> str:
    """The identity of the drafter a folder holds, as results files record it (``sha256:<hex>``). For a training
    checkpoint, the files ``Drafter.save`` wrote (weights, the drafter's JSON): the same drafter trained in another
    folder, or moved, or resumed, hashes the same, which a hash of every file does not (``config.json`` holds the
    output path). Any other folder (an exported or foreign drafter, whose ``config.json`` is the drafter's own) is
    hashed whole."""
    from specframe.results import file_hash

    directory = Path(directory)
    return file_hash(directory, TRAINING_STATE_FILES if (directory / "state.json").exists() else frozenset())


def has_checkpoint(out: Path) -> bool:
    return (out / LATEST).exists()


class OutputLock:
    """An exclusive lock on an output directory; released by the OS when the process dies."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self._file = open(out / LOCK, "a+")  # noqa: SIM115 - held for the run's lifetime
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise SpecframeError(f"another training run is writing {out} (it holds {out / LOCK})") from None
        self._file.truncate(0)
        self._file.write(str(os.getpid()))
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")) + [root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, torch.Tensor]:
    """Every random generator training draws from, as uint8 tensors: torch's CPU generator and, where CUDA is
    available, each device's (the engine uses neither numpy's nor Python's ``random``)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda.{i}"] = s
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    cuda = [state[f"cuda.{i}"] for i in range(len(state)) if f"cuda.{i}" in state]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def optimizer_to_files(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any] | None = None,
                       ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state dict (``state_dict``, default the optimizer's own) into tensors (safetensors) and
    JSON scalars."""
    sd = optimizer.state_dict() if state_dict is None else state_dict
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{key}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_files(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    for pid, values in meta["scalars"].items():
        state.setdefault(int(pid), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


def save(
    out: Path,
    step: int,
    drafter: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    config: dict[str, Any],
    state: dict[str, Any],
    scaler: torch.amp.GradScaler | None = None,
    optimizer_state: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and make it the latest; the previous one is removed afterwards.
    ``scaler``: fp16's gradient scaler, whose scale (lowered on overflow, raised after a run of good steps) a
    resumed run must start from to take the steps the uninterrupted run takes. ``optimizer_state``: the state to
    write in place of ``optimizer.state_dict()`` (a sharded run's, gathered whole)."""
    final = out / step_name(step)
    tmp = out / f".{step_name(step)}.tmp"
    if has_checkpoint(out) and (out / LATEST).read_text().strip() == tmp.name:
        _finish_swap(out, tmp, final)  # an earlier save of this step was killed mid-swap: `latest` names tmp
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        drafter.save(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        tensors, meta = optimizer_to_files(optimizer, optimizer_state)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "optimizer.json").write_text(json.dumps(meta))
        (tmp / "scheduler.json").write_text(json.dumps(scheduler.state_dict()))
        save_file(rng_state(), str(tmp / "rng.safetensors"))
        if scaler is not None:
            (tmp / "scaler.json").write_text(json.dumps(scaler.state_dict()))
        (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=1))
        _fsync_tree(tmp)
    except OSError as exc:  # a full disk or a lost mount: the half-written copy goes, the last good one stays
        shutil.rmtree(tmp, ignore_errors=True)
        kept = (out / LATEST).read_text().strip() if has_checkpoint(out) else None
        raise SpecframeError(
            f"could not write checkpoint {final.name} in {out}: {exc.strerror or exc}; "
            + (f"the last checkpoint {kept} is intact" if kept else "no checkpoint was written")
        ) from exc
    # Every moment from here on leaves `latest` naming a complete checkpoint (tests/unit/test_checkpoint_consistency.py
    # kills the save after each filesystem operation): the old one is removed only after `latest` has moved on.
    previous = resolve(out) if has_checkpoint(out) else None
    if final.exists():  # a checkpoint of the same step: from an interrupted attempt, or the latest one itself
        if previous == final:
            # `latest` would name nothing between the removal and the rename: point it at the complete copy first
            atomic_write_text(out / LATEST, tmp.name)
            _finish_swap(out, tmp, final)
            return final
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(out / LATEST, final.name)
    if previous is not None and previous != final:
        shutil.rmtree(previous, ignore_errors=True)
    return final


KEPT = "kept"


def keep(out: Path, ckpt: Path) -> Path:
    """Copy the complete checkpoint ``ckpt`` to OUT/kept/<its name>, atomically: a copy is staged, fsynced and
    renamed into place, so a kill leaves either no kept folder for the step or a complete one (a staging copy left by
    a kill is replaced by the next attempt). A kept folder of the same step is replaced: a resumed run reaching the
    step again writes the same drafter (training is deterministic from its checkpoint)."""
    root = out / KEPT
    root.mkdir(exist_ok=True)
    final = root / ckpt.name
    tmp = root / f".{ckpt.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt, tmp)
    _fsync_tree(tmp)
    if final.exists():
        old = root / f".{ckpt.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    return final


def kept(out: Path) -> list[Path]:
    """The complete kept checkpoints of a run folder, by step."""
    root = Path(out) / KEPT
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("step-") and (p / "state.json").exists())


def _finish_swap(out: Path, tmp: Path, final: Path) -> None:
    """With `latest` naming the complete staging copy ``tmp``: put it under ``final``'s name (``resolve`` finds it
    there if a kill comes between the rename and the switch) and point `latest` at it."""
    if tmp.exists():
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    atomic_write_text(out / LATEST, final.name)


def load_training_state(
    directory: Path, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler | None = None,
) -> dict[str, Any]:
    """Restore optimizer, scheduler, RNG and (fp16) gradient-scaler state from a checkpoint; returns its
    ``state.json``. A checkpoint written without a scaler (another precision, or before scalers were saved) leaves
    ``scaler`` at its initial scale."""
    optimizer.load_state_dict(
        optimizer_from_files(
            load_file(str(directory / "optimizer.safetensors")),
            read_json(directory / "optimizer.json", "the checkpoint's optimizer state"),
        )
    )
    scheduler.load_state_dict(read_json(directory / "scheduler.json", "the checkpoint's LR scheduler state"))
    set_rng_state(load_file(str(directory / "rng.safetensors")))
    if scaler is not None and (directory / "scaler.json").exists():
        scaler.load_state_dict(read_json(directory / "scaler.json", "the checkpoint's gradient scaler state"))
    return read_json(directory / "state.json", "the checkpoint's training state")
