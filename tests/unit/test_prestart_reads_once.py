"""``support.prestart`` reads an export's folder once: the manifest it checks is the one its ``config.json`` says, and
``check`` is handed that config instead of reading the file (and the manifest) again."""

from __future__ import annotations

from pathlib import Path

import torch

from specframe import compose
from specframe.layouts import manifest
from specframe.vllm import support


def _export(tmp_path: Path) -> Path:
    from transformers import LlamaConfig

    target = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    target.save_pretrained(tmp_path / "target")
    torch.manual_seed(0)
    drafter = compose.component("drafter", "pard", {"layers": 1, "init_from_target": False}, target)
    drafter.mask_token_id = 300  # the reserved id training would choose
    drafter.export_vllm(tmp_path / "out", None)
    return tmp_path / "out"


def count_reads(monkeypatch, folder: Path) -> list[str]:
    """The names of the files in ``folder`` read (``Path.read_text``) from now on, in order."""
    reads: list[str] = []
    read_text = Path.read_text

    def counted(self, *args, **kwargs):
        if self.parent == folder:
            reads.append(self.name)
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counted)
    return reads


def test_prestart_reads_the_exports_config_once(tmp_path, monkeypatch):
    out = _export(tmp_path)
    monkeypatch.setattr(support, "_model_class", lambda arch: None)  # vLLM's registry: a minute to import on a CPU
    reads, manifests = count_reads(monkeypatch, out), []
    read_manifest = manifest.read_manifest
    monkeypatch.setattr(manifest, "read_manifest", lambda d: manifests.append(d) or read_manifest(d))
    for target in (str(tmp_path / "target"), None):  # None: the verifier the export names, from the same read
        reads.clear()
        support.prestart(target, out)
        assert reads == ["config.json"] and manifests == []


def test_check_alone_still_reads_the_folder(tmp_path, monkeypatch):
    out = _export(tmp_path)
    monkeypatch.setattr(support, "_model_class", lambda arch: None)
    support.check(out, "pard", None)
    support.check(out, "pard", str(tmp_path / "target"), config=manifest.read_config(out))


def test_an_engine_job_reads_the_exports_config_once(tmp_path, monkeypatch):
    """``vllm.jobs.drafter_job``: the manifest, the pre-start check and the speculative config from one read."""
    from specframe.vllm.jobs import drafter_job

    out = _export(tmp_path)
    monkeypatch.setattr(support, "_model_class", lambda arch: None)
    reads = count_reads(monkeypatch, out)
    job = drafter_job(out, 2, str(tmp_path / "target"))
    assert reads == ["config.json"]
    assert job.speculative_config["num_speculative_tokens"] == 2 and job.target == str(tmp_path / "target")


def test_serve_reads_the_exports_config_once(tmp_path, monkeypatch):
    """``specframe serve``: the manifest, the layout check, the pre-start check and the command from one read of
    ``config.json`` (it was read three times)."""
    import json

    from click.testing import CliRunner

    from specframe.cli import main

    out = _export(tmp_path)
    target = tmp_path / "target"
    monkeypatch.setattr(support, "_model_class", lambda arch: None)
    reads = count_reads(monkeypatch, out)
    result = CliRunner().invoke(main, ["serve", "--drafter", str(out), "--target", str(target), "--print-command",
                                       "--json"])
    assert result.exit_code == 0, result.output
    assert reads == ["config.json"]
    assert "--speculative-config" in json.loads(result.output)["argv"]
