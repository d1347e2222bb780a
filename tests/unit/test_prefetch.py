"""Prefetch: the next step's features are computed in a background thread, taken once, identical to computing them on
use, errors surface in the caller; a run trains to the same weights with prefetch on and off."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from specframe import api
from specframe.engine import TrainConfig, data, train
from specframe.engine import checkpoint as ckpt
from specframe.engine.data import OnlineSource, _Sequences
from specframe.features import FeatureSpec
from specframe.targets import load_target
from tests.train_fixtures import build, small_options


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build(tmp_path_factory.mktemp("prefetch"))


def source(assets, keep=()):
    target = load_target(assets[0])
    src = OnlineSource(str(assets[1]), target, FeatureSpec.eagle(target.num_layers), 48, None, pack=False)
    src.keep_features(keep)
    return src


def test_prefetched_features_come_from_the_thread_once_and_equal_computed_ones(assets):
    plain, fetched = source(assets), source(assets)
    calls: list[tuple[int, str]] = []
    compute = fetched._features

    def spy(j):
        calls.append((j, threading.current_thread().name))
        return compute(j)

    fetched._features = spy
    fetched.prefetch([2, 0, 2])
    try:
        for i in (0, 2):
            got, want = fetched.example(i).features, plain.example(i).features
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
        # each sequence computed once, and on the prefetch thread, not the caller's
        assert sorted(j for j, _ in calls) == [0, 2]
        assert all(name.startswith("specframe-prefetch") for _, name in calls), calls
        # taken: a second use computes again (nothing is kept), now in the caller's thread
        fetched.example(0)
        assert calls[-1] == (0, threading.current_thread().name)
    finally:
        fetched.close()


def test_a_failure_in_the_thread_surfaces_in_example(assets):
    src = source(assets)

    def broken(j):
        raise RuntimeError(f"target failed on conversation {j}")

    src._features = broken
    src.prefetch([1])
    with pytest.raises(RuntimeError, match="conversation 1"):
        src.example(1)
    src.close()


def test_a_run_trains_to_the_same_weights_with_and_without_prefetch(assets, tmp_path, monkeypatch):
    target, chat = assets
    compute = OnlineSource._conversation_features
    runs = {}
    for on in (False, True):
        threads: list[str] = []

        def spy(self, j, threads=threads):
            threads.append(threading.current_thread().name)
            return compute(self, j)

        monkeypatch.setattr(OnlineSource, "_conversation_features", spy)
        cfg = TrainConfig(drafter="peagle", output=str(tmp_path / f"p{on}"), target=str(target), data=str(chat),
                          seq_len=48, max_steps=3, batch_size=2, lr=3e-3, val_examples=2, mask_builder="dense",
                          prefetch=on, eval_every=2, drafter_options=small_options(k_train=3))
        result = train(cfg, progress=False)
        runs[on] = (load_file(str(ckpt.resolve(result.checkpoint) / "model.safetensors")), result.metrics, threads)
    (a, ma, ta), (b, mb, tb) = runs[False], runs[True]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [m.get("train_loss") for m in ma] == [m.get("train_loss") for m in mb]
    # no feature is computed twice or wasted: steps 2 and 3 (2 sequences each) came from the thread
    assert len(ta) == len(tb)
    assert sum(name.startswith("specframe-prefetch") for name in tb) == 4
    assert not any(name.startswith("specframe-prefetch") for name in ta)


class _OnCuda(_Sequences):
    # features made on the CPU, but the thread takes the CUDA side-stream path (the stream API is faked below)
    def _device(self):
        return torch.device("cuda", 0)


def test_a_kept_prefetch_is_published_only_after_its_side_stream_finished(monkeypatch):
    class SlowStream:
        synced = False

        def __init__(self, device=None):
            pass

        def synchronize(self):
            time.sleep(0.3)  # the target's kernels still running on the side stream
            SlowStream.synced = True

    monkeypatch.setattr(torch.cuda, "Stream", SlowStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    recorded: list[dict] = []
    monkeypatch.setattr(data, "_record_on_current_stream", recorded.append)
    ids = torch.arange(6)
    src = _OnCuda([api.TrainingExample(ids, torch.ones(6, dtype=torch.bool), torch.zeros_like(ids))], 8, False,
                  lambda j: {"aux_hidden": torch.ones(6, 4)})
    src.keep_features(None)  # every sequence kept: example() takes the memo entry without waiting for the thread
    src.prefetch([0])
    try:
        deadline = time.monotonic() + 10
        while 0 not in src._memo and time.monotonic() < deadline:
            time.sleep(0.01)
        assert SlowStream.synced, "the kept features were visible before the side stream was synchronised"
        feats = src.example(0).features
        # kept features made on the side stream are recorded on the caller's stream like the pending ones (item 17)
        assert recorded == [feats]
        # a later use of the kept entry is not the side stream's any more
        src.example(0)
        assert recorded == [feats]
    finally:
        src.close()
