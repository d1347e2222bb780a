"""Errors that reach the user as one clear line (the CLI prints them without a traceback)."""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class SpecframeError(Exception):
    """A problem the user can fix: bad input, a bad option, a broken plugin.

    The CLI prints ``error: <message>`` and exits with ``exit_code``; the traceback is shown only with ``--debug``.
    """

    exit_code = 1


class UsageError(SpecframeError):
    """An invalid option value or combination."""

    exit_code = 2


class PluginError(SpecframeError):
    """A plugin failed to import, raised inside a hook, or registered something invalid."""


class InvalidDraftError(PluginError):
    """A ``Draft`` (or the logits it is verified against) that breaks the shapes and ids the API promises."""


class DamagedFileError(SpecframeError):
    """A JSON file specframe wrote (checkpoint, feature-cache manifest, results, config) that no longer parses."""


def read_json(path: str | os.PathLike, what: str, expect: type | None = dict) -> Any:
    """The JSON document in ``path``; a missing, unreadable, non-UTF-8 or malformed file (or one whose top level is
    not ``expect``) is one ``DamagedFileError`` naming the file and what it is, instead of a traceback.

    ``what`` says what the file is for the message, e.g. "the checkpoint's run config".
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DamagedFileError(f"{p} is missing ({what})") from None
    except UnicodeDecodeError as e:
        raise DamagedFileError(f"{p} is damaged ({what}): not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DamagedFileError(f"{p} cannot be read ({what}): {e.strerror or e}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DamagedFileError(
            f"{p} is damaged ({what}): not valid JSON ({e.msg}: line {e.lineno}, column {e.colno})"
        ) from None
    if expect is not None and not isinstance(value, expect):
        kind = {dict: "object", list: "array"}.get(expect, expect.__name__)
        raise DamagedFileError(f"{p} is damaged ({what}): expected a JSON {kind}, got {type(value).__name__}")
    return value


class UnknownNameError(SpecframeError):
    """A drafter / mask builder / partitioner / verifier name that nothing registered."""

    exit_code = 2


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(name, sorted(choices), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def unknown_name(kind: str, name: str, available: Iterable[str]) -> UnknownNameError:
    available = sorted(available)
    listed = ", ".join(available) if available else "none"
    return UnknownNameError(f"unknown {kind} '{name}'{did_you_mean(name, available)}; available: {listed}")
