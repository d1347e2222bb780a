"""The peer benchmark (benchmarks/test_peer.py, issue 54 item 1): speculators' data in its file layout equals what the
target computes, both trainers hold out the same conversations, the CPU patches apply to the installed speculators
exactly once (and another release is refused in one line), the report's table, and (slow) the peer-ci preset end to
end: both trainers train a few steps on the tiny target and the same evaluator measures both drafters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import peer_data  # noqa: E402
import peer_speculators  # noqa: E402

needs_speculators = pytest.mark.skipif(peer_speculators.installed_version() is None,
                                       reason="speculators is not installed")


# ------------------------------------------------------------------------------------------------ split
@pytest.mark.parametrize("n,n_val", [(16, 4), (1114, 64), (37, 5), (1000, 100), (3, 1)])
def test_both_trainers_hold_out_the_same_last_conversations(n, n_val):
    train, val = peer_data.specframe_split(n, n_val)
    assert list(val) == list(range(n - n_val, n))
    assert peer_data.speculators_split(n, peer_data.train_data_ratio(n, n_val)) == (train, val)


def test_the_split_follows_speculators_own_boundary_code():
    """speculators' ArrowDataset, read from the installed source, takes rows from int(len * ratio) on."""
    if peer_speculators.installed_version() is None:
        pytest.skip("speculators is not installed")
    source = (peer_speculators.installed_package() / "train" / "data.py").read_text()
    assert "split_idx = int(len(self.data) * train_ratio)" in source
    assert '(0, split_idx) if split == "train" else (split_idx, len(self.data))' in source


def test_speculators_rows_are_the_conversations_specframe_keeps_after_the_cut(monkeypatch):
    """A conversation whose supervision lies past seq_len is dropped by specframe (engine.data): speculators must not
    read it, else every later row moves across the held-out boundary."""
    import torch

    import specframe.cache
    from specframe.cache import Example

    examples = [Example(torch.arange(10), torch.tensor([0] * 5 + [1] * 5)),
                Example(torch.arange(10), torch.tensor([0] * 8 + [1] * 2)),  # supervised only past the cut
                Example(torch.arange(4), torch.tensor([0, 0, 1, 1])),
                Example(torch.arange(6), torch.tensor([0, 1, 0, 0, 0, 0]))]  # the second token only: not usable

    class Cache:
        def __init__(self, _path):
            pass

        def __len__(self):
            return len(examples)

        def __getitem__(self, i):
            return examples[i]

    monkeypatch.setattr(specframe.cache, "FeatureCache", Cache)
    rows = peer_data.rows_from_cache(Path("unused"), 4, seq_len=6)
    assert rows == [(list(range(6)), [0] * 5 + [1]), ([0, 1, 2, 3], [0, 0, 1, 1])]


# ------------------------------------------------------------------------------------------------ states
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from specframe.targets import tiny_target

    path = tmp_path_factory.mktemp("tiny") / "target"
    tiny_target(path, vocab=320, layers=4, hidden=64, heads=2, kv_heads=1, intermediate=128, seed=0)
    return str(path)


