"""Every hook is typed, has a docstring, is documented for plugin authors, and is exercised by a test.

(datasette keeps the same guard: a hook nobody documented or tested does not ship.)
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from specframe import hookspecs

ROOT = Path(__file__).resolve().parent.parent
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


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_for_plugin_authors(hook):
    guide = (ROOT / "CONTRIBUTING.md").read_text()
    assert f"### `{hook}(register)`" in guide, f"CONTRIBUTING.md has no section for {hook}"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_implemented_and_tested(hook):
    this = Path(__file__).name
    tests = [p for p in (ROOT / "tests").glob("test_*.py") if p.name != this]
    assert any(f"def {hook}(" in p.read_text() for p in tests), f"no test implements a plugin with {hook}"
    sources = [*(ROOT / "plugins").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]
    assert any(f"def {hook}(" in p.read_text() for p in sources), f"no shipped plugin implements {hook}"
