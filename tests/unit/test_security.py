"""Checkpoints are never unpickled: pickle files and damaged safetensors are refused with one clear line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig

from specframe.cli import main
from specframe.drafter_folders import load_drafter
from specframe.engine import checkpoint as ckpt
from specframe.errors import SpecframeError
from tests.train_fixtures import trained_peagle


class Payload:
    """Unpickling this touches a marker file: proof of whether anything was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return trained_peagle(tmp_path_factory.mktemp("security"), "layers = 2\ndraft_vocab_size = 100\nk_train = 3")


def copy(run, tmp_path) -> Path:
    _, out, _ = run
    dest = tmp_path / "ckpt"
    shutil.copytree(ckpt.resolve(out), dest)
    return dest


def test_a_torch_save_file_in_place_of_the_weights_is_refused_unread(run, tmp_path):
    directory = copy(run, tmp_path)
    marker = tmp_path / "unpickled"
    torch.save({"w": Payload(marker)}, directory / "model.safetensors")
    with pytest.raises(SpecframeError, match=r"model.safetensors is a pickle \(torch.save\) file, not safetensors"):
        load_drafter(directory, AutoConfig.from_pretrained(run[0]))
    assert not marker.exists()


def test_a_pickle_beside_the_weights_is_refused(run, tmp_path):
    directory = copy(run, tmp_path)
    marker = tmp_path / "unpickled"
    torch.save(Payload(marker), directory / "pytorch_model.bin")
    with pytest.raises(SpecframeError, match="contains pytorch_model.bin, a pickle file"):
        load_drafter(directory, AutoConfig.from_pretrained(run[0]))
    assert not marker.exists()


@pytest.mark.parametrize("keep", [0, 5, 100, -10])
def test_a_truncated_safetensors_file_is_a_clear_error(run, tmp_path, keep):
    directory = copy(run, tmp_path)
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:keep])
    with pytest.raises(SpecframeError, match="model.safetensors is not a complete safetensors file"):
        load_drafter(directory, AutoConfig.from_pretrained(run[0]))


def test_resume_refuses_a_pickled_optimizer_state_through_the_cli(run, tmp_path):
    _, out, args = run
    directory = copy(run, tmp_path)
    marker = tmp_path / "unpickled"
    torch.save(Payload(marker), directory / "optimizer.safetensors")
    new_out = tmp_path / "o2"
    argv = [*args[: args.index("--output") + 1], str(new_out), *args[args.index("--output") + 2 :]]
    result = CliRunner().invoke(main, list(map(str, [*argv, "--resume", directory])))
    assert result.exit_code != 0
    assert "error: " in result.stderr and "optimizer.safetensors is a pickle (torch.save) file" in result.stderr
    assert "Traceback" not in result.stderr
    assert not marker.exists()
    assert not list(new_out.glob("step-*"))


def test_a_safetensors_header_length_starting_with_0x80_is_not_taken_for_a_pickle(tmp_path):
    """A pickle starts with 0x80, and so does the little-endian header length of 1 in 256 safetensors files: such a
    file (found by the cpu benchmark run, a trained parallelspec checkpoint) must load, while real pickles and
    truncated files keep their messages."""
    import torch
    from safetensors.torch import save_file

    from specframe.engine.checkpoint import check_safetensors
    from specframe.errors import SpecframeError

    path = tmp_path / "w.safetensors"
    for pad in range(300):  # metadata length steers the header length; find one whose low byte is 0x80
        save_file({"w": torch.zeros(3)}, str(path), metadata={"pad": "x" * pad})
        if path.read_bytes()[0] == 0x80:
            break
    assert path.read_bytes()[0] == 0x80
    check_safetensors(path)  # no error
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(SpecframeError, match="not a complete safetensors file"):
        check_safetensors(path)
    torch.save({"w": torch.zeros(3)}, path)
    with pytest.raises(SpecframeError, match="is a pickle"):
        check_safetensors(path)
    import pickle

    path.write_bytes(pickle.dumps({"w": [0.0]}, protocol=4))
    with pytest.raises(SpecframeError, match="is a pickle"):
        check_safetensors(path)
