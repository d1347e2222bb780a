"""Every command that starts vLLM runs the one pre-start check (``specframe.vllm.support.prestart``) first.

Each test replaces the check by one that refuses, and every way vLLM is started (``vllm.LLM`` as the engines import
it, the child processes of ``bench``, the exec of ``serve``) by one that records the start: the command must end on
the check's one line, non-zero, having started nothing and written nothing. vLLM itself is never imported. The last
tests run the real check on exports it refuses (a tanh-GELU drafter, a RoPE split by attention type).
"""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from specframe.cli import main
from specframe.errors import SpecframeError
from tests.target_fixtures import chat_records

REFUSAL = "the installed vLLM cannot run this (the pre-start check, refusing on purpose)"


@pytest.fixture
def guarded(monkeypatch):
    """The check refuses (recording what it was asked), and any vLLM start is recorded instead of run."""
    import multiprocessing

    from specframe.vllm import answer, engine, jobs, states, support

    checked: list[tuple] = []
    started: list[str] = []

    def refuse(target, export_dir=None, *, extract_states=False, config=None):
        checked.append((str(target) if target is not None else None, export_dir, extract_states))
        raise SpecframeError(REFUSAL)

    def start(what):
        def record(*args, **kwargs):
            started.append(what)
            raise AssertionError(f"{what} was started before the pre-start check")
        return record

    monkeypatch.setattr(support, "prestart", refuse)
    for module in (engine, answer, states):  # each binds the engine constructor as its own name
        monkeypatch.setattr(module, "import_llm", start(f"{module.__name__}.import_llm"))
    monkeypatch.setattr(multiprocessing, "get_context", start("a vLLM child process"))
    monkeypatch.setattr(jobs.subprocess, "run", start("a vLLM worker process"))
    monkeypatch.setattr(os, "execve", start("vLLM's server"))
    import specframe.vllm

    monkeypatch.setattr(specframe.vllm, "vllm_available", lambda: True)  # bench asks before anything else
    return checked, started


def refused(result, checked, started):
    assert started == [], started
    assert checked, "the pre-start check was not run"
    assert result.exit_code != 0, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1] == f"error: {REFUSAL}", result.output
    assert "Traceback" not in result.output


@pytest.fixture
def chat(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chat_records(3)))
    return path


def test_bench_acceptance_with_vllm_checks_before_any_engine_starts(guarded, tiny, chat, tmp_path):  # noqa: F811
    checked, started = guarded
    result = CliRunner().invoke(main, ["bench", "acceptance", "--engine", "vllm", "--target", str(tiny.path),
                                       "--drafter", "ngram", "--dataset", str(chat), "--num-prompts", "1",
                                       "--k", "2", "-o", str(tmp_path / "results.json")])
    refused(result, checked, started)
    assert not (tmp_path / "results.json").exists()


def test_serve_checks_before_vllms_server_starts(guarded, tmp_path):
    from tests.vllm_fixtures import build_drafter, build_target

    checked, started = guarded
    target = build_target(tmp_path / "target")
    out = build_drafter("pard", target, tmp_path / "pard")
    for args in (["--target", str(target), "--drafter", str(out)], ["--target", str(target)]):
        result = CliRunner().invoke(main, ["serve", *args])
        refused(result, checked, started)
    assert checked[0] == (str(target), str(out), False)


def test_serve_refuses_a_target_path_that_does_not_exist_before_vllms_server_starts(guarded, tmp_path):
    """vLLM's server took a missing folder for a hub id and ended in a traceback; the target spec is checked first."""
    checked, started = guarded
    for target, message in ((tmp_path / "gone", f"error: target path {tmp_path / 'gone'} does not exist"),
                            (tmp_path, f"error: target folder {tmp_path} has no config.json")):
        result = CliRunner().invoke(main, ["serve", "--target", str(target)])
        assert result.exit_code != 0 and started == [] and checked == [], result.output
        assert result.output.strip().splitlines()[-1].startswith(message), result.output


def test_prepare_with_vllm_checks_before_the_engine_starts(guarded, tiny, chat, tmp_path):  # noqa: F811
    checked, started = guarded
    result = CliRunner().invoke(main, ["prepare", "--target", str(tiny.path), "--data", str(chat), "--output",
                                       str(tmp_path / "cache"), "--engine", "vllm", "--max-length", "256"])
    refused(result, checked, started)
    assert checked[0][2] is True  # the target must hand out its hidden states
    assert not (tmp_path / "cache").exists()


