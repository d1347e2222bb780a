"""The one converter between plain settings (a config file, flags, a checkpoint's config.json, a preset's table) and
typed attrs classes (``TrainConfig``, every plugin's ``Options``), and its one error format.

A value is taken only as it is written: cattrs' own int / float / str hooks would convert (``int("7")``, ``int(2.5)``,
``str(3)``), and a setting that was guessed at is worse than one refused. An unknown key, a missing one or a value of
the wrong type is one ``UsageError`` that names the key, e.g.
``run.yaml: drafter 'peagle' options: unknown key 'layerz' (did you mean 'layers'?) (known options: layers, ...)``.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import cattrs

from specframe.errors import UsageError, did_you_mean


class _WrongType(TypeError):
    pass


def _strict(kind: type, accepts: tuple[type, ...], name: str):
    def hook(value: Any, _: Any) -> Any:
        if kind is float and isinstance(value, str):
            # PyYAML reads 3e-4 (no dot) as a string: take a number written that way, nothing else
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if math.isfinite(number):
                return number
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, accepts):
            raise _WrongType(f"must be {name}, got {value!r} ({type(value).__name__})")
        return kind(value)

    return hook


def _converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(int, _strict(int, (int,), "an integer"))
    converter.register_structure_hook(float, _strict(float, (int, float), "a number"))
    converter.register_structure_hook(str, _strict(str, (str,), "a string"))
    converter.register_structure_hook(bool, _strict(bool, (bool,), "true or false"))
    return converter


CONVERTER = _converter()


def _format(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, _WrongType | UsageError):
        return str(exc)
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return f"unknown keys {', '.join(sorted(exc.extra_fields))}"
    if isinstance(exc, KeyError):
        return "is required"
    name = getattr(type_, "__name__", None) or str(type_).replace("typing.", "")
    return f"must be {name}, got an invalid value ({exc})"


def _usage_error(exc: BaseException) -> UsageError | None:
    if isinstance(exc, UsageError):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = _usage_error(inner)
        if found is not None:
            return found
    return None


def structure(data: dict[str, Any], cls: type, where: str, known: str = "known keys") -> Any:
    """``cls`` (an attrs class) from ``data``; an unknown key or a value of the wrong type is one ``UsageError``
    prefixed with ``where`` and naming the key, e.g. ``run.yaml: seq_len must be an integer, got 'long' (str)``."""
    names = [a.name for a in attrs.fields(cls)]
    extra = [k for k in data if k not in names]
    if extra:  # named here rather than by cattrs, whose message points at a JSON path and suggests nothing
        raise UsageError(
            f"{where}: unknown key '{extra[0]}'{did_you_mean(extra[0], names)} ({known}: {', '.join(names) or 'none'})"
        )
    try:
        return CONVERTER.structure(dict(data), cls)
    except UsageError:  # a validator's message already names its option
        raise
    except cattrs.BaseValidationError as exc:
        own = _usage_error(exc)
        if own is not None:  # a validator's message (cattrs wraps the class's own checks too) already names it
            raise own from None
        messages = []
        for line in cattrs.transform_error(exc, path="", format_exception=_format):
            message, _, path = line.rpartition(" @ ")
            key = path.lstrip("$.").lstrip(".")
            messages.append(f"{key} {message}" if key else message)
        raise UsageError(f"{where}: {'; '.join(messages)}") from None
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{where}: {exc}") from None


def structure_options(data: dict[str, Any], cls: type, what: str) -> Any:
    """A plugin's ``Options`` from a plain table; ``what`` names the plugin (``drafter 'peagle'``)."""
    return structure(data, cls, f"{what} options", "known options")


def unstructure(value: Any) -> Any:
    """The plain form ``structure`` reads back (what a run's config.json records)."""
    return CONVERTER.unstructure(value)
