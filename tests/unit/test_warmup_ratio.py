"""``--warmup-ratio`` (issue 54, item 8): a warmup given as a share of the run's steps (DeepSpec's 4%), for a run whose
length comes from --epochs and so is not known in steps beforehand."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specframe.cli import main
from specframe.engine.config import TrainConfig, warmup_steps
from specframe.errors import UsageError
from tests.train_fixtures import build


def _cfg(**kw):
    return TrainConfig(drafter="peagle", output="out", **kw)


def test_warmup_is_steps_else_ratio_else_a_tenth():
    assert warmup_steps(_cfg(warmup_ratio=0.04), 250) == 10
    assert warmup_steps(_cfg(warmup_ratio=0.0), 250) == 0
    assert warmup_steps(_cfg(warmup_steps=7), 250) == 7
    assert warmup_steps(_cfg(), 250) == 25  # the default since the first runs
    assert warmup_steps(_cfg(), 5) == 1


@pytest.mark.parametrize("bad", [{"warmup_ratio": 1.0}, {"warmup_ratio": -0.1}, {"warmup_ratio": True},
                                 {"warmup_ratio": 0.04, "warmup_steps": 3}])
def test_bad_warmup_ratio_is_one_usage_error(bad):
    with pytest.raises(UsageError, match="warmup-ratio"):
        _cfg(**bad)


@pytest.mark.slow
def test_the_run_warms_up_over_the_ratio_of_its_steps(tmp_path):
    target, chat = build(tmp_path)
    first = {}
    for label, extra in (("default", []), ("ratio", ["--warmup-ratio", "0.75"])):
        out = tmp_path / label
        args = [str(a) for a in ("train", "--drafter", "peagle", "--target", target, "--data", chat, "--seq-len", 48,
                                 "--output", out, "--mask-builder", "dense", "--max-steps", 4, "--max-examples", 4,
                                 "--batch-size", 1, "--lr", 1e-3, *extra)]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"train_loss"' in line]
        first[label] = steps[0]["lr"]
    # step 1's rate is lr / (warmup + 1): warmup 1 by default (4 // 10, at least 1), 3 at 0.75 of 4 steps
    assert first["default"] == pytest.approx(1e-3 / 2)
    assert first["ratio"] == pytest.approx(1e-3 / 4)
