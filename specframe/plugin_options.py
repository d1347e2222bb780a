"""A plugin's options as a user sees them: name, type, default and one line of help (``specframe plugins --options``).

Convention (docs/plugins/tutorial.md, "Options and their help"; CONTRIBUTING.md points there): every field of a component's attrs ``Options`` class carries
its help as ``attrs.field(..., metadata={"help": "one line"})``. The help is read from the class at run time, so it
is the same for built-in and third-party plugins and needs no source code.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from specframe import plugins
from specframe.errors import unknown_name


@attrs.frozen
class OptionDoc:
    name: str
    type: str
    #: the default value (JSON-able), or None with ``required`` set
    default: Any
    help: str
    required: bool = False

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _type_name(tp: Any) -> str:
    if tp is None:
        return "any"
    if isinstance(tp, str):  # postponed annotations (``from __future__ import annotations``) stay strings
        return tp
    if isinstance(tp, type) and not getattr(tp, "__args__", None):
        return tp.__name__
    return str(tp).replace("typing.", "").replace("NoneType", "None")


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def describe(options_cls: type) -> list[OptionDoc]:
    """One ``OptionDoc`` per field of an attrs ``Options`` class, in declaration order."""
    docs = []
    for field in attrs.fields(options_cls):
        default = field.default
        required = default is attrs.NOTHING
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = "(computed)" if default.takes_self else default.factory()
        help_text = str(field.metadata.get("help", "")).strip()
        docs.append(OptionDoc(
            name=field.name,
            type=_type_name(field.type),
            default=None if required else _jsonable(default),
            help=" ".join(help_text.split()),
            required=required,
        ))
    return docs


def find(name: str, kind: str | None = None) -> list[tuple[str, type, str]]:
    """``(kind, class, plugin)`` of every component registered as ``name`` (a name may be, say, both a drafter and a
    partitioner); an unknown name (or kind) is one ``UnknownNameError`` with a did-you-mean."""
    registry = plugins.load()
    if kind is not None and kind not in plugins.KINDS:
        raise unknown_name("plugin kind", kind, plugins.KINDS)
    kinds = [kind] if kind is not None else list(plugins.KINDS)
    found = []
    for k in kinds:
        if name in registry.components[k] or name in registry.refused[k]:
            found.append((k, registry.get(k, name), registry.plugin_of(k, name)))
    if not found:
        every = sorted({n for k in kinds for n in registry.names(k)})
        what = kind if kind is not None else "plugin component (drafter, mask builder, partitioner or verifier)"
        raise unknown_name(what, name, every)
    return found


def summary(options_cls: type) -> str:
    """The first paragraph of the Options class's docstring, on one line ('' when it has none)."""
    doc = options_cls.__doc__ or ""
    return " ".join(doc.strip().split("\n\n")[0].split()).replace("``", "`")


def report(name: str, kind: str | None = None) -> list[dict[str, Any]]:
    """The ``--json`` document of ``specframe plugins --options NAME``: one entry per matching component."""
    out = []
    for k, cls, plugin in find(name, kind):
        out.append({
            "name": name,
            "kind": k,
            "plugin": plugin,
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "description": summary(cls.Options),
            "options": [d.as_dict() for d in describe(cls.Options)],
        })
    return out


__all__ = ["OptionDoc", "describe", "find", "report", "summary"]
