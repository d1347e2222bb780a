"""specframe's pytest plugin loads in every pytest session where specframe is installed, so it must cost nothing
there: no torch at start-up, and it can be left out (issue 55, the test kit)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points


def test_the_pytest11_entry_point_is_the_light_plugin():
    (entry,) = [e for e in entry_points(group="pytest11") if e.name == "specframe"]
    assert entry.value == "specframe.pytest_plugin"


def test_pytest_start_up_with_the_plugin_imports_no_torch(tmp_path):
    # a session that tests nothing of specframe's: pytest loads the plugin (the entry point) and runs one test that
    # reports whether torch was imported by then
    (tmp_path / "test_light.py").write_text(
        "import sys\n\ndef test_nothing_heavy(request):\n"
        "    assert request.config.pluginmanager.has_plugin('specframe')\n"
        "    assert 'torch' not in sys.modules, 'the specframe pytest plugin imported torch at start-up'\n"
        "    assert 'specframe.api' not in sys.modules, 'the specframe pytest plugin imported specframe.api'\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_the_plugin_can_be_left_out(tmp_path):
    (tmp_path / "test_without.py").write_text(
        "def test_left_out(request):\n"
        "    assert not request.config.pluginmanager.has_plugin('specframe')\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:specframe",
                          str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_the_fixture_still_builds_the_tiny_target(specframe_tiny_target):
    assert specframe_tiny_target.config.vocab_size == 320 and specframe_tiny_target.num_layers == 4
