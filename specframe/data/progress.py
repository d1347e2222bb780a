"""Keep a long ``regenerate`` run's finished batches in the checkout, and give them back to a new work folder.

A ``regenerate`` run lives in a work folder outside the checkout (``$SPECFRAME_HOME/data/large``), which usually
outlives a session but not always: when the machine goes, hours of generation go with it. ``keep`` copies the run's
progress files (the part files, their batch logs and the runs log) into a folder of the checkout, to be committed;
``restore`` copies them back into a work folder that has less (missing, or fewer finished answers), before the run
resumes. The files are copied as they are, so the resumed run reads exactly what the lost work folder held: the
same answered ids to skip, the same batch log for the provenance's generation time, nothing counted twice.
"""

from __future__ import annotations

import os
from pathlib import Path

from specframe.errors import UsageError


def progress_files(output: str | os.PathLike) -> list[Path]:
    """The files a run writing ``output`` keeps its progress in (``OUTPUT.part*`` and ``OUTPUT.runs.jsonl``)."""
    out = Path(output)
    found = list(out.parent.glob(out.name + ".part*")) + list(out.parent.glob(out.name + ".runs.jsonl"))
    return sorted(p for p in found if p.is_file())


def complete_lines(path: Path) -> int:
    """Lines ending in a newline: a line torn by a kill mid-write is not counted (``read_done`` drops it)."""
    with open(path, "rb") as f:
        return sum(1 for line in f if line.endswith(b"\n"))


def _copy(src: Path, dst: Path) -> None:
    # whole lines only, through a temporary file: a copy taken while the run appends is never half a line
    data = src.read_bytes()
    data = data[: data.rfind(b"\n") + 1]
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, dst)


def keep(output: str | os.PathLike, folder: str | os.PathLike) -> list[Path]:
    """Copy the progress of the run writing ``output`` into ``folder``; returns the copies."""
    files = progress_files(output)
    if not files:
        raise UsageError(f"nothing to keep: no {Path(output).name}.part* beside {output}")
    dst = Path(folder)
    dst.mkdir(parents=True, exist_ok=True)
    for p in files:
        _copy(p, dst / p.name)
    return [dst / p.name for p in files]


def restore(folder: str | os.PathLike, output: str | os.PathLike) -> list[Path]:
    """Copy kept progress for ``output`` from ``folder`` where the work folder holds less; returns what was copied.

    All or nothing: when any kept part file holds more finished answers than the work folder's copy, every kept
    file replaces its work copy (a part file and its batch log must come from the same moment); otherwise nothing
    changes, so a work folder that went on after the progress was kept is never set back."""
    out = Path(output)
    kept = progress_files(Path(folder) / out.name)
    parts = [p for p in kept if ".part" in p.name and not p.name.endswith(".log")]
    ahead = any(
        not (out.parent / p.name).exists() or complete_lines(p) > complete_lines(out.parent / p.name) for p in parts
    )
    if not ahead:
        return []
    out.parent.mkdir(parents=True, exist_ok=True)
    for p in kept:
        _copy(p, out.parent / p.name)
    return [out.parent / p.name for p in kept]
