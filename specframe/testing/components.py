"""How a contract gets the component it checks: a registered name (looked up in the plugin registry) or the class
itself (no install needed), built with options given as plain values, structured as a config file's are."""

from __future__ import annotations

from typing import Any


def component_class(kind: str, component: Any) -> type:
    """The class of ``component``: the one registered as ``kind`` under that name, or the class it is."""
    from specframe import plugins

    return plugins.get(kind, component) if isinstance(component, str) else component


def build_component(kind: str, component: Any, options: dict[str, Any], *args: Any) -> Any:
    """An instance of ``component`` (a name or a class) with ``options`` structured into its ``Options``, built by
    the project's one constructor (``compose.component``) so a contract checks what a run would build."""
    from specframe import compose

    return compose.component(kind, component, dict(options), *args)
