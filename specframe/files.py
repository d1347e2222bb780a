"""The files layer: what a drafter folder's files may hold, checked before anything in them is loaded.

It knows files only (no engine, no plugin registry, no vLLM), so the engine's checkpoints, the vLLM exports and the
foreign-folder imports all check weights through it without importing each other (issue 31 item 2; an import-linter
contract in pyproject.toml keeps it so).
"""

from __future__ import annotations

import json
from pathlib import Path

from specframe.errors import SpecframeError


# what torch.save / pickle writes: loading any of these could run arbitrary code, so a checkpoint carrying one is refused
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_PICKLE_MAGIC = (b"PK\x03\x04", b"\x80")  # torch.save's zip archive, a raw pickle (protocol >= 2)


def check_safetensors(path: Path) -> None:
    """Raise a SpecframeError unless ``path`` is a complete safetensors file; reads only its header, unpickles nothing."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        header = f.read(n) if 0 < n <= size - 8 else f.read(1)
    try:
        meta = json.loads(header)
        end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        end = None
    if end is not None and 8 + n + end == size:
        return
    # Only now look for a pickle: a valid safetensors header length can start with the byte 0x80 too (1 in 256
    # files), so the magic bytes alone must not decide. A safetensors file has its JSON header at byte 8.
    if head.startswith(_PICKLE_MAGIC) and not header.startswith(b"{"):
        raise SpecframeError(
            f"{path} is a pickle (torch.save) file, not safetensors; specframe never unpickles weights "
            "(re-save them with safetensors)"
        )
    raise SpecframeError(f"{path} is not a complete safetensors file (truncated or corrupt: {size} bytes)")


def check_files(directory: Path) -> None:
    """Refuse a checkpoint that carries pickle files or damaged safetensors, before anything in it is loaded."""
    for path in sorted(directory.rglob("*")):
        if path.suffix in PICKLE_SUFFIXES:
            raise SpecframeError(
                f"{directory} contains {path.relative_to(directory)}, a pickle file; specframe loads only safetensors "
                "and refuses checkpoints that carry pickles (nothing was loaded)"
            )
        if path.suffix == ".safetensors":
            check_safetensors(path)
