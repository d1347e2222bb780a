"""``Dist.close`` destroys the process group only when this ``Dist`` created it (``owner``): train's own group goes
(a gloo group left to the interpreter's exit can abort a finished rank), a caller's group stays. The distributed
tests that check the first run torchrun (slow); these run one in-process gloo group of one rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from specframe.engine.sharding import Dist


INIT = dist.init_process_group  # the real one: the owner test stands in for torchrun's rendezvous


def _group(tmp_path, name):
    INIT("gloo", init_method=f"file://{tmp_path / name}", rank=0, world_size=1)


def test_close_leaves_a_group_it_did_not_create(tmp_path, monkeypatch):
    """Planted: ``if self.dist.is_initialized():`` (the ``owner`` condition dropped)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _group(tmp_path, "caller")
    try:
        d = Dist(torch.device("cpu"))
        assert not d.owner
        d.close()
        assert dist.is_initialized(), "Dist.close destroyed its caller's process group"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_close_destroys_the_group_it_created(tmp_path, monkeypatch):
    """Planted: a close that never destroys (the group left for the interpreter's exit)."""
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; the group itself is a one-rank stand-in
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("RANK", "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: _group(tmp_path, "own"))
    try:
        d = Dist(torch.device("cpu"))
        assert d.owner and dist.is_initialized()
        d.close()
        assert not dist.is_initialized() and not d.owner
        d.close()  # a second close is a no-op
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_under_torchrun_a_group_already_formed_is_not_claimed(tmp_path, monkeypatch):
    """Planted: ``self.owner = self.world > 1`` (a caller's group, formed before train, claimed and re-initialised)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("RANK", "0")):
        monkeypatch.setenv(name, value)
    _group(tmp_path, "caller")
    monkeypatch.setattr(dist, "init_process_group", lambda backend: _group(tmp_path, "own"))
    try:
        d = Dist(torch.device("cpu"))
        assert not d.owner
        d.close()
        assert dist.is_initialized(), "Dist.close destroyed its caller's process group"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
