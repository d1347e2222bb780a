"""Online training over a dataset ten times larger keeps its peak memory flat: features are computed per step and
dropped (one epoch visits each sequence once), not memoised for the whole run."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.train_fixtures import write_chat

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
from specframe.engine import TrainConfig, train
from specframe.memory import status_bytes
train(TrainConfig(drafter="peagle", output={out!r}, target={target!r}, data={data!r}, seq_len=48, epochs=1.0,
                  batch_size=40, val_examples=1, mask_builder="dense", pack=False,
                  drafter_options={{"layers": 1, "draft_vocab_size": 64, "k_train": 2}}), progress=False)
print(status_bytes("VmHWM"))
"""


def peak(tmp_path: Path, target: Path, n: int) -> int:
    data = write_chat(tmp_path / f"chat-{n}.jsonl", n=n, seed=1)
    script = tmp_path / f"child-{n}.py"
    script.write_text(textwrap.dedent(CHILD.format(root=str(ROOT), out=str(tmp_path / f"out-{n}"),
                                                   target=str(target), data=str(data))))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((tmp_path / f"out-{n}" / "config.json").read_text())
    assert config["train_sequences"] == n - 1  # every sequence of the epoch was trained on
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_memory_stays_flat_as_the_dataset_grows(tmp_path):
    from specframe.targets import tiny_target

    # hidden 512: three aux layers and the final state are 8 KiB a token, so memoising 2,000 sequences' features
    # (about 60K tokens, ~480 MiB) would show far beyond the 10% allowed
    target = tiny_target(tmp_path / "target", vocab=320, layers=4, hidden=512, heads=4, kv_heads=2, intermediate=512)
    small, large = peak(tmp_path, target, 200), peak(tmp_path, target, 2000)
    assert large <= 1.10 * small, (small, large)
