"""``--dtype`` of training: how a step's forward is autocast and its loss scaled, apart from the loop that calls it."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class Precision:
    """``--dtype`` of training: autocast to bf16 / fp16 over fp32 master weights (AdamW state stays fp32, and the
    drafters' losses take log-softmax in fp32); fp16 adds torch's gradient scaler. fp32 changes nothing."""

    def __init__(self, name: str, device: torch.device) -> None:
        from specframe.devices import torch_dtype

        self.name = name
        self.device = device
        self.dtype = torch_dtype(name)
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None

    def autocast(self) -> Any:
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()
