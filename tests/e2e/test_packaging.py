"""What a user gets from ``pip install specframe``: every module, every built-in plugin, the default data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def source_packages() -> set[str]:
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "specframe").rglob("__init__.py")}
    found |= {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "specframe_plugins").rglob("__init__.py")}
    return found


def test_every_package_is_listed():
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]) == source_packages()


def test_every_builtin_plugin_folder_has_an_entry_point():
    entry_points = PYPROJECT["project"]["entry-points"]["specframe"]
    folders = {p.parent.name for p in (ROOT / "specframe_plugins").glob("*/__init__.py")}
    assert len(folders) >= 10, "the built-in plugins' folder moved: this test would compare nothing"
    assert {value.removeprefix("specframe_plugins.") for value in entry_points.values()} == folders
    assert all(name == value.removeprefix("specframe_plugins.") for name, value in entry_points.items())


# A path that climbs out of the package (a sibling folder, Path(__file__).parents[2], ...) works on a developer's machine
# and nowhere else: a user's clone or pip install has nothing beside it.
# (The team's sibling data folder is spelt with a character class so this file does not itself name it.)
_OUTSIDE = re.compile(r"\.\./|(?<![\w.])shared[/]data|\b(?:root|repo)\.parent\b|\bparents\[[2-9]\]|\.parent\.parent\.parent",
                      re.IGNORECASE)


def test_no_module_reads_a_path_outside_the_package():
    offenders = []
    for folder in ("specframe", "specframe_plugins"):
        assert (ROOT / folder / "__init__.py").exists(), f"{folder} moved: this test would read nothing of it"
        for path in sorted((ROOT / folder).rglob("*.py")):
            for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if _OUTSIDE.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, "modules naming a path outside the package:\n" + "\n".join(offenders)


def test_outside_path_check_bites():
    # the patterns above must catch the forms this project once used
    assert _OUTSIDE.search('repo.parent / "notes/gsm8k/train.jsonl"')
    assert _OUTSIDE.search('ROOT.parent / "datasets"')
    assert _OUTSIDE.search("/".join(["open('shared", "data", "gsm8k", "train.jsonl')"]))
    assert _OUTSIDE.search("Path(__file__).resolve().parents[2]")
    assert _OUTSIDE.search('open("../notes/DESIGN.md")')
    assert not _OUTSIDE.search("Path(__file__).resolve().parent / 'gsm8k'")


def test_gsm8k_ships_inside_the_package_with_its_licence():
    from specframe.data import sources

    packaged = sources.GSM8K_PACKAGED
    assert packaged.is_file() and (packaged.parent / "LICENSE").is_file()
    assert "MIT License" in (packaged.parent / "LICENSE").read_text()
    assert ROOT / "specframe" in packaged.parents
    assert sum(1 for _ in sources.read_jsonl(packaged)) == 7473


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)],
        check=True, capture_output=True,
    )
    (built,) = out.glob("specframe-*.whl")
    return built


def test_wheel_holds_code_plugins_and_default_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "specframe/data/default/answers.jsonl.gz" in names
    assert "specframe/data/default/provenance.json" in names
    assert {"specframe/data/gsm8k/train.jsonl.gz", "specframe/data/gsm8k/LICENSE"} <= names
    assert "specframe_plugins/peagle/__init__.py" in names
    assert "specframe/inference/engine.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[specframe]" in text and "peagle = specframe_plugins.peagle" in text


@pytest.mark.slow
def test_installed_wheel_trains_on_default_data_from_any_folder(wheel, tmp_path):
    """The built wheel in a fresh venv, run from an empty folder, trains P-EAGLE on the default data.

    The venv gets specframe only from the wheel (``--no-deps``); its dependencies (torch, transformers, ...) are
    reached through a .pth line naming this environment's site-packages, so the test needs no download. A .pth line
    adds a directory without running that directory's own .pth files, so this checkout's editable install stays out.
    """
    import sysconfig

    from specframe.targets import tiny_target

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        check=True, capture_output=True,
    )
    python = venv / "bin" / "python"
    where = subprocess.run(
        [str(python), "-c", "import specframe.data.sources as s; print(s.GSM8K_PACKAGED)"],
        cwd=tmp_path, check=True, capture_output=True, text=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(site) and Path(where).is_file()  # the wheel's copy, not this checkout's
    target = tiny_target(tmp_path / "tiny")
    work = tmp_path / "empty"
    work.mkdir()
    run = subprocess.run(
        [str(python), "-m", "specframe", "train", "--drafter", "peagle", "--target", str(target), "--seq-len", "64",
         "--max-steps", "2", "--max-examples", "24", "--output", "out", "--json"],
        cwd=work, capture_output=True, text=True, env={**os.environ, "SPECFRAME_HOME": str(tmp_path / "home")},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)
    assert summary["steps"] == 2
    checkpoint = work / summary["checkpoint"]  # relative to the folder the command ran in
    assert checkpoint.parent == work / "out" and (checkpoint / "model.safetensors").is_file()
