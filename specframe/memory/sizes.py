"""Memory sizes: ``8GiB`` and its kin read (``parse_size``) and written (``format_size``)."""

from __future__ import annotations

import re

from specframe.errors import UsageError
from specframe.values import is_int

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in a size string: ``8GiB``, ``8G`` / ``8GB`` (powers of 1000), ``512MiB``, ``1.5GB``, ``1048576``."""
    if is_int(text):
        if text <= 0:
            raise UsageError(f"memory budget must be positive, got {text!r}")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise UsageError(
            f"invalid memory size '{text}': use a number with an optional unit, e.g. 8GiB, 8G, 512MiB, 1.5GB "
            "or plain bytes (KiB/MiB/GiB/TiB are powers of 1024, K/M/G/T and KB/MB/GB/TB powers of 1000)"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if value < 1:
        raise UsageError(f"memory size '{text}' is less than one byte")
    return int(value)


def format_size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
