"""What a run shows while it trains: a rich progress bar on a terminal, or plain lines (``ProgressLines``) for logs
and pipes. Both read what the loop hands them (a ``RunSummary`` at the start, each step's and evaluation's record),
never the trainer itself."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs


@attrs.frozen
class RunSummary:
    """What the first progress line says about a run."""

    batch_size: int
    seq_len: int
    pack: bool
    conversations: int
    train_sequences: int
    val_sequences: int
    #: online features from another engine: "features from ENGINE: the check they passed", else None
    features: str | None = None


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class ProgressLines:
    """Plain progress lines (no terminal needed): one every ``every`` steps and at the last step, with the loss,
    the training throughput since the previous line and the time left at the run's average pace so far."""

    def __init__(self, emit: Callable[[str], None] | None, total: int, first_step: int, every: int) -> None:
        self.emit, self.total, self.every = emit, total, every
        self.first_step = first_step
        self.started = self.last_time = time.perf_counter()
        self.tokens = 0

    def start(self, run: RunSummary) -> None:
        if self.emit is None:
            return
        packed = "packed into" if run.pack else "as"
        resumed = f", resuming at step {self.first_step}" if self.first_step else ""
        self.emit(
            f"training {self.total} steps of {run.batch_size} sequences: {run.conversations} "
            f"conversations {packed} {run.train_sequences} training + {run.val_sequences} validation "
            f"sequences of at most {run.seq_len} tokens{resumed}"
        )
        if run.features is not None:
            self.emit(run.features)

    def step(self, entry: dict[str, Any]) -> None:
        if self.emit is None:
            return
        self.tokens += int(entry.get("tokens") or 0)
        step = int(entry["step"])
        if step % self.every and step != self.total:
            return
        now = time.perf_counter()
        rate = self.tokens / max(now - self.last_time, 1e-9)
        done = step - self.first_step
        eta = (now - self.started) / max(done, 1) * (self.total - step)
        loss = entry.get("train_loss")
        self.emit(
            f"step {step}/{self.total}  loss {'n/a' if loss is None else f'{loss:.4f}'}  {rate:,.0f} tokens/s  "
            f"elapsed {_duration(now - self.started)}  ETA {_duration(eta)}"
        )
        self.last_time, self.tokens = now, 0

    def emit_line(self, line: str) -> None:
        if self.emit is not None:
            self.emit(line)

    def evaluation(self, ev: dict[str, Any]) -> None:
        if self.emit is None:
            return
        accs = " ".join(f"{a:.3f}" for a in ev["val_accuracy"])
        self.emit(f"eval step {ev['step']}  val loss {ev['val_loss']:.4f}  top-1 by depth {accs}  "
                  f"expected AL {ev['val_expected_al']:.3f}")

    def calibration(self, record: dict[str, Any]) -> None:
        """The line of a confidence calibration's record (``engine.evaluation.calibrate``)."""
        self.emit_line(f"calibrated the confidence on {record['calibration_anchors']} held-out anchors: "
                       f"prefix ECE {record['confidence_ece_before']:.4f} -> "
                       f"{record['confidence_ece_after']:.4f}"
                       + (" (on the chains it was fitted on)" if record["calibration_in_sample"] else
                          f" (on {record['calibration_checked_anchors']} anchors of other sequences)"))


def progress_bar(enabled: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), disable=not enabled
    )
