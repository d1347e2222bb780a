"""The target's sampling law as a sampling verifier's options carry it (API 15): ``temperature``, ``top_k`` and
``top_p``, defined once with their checks (``SamplingFields``), and the verifier half that turns them into the law its
acceptance rule compares the draft against (``SamplesTarget``). The law itself is ``specframe.sampling``'s
``sampling_distribution``, which plain sampling draws from too."""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from specframe.errors import UsageError
from specframe.sampling import sampling_distribution
from specframe.values import is_int, is_number


class SamplingFields:
    """The option fields of a verifier that samples from the target: ``fields = api.SamplingFields("tree")``, then
    ``temperature: float = fields.temperature(0.0, "...")``, ``top_k: int = fields.top_k()``, ``top_p: float =
    fields.top_p()`` in its ``Options`` class. Each refuses a value ``sampling_distribution`` would refuse when the
    options are built (before any target loads), not at the first verification. Fields, not a base class, so each
    verifier keeps its own order and default temperature."""

    def __init__(self, owner: str) -> None:
        self.owner = owner

    def _refuse(self, name: str, rule: str, value: Any) -> UsageError:
        return UsageError(f"{self.owner} option '{name}' must be {rule}, got {value!r}")

    def temperature(self, default: float, help: str) -> Any:
        def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
            if not (is_number(value) and math.isfinite(value) and value >= 0):
                raise self._refuse(attribute.name, "a number >= 0 (0: greedy)", value)

        return attrs.field(default=default, validator=check, metadata={"help": help})

    def top_k(self, help: str = "keep only the k most likely target tokens (0: off)") -> Any:
        def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
            if not is_int(value, 0):
                raise self._refuse(attribute.name, "an integer >= 0 (0: off)", value)

        return attrs.field(default=0, validator=check, metadata={"help": help})

    def top_p(self, help: str = "keep the smallest set of target tokens whose mass reaches top_p (1: off)") -> Any:
        def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
            if not (is_number(value) and 0 < value <= 1):
                raise self._refuse(attribute.name, "in (0, 1] (1: off)", value)

        return attrs.field(default=1.0, validator=check, metadata={"help": help})


class SamplesTarget:
    """``target(logits)`` of a verifier whose options carry ``temperature``, ``top_k`` and ``top_p``: the target's
    law over each row, on the CPU (where the generator draws: one row of V floats per slot is cheap to move). Goes
    before ``api.Verifier`` in the bases; ``greedy`` is ``api.Verifier``'s (``temperature`` 0)."""

    options: Any

    def target(self, logits: torch.Tensor) -> torch.Tensor:
        o = self.options
        return sampling_distribution(logits, o.temperature, o.top_k, o.top_p).cpu()
