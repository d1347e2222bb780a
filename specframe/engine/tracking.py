"""Experiment trackers (``--report-to``): TensorBoard and Weights & Biases behind one small interface.

``metrics.jsonl`` in the output directory always has every number; a tracker mirrors them to a dashboard. A tracker
that was asked for but whose library is not installed is a ``UsageError`` raised by ``check_available`` before the
run writes anything, never a silent no-op. Only rank 0 opens trackers.

What is logged: every metrics entry's numbers as scalars under their ``metrics.jsonl`` keys (``train_loss``,
``tokens_per_second``, ``peak_memory_bytes``, ``lr``, ``grad_norm``, ``val_loss``, ``val_expected_al``, ...), lists
one scalar per depth (``val_accuracy/depth0``, ...), and the resolved configuration once (TensorBoard: a text
summary ``config``; W&B: the run's ``config``). W&B reads its mode from the environment (``WANDB_MODE=offline``
writes the run under ``OUTPUT/wandb`` without a network), its project from ``WANDB_PROJECT`` (default
``specframe``).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

from specframe.errors import UsageError, did_you_mean
from specframe.values import is_number

#: tracker name -> (module that must import, pip extra that installs it)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def parse_report_to(value: Any) -> list[str]:
    """The trackers a ``--report-to`` value names: a comma list of ``none``, ``tensorboard``, ``wandb``."""
    if not isinstance(value, str):
        raise UsageError(f"--report-to must be a comma list of none, tensorboard, wandb, got {value!r}")
    names: list[str] = []
    for raw in value.split(","):
        name = raw.strip().lower()
        if name in ("", "none"):
            continue
        if name not in TRACKERS:
            raise UsageError(
                f"--report-to: unknown tracker '{raw.strip()}'{did_you_mean(name, list(TRACKERS))} "
                f"(known: none, {', '.join(TRACKERS)})"
            )
        if name not in names:
            names.append(name)
    return names


def _import(module: str) -> Any:
    return importlib.import_module(module)


def check_available(names: list[str]) -> None:
    """Raise one ``UsageError`` naming every requested tracker whose library does not import."""
    missing = []
    for name in names:
        module, extra = TRACKERS[name]
        try:
            _import(module)
        except ImportError:
            missing.append((name, module, extra))
    if missing:
        what = ", ".join(name for name, _, _ in missing)
        install = " ".join(module for _, module, _ in missing)
        extras = ",".join(extra for _, _, extra in missing)
        raise UsageError(
            f"--report-to {what}: not installed; pip install {install} (or specframe[{extras}]), or drop it from "
            "--report-to (nothing was written)"
        )


def scalars(entry: dict[str, Any]) -> dict[str, float]:
    """The numbers of one metrics entry as flat scalar tags (lists become ``key/depthN``)."""
    out: dict[str, float] = {}
    for key, value in entry.items():
        if key in ("step", "time") or value is None or isinstance(value, bool | str):
            continue
        if isinstance(value, list | tuple):
            for d, v in enumerate(value):
                if is_number(v):
                    out[f"{key}/depth{d}"] = float(v)
        elif isinstance(value, int | float):
            out[key] = float(value)
    return out


class Tracker:
    """One experiment tracker: ``log`` a metrics entry at a step, ``close`` at the end."""

    def log(self, entry: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    def __init__(self, out: Path, config: dict[str, Any], start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run discards the events a killed run logged after its last checkpoint (metrics.jsonl does too)
        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        if not start_step:
            self.writer.add_text("config", "```json\n" + json.dumps(config, indent=1) + "\n```", 0)

    def log(self, entry: dict[str, Any], step: int) -> None:
        for tag, value in scalars(entry).items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, out: Path, config: dict[str, Any], start_step: int) -> None:
        wandb = _import("wandb")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "specframe"), name=out.name or None, dir=str(out),
            config=config, mode=os.environ.get("WANDB_MODE") or None,
        )

    def log(self, entry: dict[str, Any], step: int) -> None:
        self.run.log(scalars(entry), step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers(Tracker):
    """Every tracker ``--report-to`` names, as one."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, entry: dict[str, Any], step: int) -> None:
        for t in self.trackers:
            t.log(entry, step)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


def open_trackers(names: list[str], out: Path, config: dict[str, Any], start_step: int = 0) -> Trackers:
    """The trackers ``names`` writing under ``out`` (call ``check_available`` first)."""
    kinds = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}
    opened: list[Tracker] = []
    try:
        for name in names:
            opened.append(kinds[name](out, config, start_step))
    except BaseException:
        Trackers(opened).close()
        raise
    return Trackers(opened)
