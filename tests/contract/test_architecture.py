"""The layer rules in pyproject.toml's [tool.importlinter] hold (import-linter, function-level imports included), and
they bite: a plugin that reaches past ``specframe.api`` breaks them, whichever way it imports."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w

ROOT = Path(__file__).resolve().parents[2]
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
    assert "Contracts: 4 kept, 0 broken." in done.stdout


@pytest.mark.parametrize("module, upward", [
    ("specframe/errors.py", "import specframe.cli"),  # a leaf reaching the top
    ("specframe/engine/schedule.py", "from specframe import bench"),  # the engine reaching the benchmarks' library
    ("specframe/compose.py", "from specframe.engine import config"),  # the composition root climbing into the engine
])
def test_an_import_running_back_up_breaks_the_layers(tmp_path, module, upward):
    """The ``layers`` contract bites: one import from a lower layer into a higher one, planted in a copy of the
    core, breaks it (a function-level import would too: import-linter reads every import statement)."""
    import shutil

    shutil.copytree(ROOT / "specframe", tmp_path / "specframe", ignore=shutil.ignore_patterns("__pycache__"))
    planted = tmp_path / module
    planted.write_text(planted.read_text() + f"\n{upward}  # planted\n")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    lint = config["tool"]["importlinter"]
    lint["root_packages"] = ["specframe"]
    lint["contracts"] = [c for c in lint["contracts"] if c["id"] == "layers"]
    path = tmp_path / "pyproject.toml"
    path.write_text(tomli_w.dumps(config))
    done = _lint(path, env_path=str(tmp_path))
    assert done.returncode != 0 and "BROKEN" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_the_core_has_no_import_circle():
    """No module of the core imports, however indirectly, a module that imports it (issue 31: the circles
    api -> vllm/export -> engine/checkpoint -> plugins -> api, api <-> inference/tree, data/sources <-> data/default
    and features <-> target_head are gone: the weights' safety checks live in the files layer, ``Draft`` in a leaf
    module, data specs above the sets, the decoder trunk beside the head). Function-level imports count;
    type-checking-only imports do not run, so they do not."""
    import grimp

    graph = grimp.build_graph("specframe", include_external_packages=False, exclude_type_checking_imports=True)
    circles = [(module, chain) for module in sorted(graph.modules)
               for imported in sorted(graph.find_modules_directly_imported_by(module))
               if (chain := graph.find_shortest_chain(importer=imported, imported=module))]
    assert not circles, "import circles: " + "; ".join(f"{m} -> " + " -> ".join(c) for m, c in circles[:10])


def test_the_api_has_no_circle_even_type_only():
    """The API's own modules sit in no circle even counting type-checking imports (issue 55: ``hookspecs`` named
    ``specframe.api`` for its annotations while the API imports ``hookimpl`` from it; it now names the interface
    modules, which the API re-exports)."""
    import grimp

    # no cache: grimp's cache (.grimp_cache) was seen to answer with a type-only import a file no longer had
    graph = grimp.build_graph("specframe", include_external_packages=False, exclude_type_checking_imports=False,
                              cache_dir=None)
    ours = ["specframe.api", "specframe.hookspecs", "specframe.sampling", "specframe.drafting.draft_tree",
            *sorted(graph.find_descendants("specframe.interfaces"))]
    circles = [(module, chain) for module in ours
               for imported in sorted(graph.find_modules_directly_imported_by(module))
               if (chain := graph.find_shortest_chain(importer=imported, imported=module))]
    assert not circles, "import circles: " + "; ".join(f"{m} -> " + " -> ".join(c) for m, c in circles)


def test_every_public_name_of_the_api_is_in_its_all():
    """``specframe.api`` is the versioned surface a plugin writes against: a name it binds is either listed in
    ``__all__`` (public, in the version history) or private. A stray import left behind by a move is neither and
    becomes public by accident."""
    import specframe.api as api

    bound = {name for name in vars(api) if not name.startswith("_") and name != "annotations"}
    assert sorted(bound - set(api.__all__)) == []
    assert sorted(set(api.__all__) - bound) == []
