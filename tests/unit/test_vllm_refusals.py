"""A drafter the installed vLLM serves at no K (``specframe.vllm.support.prestart``: DSpark on vLLM's CPU build) is
found when the benchmark builds its engine jobs (``bench.vllm_jobs``), so a per-drafter job or the vLLM suite skips
those parts with the reason instead of failing in the first engine's start-up after hours of training."""

from __future__ import annotations

import pytest

from specframe import bench
from specframe.errors import SpecframeError
from specframe.targets import load_target
from tests.train_fixtures import trained_peagle


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    target, run, _ = trained_peagle(tmp_path_factory.mktemp("refusals"), "layers = 1\ndraft_vocab_size = 64")
    return target, run


def test_a_drafter_vllm_serves_at_no_k_is_refused_with_the_reason(trained, tmp_path, monkeypatch):
    from specframe.vllm import support

    target, run = trained
    calls = []

    def cannot(source, export_dir, *, config=None):
        assert config is not None  # handed the config the manifest was read from, not read again
        layout = config["speculators_model_type"]
        calls.append(layout)
        raise SpecframeError(f"the installed vLLM cannot serve this {layout} export for target {source}: no runner")

    monkeypatch.setattr(support, "prestart", cannot)
    config = load_target(target).config
    methods = [bench.checkpoint_method(str(run), config, k=k, label=f"peagle/k{k}") for k in (2, 3)]
    refused: dict[str, str] = {}
    assert bench.vllm_jobs(methods, str(target), tmp_path / "a", refused) == {}
    assert set(refused) == {"peagle/k2", "peagle/k3"} and all(r.endswith(": no runner") for r in refused.values())
    assert calls == ["peagle"]  # one export, checked once
    with pytest.raises(SpecframeError, match="cannot serve this peagle export .*: no runner"):
        bench.vllm_jobs(methods, str(target), tmp_path / "b")  # without a refusal list: one line, before any engine
    monkeypatch.setattr(support, "prestart", lambda *a, **kw: None)
    assert set(bench.vllm_jobs(methods, str(target), tmp_path / "c", {})) == {"peagle/k2", "peagle/k3"}
