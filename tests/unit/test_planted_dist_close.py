"""The process group a training run forms is destroyed at the interpreter's exit (``sharding.destroy_at_exit``,
registered by the ``Dist`` that formed it), never at the end of one run: a gloo group left to the interpreter's own
teardown can abort a finished rank, and a process that trains again (several runs in one torchrun process) must find
its group still formed, since a second rendezvous in the same torchrun job is not possible. The torchrun tests that
check the first are slow; these run one in-process gloo group of one rank."""

from __future__ import annotations

import atexit

import torch
import torch.distributed as dist

from specframe.engine import sharding
from specframe.engine.sharding import Dist

INIT = dist.init_process_group  # the real one: the owner tests stand in for torchrun's rendezvous


def _group(tmp_path, name):
    INIT("gloo", init_method=f"file://{tmp_path / name}", rank=0, world_size=1)


def _as_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; the group itself is a one-rank stand-in
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("RANK", "0")):
        monkeypatch.setenv(name, value)


def test_the_dist_that_forms_the_group_has_it_destroyed_at_exit_and_keeps_it_until_then(tmp_path, monkeypatch):
    """Planted: no atexit registration (the group left for the interpreter's teardown)."""
    _as_torchrun(monkeypatch)
    registered = []
    monkeypatch.setattr(atexit, "register", lambda fn, *a, **k: registered.append(fn) or fn)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: _group(tmp_path, "own"))
    try:
        d = Dist(torch.device("cpu"))
        assert d.owner and dist.is_initialized()
        assert registered == [sharding.destroy_at_exit]
        again = Dist(torch.device("cpu"))  # a second run in the same process finds the group and keeps it
        assert not again.owner and dist.is_initialized() and registered == [sharding.destroy_at_exit]
        for fn in registered:  # what the interpreter's exit runs
            fn()
        assert not dist.is_initialized()
        sharding.destroy_at_exit()  # a second call is a no-op
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_group_formed_before_the_run_is_neither_claimed_nor_registered(tmp_path, monkeypatch):
    """Planted: ``self.owner = self.world > 1`` (a caller's group claimed and formed again)."""
    _as_torchrun(monkeypatch)
    _group(tmp_path, "caller")
    registered = []
    monkeypatch.setattr(atexit, "register", lambda fn, *a, **k: registered.append(fn) or fn)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: _group(tmp_path, "own"))
    try:
        d = Dist(torch.device("cpu"))
        assert not d.owner and registered == [] and dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_single_process_forms_no_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    registered = []
    monkeypatch.setattr(atexit, "register", lambda fn, *a, **k: registered.append(fn) or fn)
    d = Dist(torch.device("cpu"))
    assert d.world == 1 and not d.owner and registered == [] and not dist.is_initialized()
