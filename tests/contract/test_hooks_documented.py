"""Every hook is typed, has a docstring, is documented for plugin authors, and is exercised by a test.

(datasette keeps the same guard: a hook nobody documented or tested does not ship.)
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from specframe import hookspecs

ROOT = Path(__file__).resolve().parents[2]
HOOKS = sorted(name for name, obj in vars(hookspecs).items() if callable(obj) and hasattr(obj, "specframe_spec"))


def test_there_are_hooks():
    assert HOOKS == ["register_drafters", "register_mask_builders", "register_partitioners", "register_verifiers"]


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_docstring_and_types(hook):
    fn = getattr(hookspecs, hook)
    assert inspect.getdoc(fn) and len(inspect.getdoc(fn)) > 80, f"{hook} needs a real docstring"
    signature = inspect.signature(fn)
    assert signature.return_annotation != inspect.Signature.empty, f"{hook} needs a return annotation"
    for parameter in signature.parameters.values():
        assert parameter.annotation != inspect.Parameter.empty, f"{hook}({parameter.name}) needs a type"


#: the per-hook reference of the docs site (moved there from CONTRIBUTING.md)
REFERENCE = ROOT / "docs" / "plugins" / "hooks.md"


def hookspec_signatures() -> dict[str, str]:
    """``def NAME(ARGS) -> RETURN`` of every hookspec, as written in specframe/hookspecs.py."""
    tree = ast.parse(Path(hookspecs.__file__).read_text(encoding="utf-8"))
    return {
        node.name: f"def {node.name}({ast.unparse(node.args)}) -> {ast.unparse(node.returns)}"
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and any(ast.unparse(d) == "hookspec" for d in node.decorator_list)
    }


def reference_sections(text: str) -> dict[str, str]:
    """The reference page's ``## `hook(...)` `` sections, by hook name."""
    parts = re.split(r"^## `(\w+)\(", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1].split("\n## ", 1)[0] for i in range(1, len(parts), 2)}


def test_every_hookspec_is_parsed():
    assert sorted(hookspec_signatures()) == HOOKS


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_for_plugin_authors(hook):
    guide = REFERENCE.read_text(encoding="utf-8")
    assert f"## `{hook}(register)`" in guide, f"{REFERENCE.relative_to(ROOT)} has no section for {hook}"


@pytest.mark.parametrize("hook", HOOKS)
def test_reference_gives_the_hookspec_signature(hook):
    section = reference_sections(REFERENCE.read_text(encoding="utf-8"))[hook]
    wanted = hookspec_signatures()[hook]
    assert wanted in section, (
        f"{REFERENCE.relative_to(ROOT)}, {hook}: the signature must be the hookspec's, {wanted!r}"
    )


def test_reference_documents_no_other_hook():
    documented = set(reference_sections(REFERENCE.read_text(encoding="utf-8")))
    assert documented == set(HOOKS), f"hooks documented but not in specframe/hookspecs.py: {documented - set(HOOKS)}"


@pytest.mark.parametrize("hook", HOOKS)
def test_reference_lists_every_builtin(hook):
    """Each hook's section names every component the built-in plugins register through it."""
    from specframe import plugins

    registry = plugins.load()
    builtin = {p.name for p in registry.plugins if p.builtin}
    (kind,) = [kind for kind, (name, _) in plugins.KINDS.items() if name == hook]
    names = [name for name, (_, plugin) in registry.components[kind].items() if plugin in builtin]
    assert names, f"no built-in {kind}"
    section = reference_sections(REFERENCE.read_text(encoding="utf-8"))[hook]
    (listed,) = re.findall(r"^Built-in: (.*?)(?:\n\n|\Z)", section, flags=re.MULTILINE | re.DOTALL)
    missing = [name for name in names if f"`{name}`" not in listed]
    assert not missing, f"{REFERENCE.relative_to(ROOT)}, {hook}: the built-ins line omits {missing}"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_implemented_and_tested(hook):
    this = Path(__file__).name
    tests = [p for p in (ROOT / "tests").rglob("test_*.py") if p.name != this]
    assert any(f"def {hook}(" in p.read_text() for p in tests), f"no test implements a plugin with {hook}"
    sources = [*(ROOT / "specframe_plugins").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]
    assert len(sources) > 10, "the shipped plugins moved: this test would read nothing"
    assert any(f"def {hook}(" in p.read_text() for p in sources), f"no shipped plugin implements {hook}"
