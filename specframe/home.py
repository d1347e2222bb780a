"""Where specframe keeps converted models and caches: ``$SPECFRAME_HOME`` or the user's cache directory."""

from __future__ import annotations

import os
from pathlib import Path


def specframe_home() -> Path:
    env = os.environ.get("SPECFRAME_HOME")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specframe"
