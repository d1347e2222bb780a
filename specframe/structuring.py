"""The one converter between plain settings (a config file, flags, a checkpoint's config.json, a preset's table) and
typed attrs classes (``TrainConfig``, every plugin's ``Options``), and its one error format.

A value is taken only as it is written: cattrs' own int / float / str hooks would convert (``int("7")``, ``int(2.5)``,
``str(3)``), and a setting that was guessed at is worse than one refused. An unknown key, a missing one or a value of
the wrong type is one ``UsageError`` that names the key, e.g.
``run.yaml: drafter 'peagle' options: unknown key 'layerz' (did you mean 'layers'?) (known options: layers, ...)``.

Options given inline (``--drafter peagle:layers=4,k_infer=3``, the one syntax every component kind takes on every
command) are read here too (``inline``): each value stays the text typed (``Text``) until ``structure`` types it by
the field it sets, so ``layers=4`` is the integer 4 and ``name=8`` the string '8'.
"""

from __future__ import annotations

import json
import math
import re
import types
import typing
from typing import Any, Literal

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


class Text(str):
    """A value typed as text on the command line (an inline option): ``structure`` types it by the field it sets."""


def _texts(kind: Any) -> bool:
    """Whether a field of type ``kind`` takes text as it is written (``str``, ``str | None``, a ``Literal`` of
    strings): its value is the text, never the text read as JSON."""
    if kind is str:
        return True
    if typing.get_origin(kind) is Literal:
        return all(isinstance(arg, str) for arg in typing.get_args(kind))
    args = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    return typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1 and _texts(args[0])


def _typed(value: Text, kind: Any) -> Any:
    """An inline option's text as its field reads it: the text itself for a text field (``null`` is None where None
    is allowed), else the text read as JSON (``4``, ``true``, ``[1.0, 2.0]``), else the text (refused by the field's
    own check with the usual message)."""
    if _texts(kind) and not (value == "null" and type(None) in typing.get_args(kind)):
        return str(value)
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return str(value)


#: a comma ends an inline option only where the next KEY= starts, so a JSON list's commas stay inside its value
_ITEMS = re.compile(r",(?=\s*[A-Za-z_]\w*\s*=)")


def inline(text: str, kind: str, example: str) -> tuple[str, dict[str, Text]]:
    """``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE`` (a component named with its options inline, as every ``--drafter``,
    ``--mask-builder``, ``--partitioner`` and ``--verifier`` takes it) -> the name and its options, each value the
    text typed (``Text``, typed later by the component's ``Options``). ``kind`` and ``example`` (``peagle:layers=4``)
    word the one error, for an item that is not KEY=VALUE."""
    name, _, rest = text.partition(":")
    given: dict[str, Text] = {}
    for item in filter(None, (part.strip() for part in _ITEMS.split(rest))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"{kind} option '{item}' in '{text}' is not KEY=VALUE (e.g. {example})")
        given[key.strip()] = Text(value.strip())
    return name.strip(), given


def _type_texts(data: dict[str, Any], cls: type) -> dict[str, Any]:
    if not any(isinstance(value, Text) for value in data.values()):
        return data
    try:
        kinds = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: the field's value is read as JSON
        kinds = {}
    return {key: _typed(value, kinds.get(key)) if isinstance(value, Text) else value for key, value in data.items()}


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
        return CONVERTER.structure(_type_texts(data, cls), cls)
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
