"""Errors that reach the user as one clear line (the CLI prints them without a traceback)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


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
