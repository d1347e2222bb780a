"""The layer rules in pyproject.toml's [tool.importlinter] hold (import-linter, function-level imports included), and
they bite: a plugin that reaches past ``specframe.api`` breaks them, whichever way it imports."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(config: Path, env_path: str | None = None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ)
    if env_path:
        env["PYTHONPATH"] = env_path + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([str(LINT), str(config), "--no-cache"], capture_output=True, text=True, cwd=config.parent,
                          env=env, timeout=300)


def test_the_layer_contracts_are_kept():
    done = _lint(ROOT / "pyproject.toml")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in done.stdout


@pytest.mark.parametrize("statement", [
    "from specframe.engine import checkpoint",        # a module import at the top of the plugin
    "def f():\n    from specframe.vllm import imports",  # inside a function, as the built-ins once did
    "import specframe.elements",
])
def test_a_plugin_that_reaches_past_the_api_breaks_the_contract(tmp_path, statement):
    package = tmp_path / "src" / "thirdparty_drafter"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from specframe import api\n" + statement + "\n")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    config["root_packages"].append("thirdparty_drafter")
    rule = next(c for c in config["contracts"] if c["id"] == "plugins-use-the-api")
    rule["source_modules"].append("thirdparty_drafter")
    rule["ignore_imports"].append("thirdparty_drafter -> specframe.api")
    path = tmp_path / "lint.toml"
    path.write_text(tomli_w.dumps({"tool": {"importlinter": config}}))
    done = _lint(path, str(tmp_path / "src"))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert "thirdparty_drafter is not allowed to import specframe" in done.stdout
