"""What every registered component has: a ``name`` and an ``Options`` attrs class (``specframe.api.Component``)."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs


@attrs.define
class NoOptions:
    """Options of a component that has none."""


class Component:
    """What every registered component has: a ``name`` and an ``Options`` attrs class."""

    name: ClassVar[str]
    Options: ClassVar[type] = NoOptions

    def __init__(self, options: Any = None) -> None:
        self.options = self.Options() if options is None else options
