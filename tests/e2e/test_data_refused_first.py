"""A --data that names nothing is refused before the target is loaded or an engine starts: for a large target the
load takes minutes, and a mistyped path should cost seconds (train, prepare, regenerate)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from specframe.cli import main
from specframe.data.specs import check_spec
from specframe.errors import SpecframeError


@pytest.fixture
def no_target(monkeypatch):
    """Loading a target fails the test: each command must refuse its data first."""
    import specframe.targets

    def load_target(*args, **kwargs):
        raise AssertionError("the target was loaded before --data was checked")

    monkeypatch.setattr(specframe.targets, "load_target", load_target)


@pytest.mark.parametrize("command", [
    ["train", "--drafter", "peagle", "--seq-len", "64", "--max-steps", "1"],
    ["prepare"],
    ["regenerate"],
])
def test_a_data_spec_that_names_nothing_is_refused_before_the_target_loads(command, no_target, tmp_path):
    missing = tmp_path / "no-such-file.jsonl"
    out = tmp_path / "out"
    res = CliRunner().invoke(main, [*command, "--data", str(missing), "--output", str(out)])
    assert res.exit_code != 0
    assert f"data '{missing}' is neither a built-in name" in res.output, res.output
    assert not out.exists()  # nothing written


def test_check_spec_reads_nothing_and_passes_what_load_data_can_resolve(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("not read by the check\n")
    for spec in ("gsm8k", "mt-bench", str(chats), str(tmp_path), "org/dataset", "org/dataset:main:test"):
        check_spec(spec)
    for spec in (str(tmp_path / "missing.jsonl"), "./typo", "gsm8", "org/dataset:a:b:c", "missing.parquet"):
        with pytest.raises(SpecframeError, match="neither a built-in name"):
            check_spec(spec)


def test_report_says_a_file_is_not_a_results_directory(tmp_path):
    (tmp_path / "results.json").write_text("{}")
    res = CliRunner().invoke(main, ["report", str(tmp_path / "results.json")])
    assert res.exit_code != 0 and "is a file, not a directory" in res.output
    res = CliRunner().invoke(main, ["report", str(tmp_path / "missing")])
    assert res.exit_code != 0 and "does not exist" in res.output


def test_a_limit_below_one_is_refused_in_one_line():
    """datasets ended a zero-record list in a 'Keys mismatch' traceback; the CLI's --limit is a range as well."""
    from specframe.data.specs import load_data

    for limit in (0, -3, True):
        with pytest.raises(SpecframeError, match="--limit must be a positive number of records"):
            load_data("mt-bench", limit=limit)
    for command in (["prepare", "--output", "unused"], ["regenerate", "--data", "mt-bench", "--output", "unused"]):
        res = CliRunner().invoke(main, [*command, "--limit", "0"])
        assert res.exit_code == 2 and "'--limit': 0 is not in the range x>=1" in res.output
