"""The options every command that loads a target shares: ``--device``, ``--dtype``, ``--trust-remote-code``,
``--chat-template`` and ``--device-map``, collected into one ``TargetLoading`` so each command loads its target the same way."""

from __future__ import annotations

import functools
from typing import Any

import attrs
import click

from specframe.devices import DTYPES


@attrs.frozen
class TargetLoading:
    device: str = "auto"
    dtype: str = "fp32"
    trust_remote_code: bool = False
    chat_template: str | None = None
    device_map: str | None = None

    def load(self, spec: str, *, weights: bool = True) -> Any:
        from specframe.devices import resolve_device
        from specframe.targets import load_target

        return load_target(spec, dtype=self.dtype, device=resolve_device(self.device),
                           trust_remote_code=self.trust_remote_code, chat_template=self.chat_template,
                           device_map=self.device_map, weights=weights)


OPTIONS = [
    click.option("--device", default="auto", show_default=True,
                 help="Torch device of the target (auto: CUDA when available, else cpu; under torchrun 'cuda' is the "
                      "process's LOCAL_RANK GPU)."),
    click.option("--dtype", type=click.Choice(list(DTYPES)), default="fp32", show_default=True,
                 help="Dtype of the target's weights. fp32 keeps speculative output token-for-token equal to plain "
                      "decoding on the reference engine; bf16 is faster and smaller."),
    click.option("--trust-remote-code", is_flag=True,
                 help="Run the model repository's own Python code (off unless given: only for targets you trust)."),
    click.option("--chat-template", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="A Jinja chat template file replacing the tokenizer's."),
    click.option("--device-map", default=None,
                 help="Spread a target too large for one GPU over every visible GPU (and the CPU): transformers' "
                      "device_map (auto, balanced, sequential), in place of --device; one process, layer by layer."),
]


def target_loading(fn):
    """Add the shared target options to a click command; it receives them as ``loading: TargetLoading``."""

    @functools.wraps(fn)
    def wrapper(*args, device: str, dtype: str, trust_remote_code: bool, chat_template: str | None,
                device_map: str | None, **kwargs):
        return fn(*args, loading=TargetLoading(device, dtype, trust_remote_code, chat_template, device_map), **kwargs)

    for option in reversed(OPTIONS):
        wrapper = option(wrapper)
    return wrapper
