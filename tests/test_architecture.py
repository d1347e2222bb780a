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
    assert "Contracts: 3 kept, 0 broken." in done.stdout


def test_no_import_circle_runs_through_the_api():
    """Nothing ``specframe.api`` imports imports it back (issue 31: the circle api -> vllm/export ->
    engine/checkpoint -> plugins -> api and the api <-> inference/tree ring are gone: the weights' safety checks live
    in the files layer, ``Draft`` in a leaf module). Type-checking-only imports do not run, so they do not count."""
    import grimp

    graph = grimp.build_graph("specframe", include_external_packages=False, exclude_type_checking_imports=True)
    circles = [chain for module in sorted(graph.find_modules_directly_imported_by("specframe.api"))
               if (chain := graph.find_shortest_chain(importer=module, imported="specframe.api"))]
    assert not circles, "imports back into specframe.api: " + "; ".join(" -> ".join(c) for c in circles)


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
