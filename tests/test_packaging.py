"""What a user gets from ``pip install specframe``: every module, every built-in plugin, the default data."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def source_packages() -> set[str]:
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "specframe").rglob("__init__.py")}
    found |= {
        ".".join(("specframe_plugins", *p.parent.relative_to(ROOT / "plugins").parts)).rstrip(".")
        for p in (ROOT / "plugins").rglob("__init__.py")
    }
    return found


def test_every_package_is_listed():
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]) == source_packages()


def test_every_builtin_plugin_folder_has_an_entry_point():
    entry_points = PYPROJECT["project"]["entry-points"]["specframe"]
    folders = {p.parent.name for p in (ROOT / "plugins").glob("*/__init__.py")}
    assert {value.removeprefix("specframe_plugins.") for value in entry_points.values()} == folders
    assert all(name == value.removeprefix("specframe_plugins.") for name, value in entry_points.items())


def test_wheel_holds_code_plugins_and_default_data(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("specframe-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "specframe/data/default/answers.jsonl.gz" in names
    assert "specframe/data/default/provenance.json" in names
    assert "specframe_plugins/peagle/__init__.py" in names
    assert "specframe/inference/engine.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[specframe]" in text and "peagle = specframe_plugins.peagle" in text
