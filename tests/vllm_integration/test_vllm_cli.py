"""`specframe export --format vllm` and `specframe serve`.

A third-party drafter (installed into a temporary site, as pip would) implements ``export_vllm`` with
``api.vllm_layouts``; export goes through the real checkpoint loader and plugin registry. The live serve test starts
vLLM's OpenAI server on loopback, asks for one completion and stops it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from click.testing import CliRunner

from specframe.cli import main
from specframe.layouts import export
from specframe.vllm import vllm_available
from tests.plugin_fixtures import FakeSite
from tests.vllm_fixtures import build_target

TOY = """
    from specframe import api

    class Toy(api.Drafter):
        name = "toypard"
        def feature_spec(self): raise NotImplementedError
        def module(self): raise NotImplementedError
        def supervision(self, example): raise NotImplementedError
        def loss(self, example, elements, segment, attention): raise NotImplementedError
        def start(self, prompt_ids, features): raise NotImplementedError
        def propose(self, k, generator=None): raise NotImplementedError
        def accept(self, emitted, features): raise NotImplementedError
        def load(self, directory): pass

        def export_vllm(self, directory, tokenizer):
            import torch
            from transformers import LlamaConfig, LlamaForCausalLM

            torch.manual_seed(0)
            cfg = api.vllm_layouts.llama_config(self.target_config, 1, architectures=["LlamaForCausalLM"],
                                                 model_type="llama", tie_word_embeddings=False)
            model = LlamaForCausalLM(LlamaConfig(**cfg))
            return api.vllm_layouts.write_pard(directory, model.state_dict(), config=cfg,
                                               pard_token=tokenizer.convert_tokens_to_ids("<|reserved_0|>"),
                                               tokenizer=tokenizer, drafter=self.name)

    class Plain(Toy):
        name = "toyplain"
        export_vllm = api.Drafter.export_vllm

    @api.hookimpl
    def register_drafters(register):
        register(Toy)
        register(Plain)
"""


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    site = FakeSite(tmp_path / "site", monkeypatch)
    (tmp_path / "site").mkdir(exist_ok=True)
    site.add("specframe-toypard", "toypard", TOY)
    target = build_target(tmp_path / "target")

    def make(drafter: str):
        ckpt = tmp_path / f"run-{drafter}" / "step-00000001"
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text(json.dumps({"step": 1}))
        (ckpt / "config.json").write_text(json.dumps({"drafter": drafter, "target": str(target)}))
        (ckpt.parent / "latest").write_text(ckpt.name)
        return ckpt.parent

    yield make, target
    from specframe import plugins

    plugins.reset()


def test_export_writes_the_drafters_layout(checkpoint, tmp_path):
    make, target = checkpoint
    out = tmp_path / "exported"
    result = CliRunner().invoke(main, ["export", "--checkpoint", str(make("toypard")), "--format", "vllm",
                                       "--output", str(out), "--k", "4", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert (data["layout"], data["drafter"], data["target"]) == ("pard", "toypard", str(target))
    assert data["speculative_config"] == export.speculative_config(out, 4)
    assert json.loads((out / "config.json").read_text())["pard_token"] > 0
    assert (out / "tokenizer.json").exists()


def test_export_of_a_drafter_without_vllm_support_fails_clearly(checkpoint, tmp_path):
    make, _ = checkpoint
    result = CliRunner().invoke(main, ["export", "--checkpoint", str(make("toyplain")), "--output", str(tmp_path / "x")])
    assert result.exit_code == 1
    assert "drafter 'toyplain' cannot be exported to vLLM" in result.output
    assert not (tmp_path / "x").exists()


def test_serve_builds_the_vllm_command(checkpoint, tmp_path):
    make, target = checkpoint
    out = tmp_path / "exported"
    assert CliRunner().invoke(main, ["export", "--checkpoint", str(make("toypard")), "--output", str(out)]).exit_code == 0
    result = CliRunner().invoke(main, ["serve", "--target", str(target), "--drafter", str(out), "--k", "3",
                                       "--port", "8123", "--print-command", "--json", "--", "--max-num-seqs", "2"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    argv = data["argv"]
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == str(target)
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == export.speculative_config(out, 3)
    assert argv[-2:] == ["--max-num-seqs", "2"]
    assert data["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_serve_refuses_a_folder_that_is_not_an_export(tmp_path):
    result = CliRunner().invoke(main, ["serve", "--target", "x", "--drafter", str(tmp_path), "--print-command"])
    assert result.exit_code == 1 and "not a vLLM drafter export" in result.output


def test_serve_runs_a_speculators_export_as_vllm_serve_export(tmp_path):
    from tests.vllm_fixtures import build_drafter

    target = build_target(tmp_path / "target")
    out = build_drafter("peagle", target, tmp_path / "pe", k=3)

    def argv(*extra):
        result = CliRunner().invoke(main, ["serve", "--drafter", str(out), "--print-command", "--json", *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["argv"]

    alone = argv()  # `vllm serve EXPORT`: vLLM starts the verifier the folder names
    assert alone[alone.index("--model") + 1] == str(out.resolve()) and "--speculative-config" not in alone
    k4 = argv("--k", "4")
    assert json.loads(k4[k4.index("--speculative-config") + 1]) == {"num_speculative_tokens": 4}
    explicit = argv("--target", str(target))  # the target as model, the export in an explicit config
    assert explicit[explicit.index("--model") + 1] == str(target)
    assert json.loads(explicit[explicit.index("--speculative-config") + 1]) == export.speculative_config(out, 3)
    export.set_serving(out, verifier=str(tmp_path / "gone"))
    result = CliRunner().invoke(main, ["serve", "--drafter", str(out), "--print-command"])
    assert result.exit_code == 1 and "names the verifier" in result.output and "not a folder here" in result.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make setup VLLM=cpu|gpu installs it)")
@pytest.mark.parametrize("kind", ["pard", "eagle3-folder", "parallelspec"])
def test_serve_answers_a_completion_on_loopback(checkpoint, tmp_path, kind):
    """PARD beside its target; a speculators EAGLE-3 export served alone (`vllm serve EXPORT`); ParallelSpec through
    specframe's vLLM general plugin (loaded by the server process from the entry point)."""
    from tests.vllm_fixtures import build_drafter

    make, target = checkpoint
    out = tmp_path / "exported"
    if kind == "pard":
        assert CliRunner().invoke(main, ["export", "--checkpoint", str(make("toypard")), "--output", str(out)]).exit_code == 0
        where = ["--target", str(target), "--k", "3"]
    elif kind == "parallelspec":
        from specframe import plugins
        from tests.vllm_fixtures import AUX, target_parts

        config, tok = target_parts(target)
        cls = plugins.get("drafter", "parallelspec")
        drafter = cls(config, cls.Options(layers=1, aux_layer_ids=AUX, draft_vocab_size=160, k_train=4))
        drafter.mask_token_ids = [tok.convert_tokens_to_ids(f"<|reserved_{i}|>") for i in range(3)]
        drafter.export_vllm(out, tok)
        where = ["--target", str(target), "--k", "3"]
    else:
        build_drafter("eagle3", target, out, k=3)
        where = []
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "specframe", "serve", *where, "--drafter", str(out),
         "--port", str(port), "--dtype", "float32", "--max-model-len", "256"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
                    model = json.loads(r.read())["data"][0]["id"]
                break
            except OSError:
                assert time.monotonic() < deadline, "vLLM server did not come up in 300 s"
                time.sleep(2)
        body = json.dumps({"model": model, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 8
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
