"""A work folder is used only under the key it was started with.

Each benchmark job keeps its run folder (or its cached hidden states) in a work folder that outlives the session, and
resumes or reuses what it finds there. What it finds may have been left by other settings: a checkpoint of a run with
more steps (another learning-rate schedule) would be resumed as this one's, hidden-state files of other rows would be
loaded for these. So every such folder has a marker file beside it holding the key (a fingerprint of the settings)
it was started under, and a folder whose marker is missing or holds another key is not used: it is removed, or set
aside when it may hold hours of training someone wants to inspect.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def claim(folder: Path, marker: Path, key: str, *, set_aside: bool = False) -> Path | None:
    """Make ``folder`` ``key``'s: if ``marker`` is missing or holds another key, remove ``folder`` (or, with
    ``set_aside``, rename it to ``<name>.stale-<old key>`` beside itself, replacing an older one of that name), then
    write ``key`` to ``marker``. A folder of unknown origin (no marker) is never kept. Returns the set-aside folder,
    if one was made."""
    held = marker.read_text().strip() if marker.exists() else None
    stale = None
    if held != key and folder.exists():
        if set_aside:
            stale = folder.with_name(f"{folder.name}.stale-{held or 'unknown'}")
            if stale.exists():
                shutil.rmtree(stale)
            folder.rename(stale)
        else:
            shutil.rmtree(folder)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(key + "\n")
    return stale