def test_a_rows_states_and_ids_in_speculators_layout_are_the_targets(tiny, tmp_path):
    """hs_{i}: [T, n_aux + 1, H], the aux layers being transformers' hidden_states at the same index (the stream
    entering that layer, vLLM's convention) and the last the final layer's output before the norm; token_ids the
    row's ids."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    rows = [([5, 9, 17, 33, 2, 70, 71], [0, 0, 0, 1, 1, 1, 1]), ([8, 3, 4], [0, 1, 1])]
    layers = [1, 2, 3]
    record = peer_data.extract(tiny, rows, layers, tmp_path / "hs", threads=1)
    assert record["first_row"]["norm_of_last_state_is_final"]
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    for i, (ids, _mask) in enumerate(rows):
        stored = load_file(str(tmp_path / "hs" / f"hs_{i}.safetensors"))
        assert stored["token_ids"].tolist() == ids and stored["token_ids"].dtype == torch.long
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        states = stored["hidden_states"]
        assert states.shape == (len(ids), len(layers) + 1, 64) and states.dtype == torch.float32
        for j, layer in enumerate(layers):
            torch.testing.assert_close(states[:, j], hs[layer][0])
        # the last slot is pre-norm: the target's norm of it is transformers' (post-norm) last hidden state
        torch.testing.assert_close(model.model.norm(states[:, -1]), hs[-1][0])
        assert not torch.allclose(states[:, -1], hs[-1][0])


@needs_speculators
def test_speculators_own_reader_takes_the_rows_and_states_in_order(tiny, tmp_path):
    """speculators' ArrowDataset (its file backend) reads the written folder: each split's rows are the rows in
    order, the states pass its token check, the aux layers flattened and the last state apart."""
    import torch
    from speculators.train.data import ArrowDataset

    rows = [([5, 9, 17, 33, 2], [0, 0, 1, 1, 1]), ([8, 3, 4, 6], [0, 1, 1, 1]), ([7, 7, 1], [0, 0, 1])]
    peer_data.write_dataset(rows, 2, tmp_path)
    peer_data.extract(tiny, rows, [1, 2, 3], tmp_path / "hidden_states", threads=1)
    ratio = peer_data.train_data_ratio(len(rows), 1)
    read = {split: ArrowDataset(max_len=64, datapath=tmp_path, on_missing="raise", train_ratio=ratio, split=split,
                                hidden_states_dtype=torch.float32) for split in ("train", "val")}
    assert [read["train"][i]["input_ids"].tolist() for i in range(2)] == [rows[0][0], rows[1][0]]
    (val,) = [read["val"][i] for i in range(len(read["val"]))]
    assert val["input_ids"].tolist() == rows[2][0] and val["loss_mask"].tolist() == rows[2][1]
    assert val["hidden_states"].shape == (3, 3 * 64) and val["verifier_last_hidden_states"].shape == (3, 64)


def test_hidden_states_written_for_other_rows_or_layers_are_never_reused(tmp_path):
    states = tmp_path / "hidden_states"
    states.mkdir()
    (states / "hs_0.safetensors").write_text("old")
    peer_data.claim_states(tmp_path, "layers 1,2,3")  # no claim yet: what is there is of unknown origin
    assert not states.exists()
    states.mkdir()
    (states / "hs_0.safetensors").write_text("kept")
    peer_data.claim_states(tmp_path, "layers 1,2,3")
    assert (states / "hs_0.safetensors").read_text() == "kept"
    peer_data.claim_states(tmp_path, "layers 2,15,27")
    assert not states.exists() and (tmp_path / "hidden_states.key").read_text().strip() == "layers 2,15,27"


def test_speculators_default_aux_layers():
    assert peer_data.target_layer_ids(30) == [2, 15, 27]
    assert peer_data.target_layer_ids(4, [1, 2, 3]) == [1, 2, 3]


# ------------------------------------------------------------------------------------------------ patches
@needs_speculators
def test_each_patch_applies_to_the_installed_speculators_exactly_once():
    package = peer_speculators.installed_package()
    for patch in peer_speculators.PATCHES:
        source = (package / patch.file).read_text()
        assert source.count(patch.old) == 1, patch.why
        patched = peer_speculators.apply(source, patch)
        assert patched != source and patched.count(patch.new) == 1
    compile_all = {}
    for patch in peer_speculators.PATCHES:
        text = compile_all.get(patch.file) or (package / patch.file).read_text()
        compile_all[patch.file] = peer_speculators.apply(text, patch)
    for name, text in compile_all.items():
        compile(text, name, "exec")  # the patched files still parse


@needs_speculators
def test_the_scratch_copy_is_patched_and_the_installed_package_is_not(tmp_path):
    package = peer_speculators.installed_package()
    before = (package / "train" / "trainer.py").read_text()
    dest = peer_speculators.scratch_copy(tmp_path / "copy")
    copied = (dest / "speculators" / "train" / "trainer.py").read_text()
    assert "specframe peer patch" in copied and "specframe peer patch" not in before
    assert (package / "train" / "trainer.py").read_text() == before
    rows = peer_speculators.patch_list()
    assert len(rows) == len(peer_speculators.PATCHES) + len(peer_speculators.CPU_FLAGS)
    assert all(r["file"] and r["change"] and r["why"] for r in rows)


def test_a_patch_that_matches_twice_or_never_is_refused():
    patch = peer_speculators.Patch("x.py", "a = 1\n", "a = 2\n", "why")
    assert peer_speculators.apply("a = 1\nb = 0\n", patch) == "a = 2\nb = 0\n"
    for source in ("a = 1\na = 1\n", "b = 0\n"):
        with pytest.raises(peer_speculators.PeerError, match="not 1"):
            peer_speculators.apply(source, patch)


def test_another_speculators_release_or_none_is_refused_in_one_line():
    with pytest.raises(peer_speculators.PeerError) as e:
        peer_speculators.check_version("0.10.0")
    assert "\n" not in str(e.value) and "0.10.0" in str(e.value) and "0.9.0" in str(e.value)
    with pytest.raises(peer_speculators.PeerError, match="not installed"):
        peer_speculators.check_version(None)
    peer_speculators.check_version(peer_speculators.SUPPORTED_VERSION)


def test_speculators_throughput_is_read_from_its_step_profile():
    import peer_jobs

    log = ("profile/step_ms=2.00e+03,  \n profile/tokens_per_s=100.0,\nval/loss=1\n"
           "profile/step_ms=1000.0,\n  profile/tokens_per_s=300.000,\n")
    got = peer_jobs.speculators_throughput(log)
    assert got["steps"] == 2 and got["train_tokens"] == 500 and got["tokens_per_second"] == pytest.approx(500 / 3)
    exact = peer_jobs.speculators_throughput(log, epoch_tokens=498)
    assert exact["train_tokens"] == 498 and exact["profile_tokens"] == 500
    assert exact["tokens_per_second"] == pytest.approx(498 / 3)


def test_an_unreadable_step_profile_is_an_error_not_a_record():
    import peer_jobs

    for log in ("", "profile/step_ms=10.0,\n"):  # no steps; a step time without its token rate
        with pytest.raises(RuntimeError, match="per-step profile could not be read"):
            peer_jobs.speculators_throughput(log, epoch_tokens=100)


def _flags(args: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    flag = None
    for a in args:
        if a.startswith("--"):
            flag = a
            out[flag] = []
        elif flag is not None:
            out[flag].append(a)
    return out


@pytest.mark.parametrize("drafter", ["peagle", "eagle3"])
def test_matched_speculators_runs_specframes_optimiser_schedule_steps_and_loss(drafter, tmp_path):
    import peer_jobs
    from presets import PRESETS

    p = PRESETS["peer"]
    per_step = peer_jobs.matched_tokens_per_step(p, [278] * 1050)
    assert per_step >= p.seq_len
    args = peer_jobs.speculators_train_args(p, drafter, "matched", "t", tmp_path, 0.9, tmp_path / "run", per_step)
    flags = _flags(args)
    assert flags["--optimizer"] == ["adamw"] and flags["--weight-decay"] == ["0"]
    assert flags["--scheduler-type"] == ["cosine"] and flags["--scheduler-warmup-ratio"] == ["0.1"]
    assert flags["--total-seq-len"] == [str(per_step)] and flags["--epochs"] == ["1"]
    assert flags["--lr"] == [str(p.lr)] and flags["--draft-vocab-size"] == [str(p.draft_vocab)]
    if drafter == "peagle":  # no anchor cap that binds, as specframe's P-EAGLE samples none
        assert flags["--max-anchors"] == [str(per_step)] and flags["--num-depths"] == [str(p.depth)]
    else:  # specframe's EAGLE-3 weighs depth d by depth_decay ** d
        from specframe import plugins

        decay = plugins.get("drafter", "eagle3").Options().depth_decay
        assert flags["--ttt-step-loss-decay"] == [str(decay)] and flags["--ttt-steps"] == [str(p.depth)]
    # every flag the job gives is one the settings list names, with its reason (the results record that list)
    listed = {f for f, _, why in peer_jobs.speculators_settings(p, drafter, "matched", per_step) if why}
    given = set(flags) - set(peer_speculators.CPU_FLAGS) - {"--speculator-type", "--verifier-name-or-path",
                                                              "--data-path", "--save-path", "--train-data-ratio"}
    assert given == listed


@pytest.mark.parametrize("lengths", [[278] * 1050, [250, 256, 240, 256] * 5,
                                     [60, 500, 120, 512, 33, 300, 410, 90] * 40])
def test_matched_packing_takes_specframes_step_count(lengths):
    """The smallest step size whose packing takes no more steps than specframe's batches of 4 conversations: the
    mean tokens a specframe step holds would take more (packing leaves each step part of a row short)."""
    import peer_jobs
    from presets import PRESETS

    p = PRESETS["peer"]
    steps = -(-len(lengths) // p.batch_size)
    size = peer_jobs.matched_tokens_per_step(p, lengths)
    floor = max(p.seq_len, -(-sum(lengths) // steps))  # one sequence; specframe's mean tokens a step
    assert peer_jobs.packed_steps(lengths, size) <= steps  # never more steps than specframe's
    assert size == floor or peer_jobs.packed_steps(lengths, size - 1) > steps  # and the smallest such size
    assert peer_jobs.packed_steps([3, 3, 3, 3], 6) == 2 and peer_jobs.packed_steps([3, 3, 3, 3], 5) == 4


def test_speculators_defaults_change_only_the_epoch_count_and_step_size(tmp_path):
    import peer_jobs
    from presets import PRESETS

    p = PRESETS["peer"]
    args = peer_jobs.speculators_train_args(p, "peagle", "defaults", "t", tmp_path, 0.9, tmp_path / "run", 999)
    flags = _flags(args)
    assert set(flags) - set(peer_speculators.CPU_FLAGS) == {
        "--speculator-type", "--verifier-name-or-path", "--data-path", "--save-path", "--train-data-ratio", "--epochs",
        "--total-seq-len"}
    assert flags["--total-seq-len"] == [str(p.batch_size * p.seq_len)]


def test_the_peer_cache_stores_fp32_states(tmp_path):
    from presets import PRESETS
    from test_peer import PeerWorkspace

    ws = PeerWorkspace(PRESETS["peer-ci"], tmp_path / "w", tmp_path / "r")
    ws._aux_layers = [1, 2]  # nothing loaded: the aux layers are what the preset's drafters read
    assert ws.cache_args()[-2:] == ["--storage-dtype", "float32"]


# ------------------------------------------------------------------------------------------------ report
def _document(trainer, settings, al=None, refused=None, tps=150.0):
    evaluation = {"refused": refused} if refused else {
        "val_expected_al": al, "val_expected_al_interval": {"low": al - 0.01, "high": al + 0.02, "level": 0.95}}
    served = {"gsm8k": {"k": 3, "acceptance_length": 1.5, "acceptance_length_interval": {"low": 1.4, "high": 1.6}}}
    return (f"peagle/{settings}-{trainer}.json", {"kind": "bench.peer", "metrics": {
        "trainer": trainer, "drafter": "peagle", "settings": settings, "train_tokens": 260_000,
        "tokens_per_second": tps, "beside_cores": 0.5, "min_train_tokens": 250_000, "evaluation": evaluation,
        "served": {} if refused else served}})


def test_the_peer_table_has_every_row_with_its_intervals_and_refusals():
    from specframe.report.peer import peer_rows, peer_section

    docs = [_document("specframe", "matched", al=1.4), _document("speculators", "matched", al=1.3, tps=200.0),
            _document("speculators", "defaults", refused="qwen3 layers are not imported"),
            ("other.json", {"kind": "bench.ablation", "metrics": {}})]
    header, rows = peer_rows(docs)
    assert header[:6] == ["trainer", "drafter", "settings", "training tokens", "tok/s (cores beside)",
                          "validation AL"] and header[6:] == ["vLLM AL gsm8k"]
    assert [r[:3] for r in rows] == [["speculators", "peagle", "defaults"], ["speculators", "peagle", "matched"],
                                     ["specframe", "peagle", "matched"]]
    assert rows[0][5] == "refused by the importer: qwen3 layers are not imported"
    assert rows[1][3:6] == ["260,000", "200 (0.5)", "1.300 [1.290, 1.320]"]
    assert rows[2][6] == "1.50 [1.40, 1.60] (K=3)"
    assert rows[0][6] == "not measured"
    text = "\n".join(peer_section(docs))
    assert "| specframe | peagle | matched | 260,000 | 150 (0.5) | 1.400 [1.390, 1.420] |" in text
    assert peer_section(docs[3:]) == []


def test_the_chain_interval_brackets_the_pooled_al():
    from specframe.report.peer import chain_interval

    rows = [[0, 100, 30], [1, 50, 5], [2, 80, 40], [3, 120, 50]]
    pooled = 1 + sum(r[2] for r in rows) / sum(r[1] for r in rows)
    lo, hi = chain_interval(rows)
    assert lo < pooled < hi
    assert chain_interval([[0, 10, 4]] * 3) == (1.4, 1.4)


def test_report_renders_the_peer_section(tmp_path):
    from specframe.report import render
    from specframe.results import provenance, write_results

    for name, doc in [_document("specframe", "matched", al=1.4), _document("speculators", "matched", al=1.3)]:
        write_results(tmp_path / name, kind="bench.peer", metrics=doc["metrics"], per_prompt=[],
                      provenance=provenance(target={"id": "t", "weights_hash": "h"}),
                      config={})
    text = render(tmp_path).read_text()
    assert "## speculators' trainer beside specframe's" in text and "| speculators | peagle | matched |" in text


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
@needs_speculators
def test_peer_ci_trains_both_and_measures_both_with_the_same_evaluator(tmp_path):
    work, results = tmp_path / "work", tmp_path / "results"
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "benchmarks" / "test_peer.py"), "--preset", "peer-ci",
           "--bench-work", str(work), "--results-dir", str(results), "--benchmark-only", "-p", "no:cacheprovider",
           "-q", "-s", "-k", "test_peer_data or (peagle and matched)"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    docs = {t: json.loads((results / "peagle" / f"matched-{t}.json").read_text()) for t in ("specframe", "speculators")}
    val_rows = set()
    for trainer, doc in docs.items():
        m = doc["metrics"]
        assert m["trainer"] == trainer and m["train_tokens"] > 0 and m["tokens_per_second"] > 0
        ev = m["evaluation"]
        assert "refused" not in ev, ev
        assert 1.0 <= ev["val_expected_al"] <= 4.0
        # the same evaluator on the same held-out sequences for both trainers' drafters
        val_rows.add(tuple(r[0] for r in m["val_chain_per_sequence"]))
        assert ev["command"].startswith("specframe train") and "--init-from" in ev["command"]
        assert doc["config"]["speculators_patches"] and doc["config"]["held_out"]["examples"] == 4
        # the settings speculators' command was built from, as its training record kept them; none for specframe
        given = doc["config"]["speculators_settings"]
        if trainer == "speculators":
            assert {"--epochs", "--lr"} <= {s["flag"] for s in given}
            assert all(s["flag"] in doc["config"]["train_command"] for s in given)
        else:
            assert given is None
    (held_out,) = val_rows
    # speculators' validation rows (from int(rows x ratio) on) are the sequences specframe validated on
    data = docs["speculators"]["config"]["data"]
    assert data["val_rows"] == 4 and sorted(held_out) == list(range(data["train_rows"], data["rows"]))
    assert int(data["rows"] * data["train_data_ratio"]) == data["train_rows"]
