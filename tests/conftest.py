import os

import pytest
from hypothesis import HealthCheck, settings

from specframe import plugins
from tests.plugin_fixtures import FakeSite

# CI runs hypothesis derandomized so a red build is reproducible; locally it explores new examples every run.
settings.register_profile(
    "ci", derandomize=True, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site directory for real (tiny) plugin distributions, the plugin switches cleared; plugins reset after."""
    monkeypatch.delenv("SPECFRAME_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("SPECFRAME_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("SPECFRAME_TRACE_PLUGINS", raising=False)
    yield FakeSite(tmp_path, monkeypatch)
    plugins.reset()