def test_regenerate_with_vllm_checks_before_the_engine_starts(guarded, tiny, chat, tmp_path):  # noqa: F811
    checked, started = guarded
    result = CliRunner().invoke(main, ["regenerate", "--target", str(tiny.path), "--data", str(chat), "--output",
                                       str(tmp_path / "answers.jsonl"), "--engine", "vllm", "--max-new-tokens", "8"])
    refused(result, checked, started)
    assert checked[0] == (str(tiny.path), None, False)
    assert list(tmp_path.iterdir()) == [chat]


def test_regenerate_capture_checks_before_the_engine_starts(guarded, tiny, chat, tmp_path):  # noqa: F811
    checked, started = guarded
    result = CliRunner().invoke(main, ["regenerate", "--target", str(tiny.path), "--data", str(chat), "--output",
                                       str(tmp_path / "answers.jsonl"), "--engine", "vllm", "--max-new-tokens", "8",
                                       "--max-prompt-tokens", "64", "--capture", str(tmp_path / "cache")])
    refused(result, checked, started)
    assert checked[0][2] is True
    assert list(tmp_path.iterdir()) == [chat]


def test_train_with_the_vllm_feature_engine_checks_before_the_engine_starts(guarded, tiny, chat, tmp_path):  # noqa: F811
    checked, started = guarded
    result = CliRunner().invoke(main, ["train", "--drafter", "peagle", "--target", str(tiny.path), "--data",
                                       str(chat), "--seq-len", "48", "--output", str(tmp_path / "run"),
                                       "--mask-builder", "dense", "--max-steps", "1", "--feature-engine", "vllm"])
    refused(result, checked, started)
    assert checked[0][2] is True
    assert list(tmp_path.iterdir()) == [chat]


# --------------------------------------------------------------------------------------- the real check, refusing


@pytest.fixture
def gelu_export(tmp_path, monkeypatch):
    """An EAGLE-3 export for a Gemma-family target (tanh-GELU): vLLM's llama_eagle3 builds silu layers only. vLLM's
    model registry (a minute to import on a CPU) is stubbed out: the rule read here is the export's own config."""
    from specframe.layouts import export
    from specframe.vllm import support
    from tests.vllm_fixtures import AUX, build_target, eagle3_weights, target_parts

    monkeypatch.setattr(support, "_model_class", lambda arch: None)
    target = build_target(tmp_path / "gemma", family="gemma")
    config, _ = target_parts(target)
    export.write_eagle3(tmp_path / "export", eagle3_weights(config, 1, 64), config=export.llama_config(config, 1),
                        aux_layer_ids=AUX, target_hidden_size=config.hidden_size,
                        target_num_layers=config.num_hidden_layers, verifier=export.verifier_name(target))
    return target, tmp_path / "export"


def test_serve_refuses_an_export_vllm_would_build_with_another_activation(gelu_export, monkeypatch):
    target, out = gelu_export
    started = []
    monkeypatch.setattr(os, "execve", lambda *a: started.append(a))
    for args in (["--drafter", str(out)], ["--drafter", str(out), "--target", str(target)]):
        result = CliRunner().invoke(main, ["serve", *args])
        assert result.exit_code == 1 and started == []
        assert result.output.startswith("error: the installed vLLM cannot serve this eagle3 export for target")
        assert "builds only silu layers, and this drafter's activation is the target's gelu_pytorch_tanh" in (
            result.output)
        assert len(result.output.strip().splitlines()) == 1


def test_the_engines_refuse_an_export_before_a_child_starts(gelu_export, monkeypatch):
    """``bench``'s engines (``EngineProcesses``) and ``run_jobs`` check every job in this process, before the first
    child starts."""
    import multiprocessing

    from specframe.layouts.export import speculative_config
    from specframe.vllm import jobs as engines

    target, out = gelu_export
    started = []
    monkeypatch.setattr(multiprocessing, "get_context", lambda *a: started.append(a))
    monkeypatch.setattr(engines.subprocess, "run", lambda *a, **k: started.append(a))
    jobs = {"plain": engines.Job(str(target)), "eagle3": engines.Job(str(target), speculative_config(out, 2))}
    with pytest.raises(SpecframeError, match="builds only silu layers"):
        engines.EngineProcesses(jobs)
    with pytest.raises(SpecframeError, match="builds only silu layers"):
        engines.run_jobs(list(jobs.values()), [[1, 2, 3]])
    with pytest.raises(SpecframeError, match="builds only silu layers"):  # the folder alone, its verifier the target
        engines.run_jobs([engines.Job(str(out), {"num_speculative_tokens": 2})], [[1, 2, 3]])
    assert started == []
