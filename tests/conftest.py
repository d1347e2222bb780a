import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from specframe import plugins
from tests.plugin_fixtures import FakeSite
# the shared targets, as fixtures of every test module under tests/ (a module that defines its own `tiny` keeps it)
from tests.target_fixtures import default_target, tiny  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
# CI (CI set, as .ci/run does) runs hypothesis derandomized: the same examples every run, so a red build is red again
# on any machine, and print_blob prints the @reproduce_failure line of a failure (hypothesis forbids an example
# database with derandomize, which it would never read). Locally (the dev profile) hypothesis explores new
# examples every run and keeps every failure in one fixed database in the repository (.hypothesis/examples,
# git-ignored), whatever the working directory, and replays it first on the next run until it passes. A failure
# found either way is then added to its test as an @example, so it stays a regression test for every later run.
settings.register_profile(
    "ci", derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", deadline=None, print_blob=True, database=DirectoryBasedExampleDatabase(ROOT / ".hypothesis" / "examples"),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site directory for real (tiny) plugin distributions, the plugin switches cleared; plugins reset after."""
    monkeypatch.delenv("SPECFRAME_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("SPECFRAME_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("SPECFRAME_TRACE_PLUGINS", raising=False)
    yield FakeSite(tmp_path, monkeypatch)
    plugins.reset()
