"""``specframe train --profile``: wall time per phase of training, printed at the end of the run.

Phases: ``data`` (a sequence's features, read from the cache or computed by the target, and its elements and
segments), ``forward`` (the drafter's forward, its loss excluded), ``loss`` (the loss kernels, teacher included; their
gradient is formed in the same pass, see ``specframe.drafting.modeling.chunked_forward_kl``), ``backward``, ``optimizer``
(unscale, clipping, AdamW and the schedule), ``eval`` and ``checkpoint``. A phase timed inside another (the loss
inside the drafter's forward) is subtracted from it, so the phases add up to the time they cover. On CUDA every
boundary synchronises the device, which costs a little throughput: the profile is for finding where time goes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

PHASES = ("data", "forward", "loss", "backward", "optimizer", "eval", "checkpoint")


class PhaseTimer:
    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device = device
        self.enabled = enabled
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._stack: list[list[float]] = []  # per open phase: [start, seconds of the phases nested in it]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._sync()
        frame = [time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._sync()
            self._stack.pop()
            spent = time.perf_counter() - frame[0]
            self.seconds[name] = self.seconds.get(name, 0.0) + spent - frame[1]
            if self._stack:
                self._stack[-1][1] += spent

    def report(self, steps: int, tokens: int) -> str:
        """A table of seconds, share and seconds per step for every phase, and the training tokens per second."""
        total = sum(self.seconds.values())
        lines = [f"profile: {steps} steps, {tokens} training tokens, {total:.2f} s in the phases below",
                 f"  {'phase':<11}{'seconds':>10}{'share':>8}{'s/step':>10}"]
        for name, sec in self.seconds.items():
            share = sec / total if total > 0 else 0.0
            lines.append(f"  {name:<11}{sec:>10.2f}{share:>8.1%}{sec / max(steps, 1):>10.3f}")
        train = sum(self.seconds[p] for p in ("data", "forward", "loss", "backward", "optimizer"))
        if train > 0:
            lines.append(f"  training tokens/s (data to optimizer): {tokens / train:,.1f}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, float]:
        return dict(self.seconds)
