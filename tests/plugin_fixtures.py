"""Real (if tiny) distributions with ``specframe`` entry points, written to a temporary site directory.

importlib.metadata discovers them exactly as it discovers pip-installed packages, so the plugin manager is tested
through its real loading path without touching the environment.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from specframe import plugins


class FakeSite:
    def __init__(self, root: Path, monkeypatch) -> None:
        self.root = root
        self.monkeypatch = monkeypatch
        monkeypatch.syspath_prepend(str(root))
        plugins.reset()

    def add(self, dist: str, entry_point: str, source: str, version: str = "1.0", module: str | None = None) -> None:
        module = module or dist.replace("-", "_")
        (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[specframe]\n{entry_point} = {module}\n")
        sys.modules.pop(module, None)
        plugins.reset()


DRAFTER_SOURCE = """
    from specframe import api

    class {cls}(api.Drafter):
        name = "{name}"
        def feature_spec(self): raise NotImplementedError
        def module(self): raise NotImplementedError
        def supervision(self, example): raise NotImplementedError
        def loss(self, example, elements, segment, attention): raise NotImplementedError
        def start(self, prompt_ids, features): raise NotImplementedError
        def propose(self, k, generator=None): raise NotImplementedError
        def accept(self, emitted, features): raise NotImplementedError

    @api.hookimpl
    def register_drafters(register):
        register({cls})
"""


def drafter_plugin(name: str, cls: str = "D") -> str:
    return DRAFTER_SOURCE.format(name=name, cls=cls)
