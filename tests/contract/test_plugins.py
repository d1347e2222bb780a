"""The plugin manager: loading, the environment switches, and every error a plugin can cause."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from specframe import api, hookspecs, plugins
from specframe.cli import main
from specframe.errors import PluginError, UnknownNameError
from tests.plugin_fixtures import drafter_plugin

BUILTINS = {
    "mask_builders": "dense",
    "partitioners": "none",
    "verifiers": "greedy",
}


def plugins_json(*args: str) -> dict:
    result = CliRunner().invoke(main, ["plugins", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_builtins_are_listed_with_their_distribution(site):
    report = plugins_json()
    assert set(report) >= {"plugins", "drafters", "mask_builders", "partitioners", "verifiers"}
    for key, name in BUILTINS.items():
        assert name in report[key]
    dense = next(p for p in report["plugins"] if p["name"] == "mask_dense")
    assert dense["distribution"] == "specframe" and dense["builtin"] and dense["version"]
    assert dense["registers"] == {"mask_builders": ["dense"]}


def test_console_script_prints_the_same_json():
    out = subprocess.run(
        [sys.executable, "-m", "specframe", "plugins", "--json"], capture_output=True, text=True, check=True
    ).stdout
    assert "dense" in json.loads(out)["mask_builders"]


def test_table_output_lists_builtins(site):
    result = CliRunner().invoke(main, ["plugins"])
    assert result.exit_code == 0
    assert "mask_dense" in result.stdout and "dense" in result.stdout


def test_third_party_drafter_loads_through_entry_points(site):
    site.add("specframe-alpha", "alpha", drafter_plugin("alpha-drafter"))
    registry = plugins.load()
    assert registry.get("drafter", "alpha-drafter").__module__ == "specframe_alpha"
    entry = next(p for p in plugins_json()["plugins"] if p["name"] == "alpha")
    assert entry["distribution"] == "specframe-alpha" and entry["version"] == "1.0" and not entry["builtin"]
    assert entry["registers"] == {"drafters": ["alpha-drafter"]}


def test_disable_blocks_third_party_and_builtins(site, monkeypatch):
    site.add("specframe-alpha", "alpha", drafter_plugin("alpha-drafter"))
    monkeypatch.setenv("SPECFRAME_DISABLE_PLUGINS", "alpha, mask_dense")
    report = plugins_json()
    assert "alpha-drafter" not in report["drafters"]
    assert "dense" not in report["mask_builders"]
    assert "none" in report["partitioners"]


def test_allow_list_restricts_third_party_only(site, monkeypatch):
    site.add("specframe-alpha", "alpha", drafter_plugin("alpha-drafter"))
    site.add("specframe-beta", "beta", drafter_plugin("beta-drafter"))
    monkeypatch.setenv("SPECFRAME_LOAD_PLUGINS", "beta")
    report = plugins_json()
    assert "alpha-drafter" not in report["drafters"]
    assert "beta-drafter" in report["drafters"]
    assert "dense" in report["mask_builders"]  # built-ins always load
    monkeypatch.setenv("SPECFRAME_LOAD_PLUGINS", "")
    plugins.reset()
    report = plugins_json()
    assert "beta-drafter" not in report["drafters"] and "dense" in report["mask_builders"]


def test_trace_logs_every_hook_call(site, monkeypatch, capfd):
    monkeypatch.setenv("SPECFRAME_TRACE_PLUGINS", "1")
    plugins.load()
    err = capfd.readouterr().err
    for hook in ("register_drafters", "register_mask_builders", "register_partitioners", "register_verifiers"):
        assert hook in err
    plugins.pm.trace.root.setwriter(None)


def test_duplicate_names_are_refused_naming_both_plugins(site):
    site.add("specframe-alpha", "alpha", drafter_plugin("twin"))
    site.add("specframe-beta", "beta", drafter_plugin("twin"))
    expected = "drafter 'twin' is registered by two plugins: 'alpha' (specframe-alpha 1.0) and 'beta' (specframe-beta 1.0)"
    with pytest.raises(PluginError) as exc:
        plugins.get("drafter", "twin")
    assert str(exc.value) == expected
    assert expected in plugins_json()["errors"]


def test_third_party_partitioner_is_usable(site):
    site.add(
        "specframe-halves",
        "halves",
        """
        import torch
        from specframe import api
        class Halves(api.Partitioner):
            name = "halves"
            def partition(self, elements, num_segments):
                n = len(elements)
                return [api.Segment(torch.arange(n), torch.arange(n) < n // 2),
                        api.Segment(torch.arange(n), torch.arange(n) >= n // 2)]
        @api.hookimpl
        def register_partitioners(register):
            register(Halves)
        """,
    )
    segments = plugins.get("partitioner", "halves")().partition(api.full_grid(4, 2), 2)
    assert [int(s.loss_mask.sum()) for s in segments] == [3, 4]


def test_duplicate_of_a_builtin_is_refused(site):
    site.add(
        "specframe-copycat",
        "copycat",
        """
        from specframe import api
        class Dense(api.MaskBuilder):
            name = "dense"
            def build(self, query, key): raise NotImplementedError
        @api.hookimpl
        def register_mask_builders(register):
            register(Dense)
        """,
    )
    with pytest.raises(PluginError, match="^mask builder 'dense' is registered by two plugins: 'mask_dense' "):
        plugins.get("mask builder", "dense")


def test_plugin_failing_at_import_is_named_and_others_still_load(site):
    site.add("specframe-broken", "broken", "import missing_dependency_xyz\n")
    site.add("specframe-alpha", "alpha", drafter_plugin("alpha-drafter"))
    registry = plugins.load()
    expected = (
        "plugin 'broken' (specframe-broken 1.0) failed to load: ModuleNotFoundError: "
        "No module named 'missing_dependency_xyz'"
    )
    assert registry.errors == [expected]
    assert registry.get("drafter", "alpha-drafter")
    assert registry.get("mask builder", "dense")
    with pytest.raises(PluginError) as exc:  # asking for what the broken plugin provides fails with its message
        registry.get("drafter", "broken")
    assert str(exc.value) == expected
    result = CliRunner().invoke(main, ["plugins", "--json"])
    assert result.exit_code == 0
    assert f"warning: {expected}" in result.stderr


def test_plugin_raising_inside_a_hook_is_named(site):
    site.add(
        "specframe-raiser",
        "raiser",
        """
        from specframe import api
        from specframe_alpha import D
        @api.hookimpl
        def register_drafters(register):
            register(D)
            raise RuntimeError("boom")
        """,
    )
    site.add("specframe-alpha", "alpha", drafter_plugin("alpha-drafter"))
    registry = plugins.load()
    expected = "plugin 'raiser' (specframe-raiser 1.0) failed in register_drafters: RuntimeError: boom"
    assert expected in registry.errors
    # what it registered before raising is refused with its message, not half-trusted
    with pytest.raises(PluginError) as exc:
        registry.get("drafter", "alpha-drafter")
    assert str(exc.value) == expected


def test_registering_something_that_is_not_a_component(site):
    site.add(
        "specframe-bad",
        "bad",
        """
        from specframe import api
        @api.hookimpl
        def register_verifiers(register):
            register(int)
        """,
    )
    registry = plugins.load()
    assert registry.errors == [
        "plugin 'bad' (specframe-bad 1.0) registered an invalid verifier: <class 'int'> is not a subclass of "
        "specframe.api.Verifier"
    ]


def test_component_with_an_invalid_name(site):
    site.add("specframe-bad", "bad", drafter_plugin("has space"))
    assert plugins.load().errors == [
        "plugin 'bad' (specframe-bad 1.0) registered drafter D with an invalid name 'has space' "
        "(use letters, digits, '-', '_' or '.')"
    ]


def test_misspelled_hook_is_reported_with_a_suggestion(site):
    site.add(
        "specframe-typo",
        "typo",
        """
        from specframe import api
        @api.hookimpl
        def register_drafter(register):
            pass
        """,
    )
    assert plugins.load().errors == [
        "plugin 'typo' (specframe-typo 1.0) implements unknown hook 'register_drafter' "
        "(did you mean 'register_drafters'?)"
    ]


@pytest.mark.parametrize(
    "kind, typo, meant",
    [("drafter", "peagel", "peagle"), ("mask builder", "dens", "dense"), ("partitioner", "nnone", "none"),
     ("verifier", "gredy", "greedy")],
)
def test_unknown_name_lists_available_and_suggests(site, kind, typo, meant):
    registry = plugins.load()
    names = registry.names(kind)
    assert meant in names
    with pytest.raises(UnknownNameError) as exc:
        registry.get(kind, typo)
    assert str(exc.value) == f"unknown {kind} '{typo}' (did you mean '{meant}'?); available: {', '.join(names)}"


def test_unknown_name_without_a_close_match(site):
    names = plugins.load().names("verifier")
    with pytest.raises(UnknownNameError) as exc:
        plugins.get("verifier", "zzzzzz")
    assert str(exc.value) == f"unknown verifier 'zzzzzz'; available: {', '.join(names)}"


def test_every_catalogue_hook_has_a_kind():
    hooks = {name for name in vars(hookspecs) if name.startswith("register_")}
    assert hooks == {hook for hook, _ in plugins.KINDS.values()}
    for hook, base in plugins.KINDS.values():
        assert issubclass(base, api.Component)
