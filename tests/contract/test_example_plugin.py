"""The example third-party package, installed for real with pip, appears and disappears as users expect."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "specframe-example-drafter"


def run_plugins_json(**env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SPECFRAME_")}
    environment.update(env)
    out = subprocess.run(
        [sys.executable, "-m", "specframe", "plugins", "--json"],
        capture_output=True, text=True, check=True, env=environment,
    ).stdout
    return json.loads(out)


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


def installed_as() -> list[str] | None:
    """How the example is installed in this environment: None (it is not), ["-e"] (editable) or []."""
    from importlib import metadata

    try:
        dist = metadata.distribution("specframe-example-drafter")
    except metadata.PackageNotFoundError:
        return None
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    return ["-e"] if direct.get("dir_info", {}).get("editable") else []


@pytest.fixture(scope="module")
def example_installed():
    # an environment that had the example installed (a user's, or .ci/run's pass with it) gets it back as it was
    before = installed_as()
    pip("install", "--no-deps", str(EXAMPLE))
    try:
        yield
    finally:
        pip("uninstall", "-y", "specframe-example-drafter")
        if before is not None:
            pip("install", "--no-deps", *before, str(EXAMPLE))


@pytest.mark.slow
def test_install_list_block_uninstall(example_installed):
    report = run_plugins_json()
    entry = next(p for p in report["plugins"] if p["name"] == "example_drafter")
    assert entry == {
        "name": "example_drafter",
        "distribution": "specframe-example-drafter",
        "version": "0.1.0",
        "builtin": False,
        "registers": {"drafters": ["skipgram"]},
        "error": None,
    }
    assert "skipgram" in report["drafters"]

    blocked = run_plugins_json(SPECFRAME_DISABLE_PLUGINS="example_drafter")
    assert "skipgram" not in blocked["drafters"]
    assert all(p["name"] != "example_drafter" for p in blocked["plugins"])

    assert "skipgram" not in run_plugins_json(SPECFRAME_LOAD_PLUGINS="")["drafters"]
    assert "skipgram" in run_plugins_json(SPECFRAME_LOAD_PLUGINS="example_drafter")["drafters"]

    pip("uninstall", "-y", "specframe-example-drafter")
    assert "skipgram" not in run_plugins_json()["drafters"]
    pip("install", "--no-deps", str(EXAMPLE))  # the fixture's teardown uninstalls it again


def specframe_cli(*args: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SPECFRAME_")}
    return subprocess.run(
        [sys.executable, "-m", "specframe", *map(str, args)], capture_output=True, text=True, env=environment
    )


@pytest.mark.slow
def test_example_drafter_trains_through_the_normal_command(example_installed, tmp_path):
    from tests.train_fixtures import build

    target, chat = build(tmp_path)
    out = tmp_path / "run"
    result = specframe_cli(
        "train", "--drafter", "skipgram", "--target", target, "--data", chat, "--seq-len", 48, "--depth", 3,
        "--max-steps", 3, "--eval-every", 3, "--output", out, "--json",
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["steps"] == 3 and len(summary["eval"]["val_accuracy"]) == 3
    config = json.loads((out / "config.json").read_text())
    assert config["drafter"] == "skipgram" and config["drafter_options"] == {"dim": 64, "max_depth": 8}
    assert (Path(summary["checkpoint"]) / "model.safetensors").exists()


@pytest.mark.slow
def test_example_drafter_decodes_losslessly_through_generate(example_installed, tmp_path):
    from tests.train_fixtures import build

    target, chat = build(tmp_path)
    out = tmp_path / "run"
    trained = specframe_cli(
        "train", "--drafter", "skipgram", "--target", target, "--data", chat, "--seq-len", 48, "--depth", 3,
        "--max-steps", 2, "--output", out, "--json",
    )
    assert trained.returncode == 0, trained.stderr
    prompt = "the quick brown fox jumps over the lazy dog"
    runs = {}
    for name, extra in (("plain", ("--target", target)), ("skipgram", ("--checkpoint", out, "--k", 3))):
        result = specframe_cli("generate", *extra, "--prompt", prompt, "--max-new-tokens", 20, "--json")
        assert result.returncode == 0, result.stderr
        runs[name] = json.loads(result.stdout[result.stdout.index("{"):])
    assert runs["skipgram"]["drafter"] == "skipgram" and runs["skipgram"]["k"] == 3
    assert runs["skipgram"]["tokens"] == runs["plain"]["tokens"] and len(runs["plain"]["tokens"]) == 20
    spec = runs["skipgram"]
    assert spec["target_forwards"] == spec["rounds"] + 1 and 1.0 <= spec["acceptance_length"] <= 4.0
