"""The plugin manager: loads every plugin from the ``specframe`` entry-point group and keeps the catalogues.

Built-in plugins are entry points of the ``specframe`` distribution itself, loaded through the same path as a
third-party package's. Environment variables:

- ``SPECFRAME_LOAD_PLUGINS``: comma-separated allow-list of third-party entry-point names (built-ins always load);
  when set, other third-party plugins are skipped. Set it empty to load built-ins only.
- ``SPECFRAME_DISABLE_PLUGINS``: comma-separated entry-point names never to load, built-ins included.
- ``SPECFRAME_TRACE_PLUGINS=1``: log every hook call and its result to stderr.

A plugin that fails to import, raises inside a hook or registers something invalid is reported by name and the
others still load; asking for a component it would have provided fails with its message.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from typing import Any

import attrs
import pluggy

from specframe import api, hookspecs
from specframe.errors import PluginError, SpecframeError, did_you_mean, unknown_name
from specframe.interfaces.partitioner import counting_rule

ENTRY_POINT_GROUP = "specframe"
BUILTIN_DISTRIBUTION = "specframe"

#: kind -> (hook name, base class); the four catalogues of the plugin API
KINDS: dict[str, tuple[str, type]] = {
    "drafter": ("register_drafters", api.Drafter),
    "mask builder": ("register_mask_builders", api.MaskBuilder),
    "partitioner": ("register_partitioners", api.Partitioner),
    "verifier": ("register_verifiers", api.Verifier),
}

pm = pluggy.PluginManager("specframe")
pm.add_hookspecs(hookspecs)


@attrs.define
class PluginInfo:
    name: str
    distribution: str
    version: str
    builtin: bool
    registers: dict[str, list[str]] = attrs.field(factory=dict)
    error: str | None = None

    def label(self) -> str:
        return f"'{self.name}' ({self.distribution} {self.version})"


@attrs.define
class Registry:
    """What the loaded plugins provide."""

    plugins: list[PluginInfo] = attrs.field(factory=list)
    #: kind -> name -> (class, plugin name)
    components: dict[str, dict[str, tuple[type, str]]] = attrs.field(factory=lambda: {k: {} for k in KINDS})
    #: kind -> name -> error message for names that are refused (duplicates, or registered by a failing hook)
    refused: dict[str, dict[str, str]] = attrs.field(factory=lambda: {k: {} for k in KINDS})

    def names(self, kind: str) -> list[str]:
        return sorted(self.components[kind])

    @property
    def errors(self) -> list[str]:
        messages = [p.error for p in self.plugins if p.error]
        for by_name in self.refused.values():
            messages += [m for m in by_name.values() if m not in messages]
        return messages

    def get(self, kind: str, name: str) -> type:
        """The class registered as ``name``, or a clear error naming the alternatives or the broken plugin."""
        if name in self.refused[kind]:
            raise PluginError(self.refused[kind][name])
        if name in self.components[kind]:
            return self.components[kind][name][0]
        for plugin in self.plugins:
            if plugin.error and plugin.name == name:
                raise PluginError(plugin.error)
        err = unknown_name(kind, name, self.components[kind])
        broken = [p.name for p in self.plugins if p.error]
        if broken:
            err = type(err)(f"{err}; plugins that failed to load: {', '.join(broken)}")
        raise err

    def plugin_of(self, kind: str, name: str) -> str:
        return self.components[kind][name][1]


_registry: Registry | None = None


def _env_list(var: str) -> set[str] | None:
    value = os.environ.get(var)
    if value is None:
        return None
    return {item.strip() for item in value.split(",") if item.strip()}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _entry_points() -> list[metadata.EntryPoint]:
    # One distribution can be visible twice (an editable install next to a build dir); keep the first of each name.
    seen: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        seen.setdefault(ep.name, ep)
    return sorted(seen.values(), key=lambda ep: (not _is_builtin(ep), ep.name))


def _is_builtin(ep: metadata.EntryPoint) -> bool:
    return ep.dist is not None and ep.dist.name.lower().replace("_", "-") == BUILTIN_DISTRIBUTION


def _register_plugin(registry: Registry, info: PluginInfo, plugin: Any) -> None:
    """Register one loaded plugin module and collect its catalogue entries, attributing every failure to it."""
    pm.register(plugin, name=info.name)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError:
        pm.unregister(plugin)
        known = [n for n in vars(hookspecs) if n.startswith("register_")]
        unknown = sorted(impl for impl in vars(plugin) if impl.startswith("register_") and impl not in known)
        name = unknown[0] if unknown else "?"
        info.error = f"plugin {info.label()} implements unknown hook '{name}'{did_you_mean(name, known)}"
        return
    others = [p for p in pm.get_plugins() if p is not plugin]
    for kind, (hook_name, base) in KINDS.items():
        added: list[str] = []

        def register(cls: Any, _kind: str = kind, _base: type = base, _added: list[str] = added) -> None:
            _check_component(info, _kind, _base, cls)
            _added.append(cls.name)
            _add(registry, info, _kind, cls)

        caller = pm.subset_hook_caller(hook_name, remove_plugins=others)
        try:
            caller(register=register)
        except SpecframeError as exc:
            info.error = str(exc)
        except Exception as exc:  # a plugin's bug must not take the others down
            info.error = f"plugin {info.label()} failed in {hook_name}: {_describe(exc)}"
        if info.error:
            for name in added:  # what it registered before failing cannot be trusted
                registry.components[kind].pop(name, None)
                registry.refused[kind][name] = info.error
            info.registers = {}
            return
        if added:
            info.registers[kind] = sorted(added)


def _check_component(info: PluginInfo, kind: str, base: type, cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise PluginError(
            f"plugin {info.label()} registered an invalid {kind}: {cls!r} is not a subclass of "
            f"specframe.api.{base.__name__}"
        )
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_." for c in name):
        raise PluginError(
            f"plugin {info.label()} registered {kind} {cls.__qualname__} with an invalid name {name!r} "
            "(use letters, digits, '-', '_' or '.')"
        )
    if not attrs.has(cls.Options):
        raise PluginError(
            f"plugin {info.label()} registered {kind} '{name}' whose Options is not an attrs class"
        )
    if issubclass(cls, api.Partitioner):
        try:
            counting_rule(cls)
        except ValueError as exc:  # a rule the memory estimate would not know how to follow
            raise PluginError(f"plugin {info.label()} registered {kind} '{name}': {exc}") from None


def _add(registry: Registry, info: PluginInfo, kind: str, cls: type) -> None:
    table = registry.components[kind]
    if cls.name in registry.refused[kind]:
        return
    if cls.name in table:
        first = next(p for p in registry.plugins if p.name == table[cls.name][1])
        message = f"{kind} '{cls.name}' is registered by two plugins: {first.label()} and {info.label()}"
        del table[cls.name]
        first.registers[kind] = [n for n in first.registers.get(kind, []) if n != cls.name]
        registry.refused[kind][cls.name] = message
        return
    table[cls.name] = (cls, info.name)


def load() -> Registry:
    """Load (once) every enabled plugin and return the catalogues."""
    global _registry
    if _registry is not None:
        return _registry
    if os.environ.get("SPECFRAME_TRACE_PLUGINS", "") not in ("", "0"):
        pm.trace.root.setwriter(lambda message: sys.stderr.write(f"[specframe-plugins] {message}"))
        pm.enable_tracing()
    allow = _env_list("SPECFRAME_LOAD_PLUGINS")
    block = _env_list("SPECFRAME_DISABLE_PLUGINS") or set()
    registry = Registry()
    for ep in _entry_points():
        builtin = _is_builtin(ep)
        if ep.name in block or (not builtin and allow is not None and ep.name not in allow):
            continue
        dist = ep.dist.name if ep.dist else "?"
        version = ep.dist.version if ep.dist else "?"
        info = PluginInfo(ep.name, dist, version, builtin)
        registry.plugins.append(info)
        try:
            plugin = ep.load()
        except Exception as exc:  # includes SyntaxError subclasses raised at import
            info.error = f"plugin {info.label()} failed to load: {_describe(exc)}"
            continue
        except SystemExit as exc:
            info.error = f"plugin {info.label()} failed to load: it called exit({exc.code})"
            continue
        _register_plugin(registry, info, plugin)
    _registry = registry
    return registry


def reset() -> None:
    """Forget the loaded plugins (tests change the environment and load again)."""
    global _registry
    for plugin in list(pm.get_plugins()):
        pm.unregister(plugin)
    _registry = None


def get(kind: str, name: str) -> type:
    """The component class registered as ``name`` for ``kind`` (one of ``KINDS``)."""
    return load().get(kind, name)
