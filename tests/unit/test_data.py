"""Data sources, assistant-only loss masks, bad input, evaluation sets, regeneration and the default set."""

from __future__ import annotations

import gzip
import json

import pytest

from specframe.data.chat import EncodeStats, encode_conversation, encode_dataset
from specframe.data.evalsets import eval_prompts
from specframe.data.regenerate import read_done, regenerate
from specframe.data.sources import load_chat_file, load_gsm8k, load_sharegpt
from specframe.data.specs import load_data
from specframe.errors import SpecframeError
from specframe.targets import load_target, tiny_target
from tests.target_fixtures import chat_records

CONV = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "I am fine"},
    {"role": "user", "content": "add?"},
    {"role": "assistant", "content": "def add(a, b)"},
]


def _supervised_text(tok, ids, mask):
    pieces, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            pieces.append(tok.decode(cur))
            cur = []
    if cur:
        pieces.append(tok.decode(cur))
    return pieces


def test_loss_mask_covers_assistant_turns_only(tiny):  # noqa: F811
    ids, mask = encode_conversation(tiny.tokenizer, CONV)
    assert len(ids) == len(mask)
    assert _supervised_text(tiny.tokenizer, ids, mask) == ["I am fine<|im_end|>\n", "def add(a, b)<|im_end|>\n"]
    # same ids as the plain template rendering
    assert ids == tiny.tokenizer.apply_chat_template(CONV, tokenize=True, return_dict=True)["input_ids"]


def test_loss_mask_same_with_generation_markers(tmp_path):
    marked = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}"
        "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    t = load_target(tiny_target(tmp_path / "m", chat_template=marked))
    ids, mask = encode_conversation(t.tokenizer, CONV)
    hf = t.tokenizer.apply_chat_template(CONV, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == hf["input_ids"] and mask == hf["assistant_masks"]


def test_loss_mask_smollm2_template_with_default_system_prompt(default_target):  # noqa: F811
    conv = CONV[1:]  # no system message: SmolLM2's template injects its own
    ids, mask = encode_conversation(default_target.tokenizer, conv)
    assert _supervised_text(default_target.tokenizer, ids, mask) == [
        "I am fine<|im_end|>\n",
        "def add(a, b)<|im_end|>\n",
    ]


def test_sources():
    sg = load_sharegpt(limit=5)
    assert len(sg) == 5 and sg[0]["source"] == "sharegpt" and sg[0]["id"] == "QWJhYvA_0"
    assert {m["role"] for r in sg for m in r["messages"]} <= {"system", "user", "assistant"}
    train = load_gsm8k(split="train")
    assert len(train) == 7473 - 200 and train[0]["id"] == "200"
    assert [m["role"] for m in train[0]["messages"]] == ["user", "assistant"]
    assert len(load_gsm8k(split="eval")) == 200
    assert len(load_data("mt-bench")) == 80 and len(load_data("humaneval")) == 164


def test_eval_sets_by_name():
    mt = eval_prompts("mt-bench")
    assert len(mt) == 80 and all(len(p.turns) == 2 for p in mt) and mt[0].id == "81"
    he = eval_prompts("humaneval", limit=3)
    assert [p.id for p in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    gs = eval_prompts("gsm8k")
    assert len(gs) == 200 and gs[0].id == "0" and gs[-1].id == "199" and len(gs[0].turns) == 1
    train_ids = {r["id"] for r in load_gsm8k(split="train")}
    assert not train_ids & {p.id for p in gs}
    with pytest.raises(SpecframeError, match="unknown evaluation set 'mtbench' \\(did you mean 'mt-bench'\\?\\)"):
        eval_prompts("mtbench")


def test_chat_jsonl_and_malformed_line(tmp_path):
    p = tmp_path / "chats.jsonl"
    good = json.dumps({"id": "a", "messages": CONV[1:3]})
    p.write_text(good + "\n{not json\n" + json.dumps({"messages": CONV[1:3]}) + "\n")
    with pytest.raises(SpecframeError, match=f"^{p}:2: malformed JSON line"):
        load_chat_file(p)
    stats: dict = {}
    ds = load_chat_file(p, skip_bad_lines=True, stats=stats)
    assert stats == {"bad_lines": 1} and [r["id"] for r in ds] == ["a", "2"]
    q = tmp_path / "nomsg.jsonl"
    q.write_text(json.dumps({"id": "x", "text": "hi"}) + "\n")
    with pytest.raises(SpecframeError, match=f"^{q}:1 \\(record x\\): no 'messages' field$"):
        load_chat_file(q)
    with pytest.raises(SpecframeError, match="data 'nope.jsonl' is neither a built-in name"):
        load_data("nope.jsonl")


@pytest.mark.parametrize("gz", [False, True])
def test_a_line_past_the_cap_is_refused_or_skipped_without_being_held_whole(tmp_path, monkeypatch, gz):
    """One line is read at most ``MAX_LINE_CHARS`` characters at a time: a file with no line breaks (a binary, a JSON
    array saved as .jsonl) is refused at that length, naming the line, instead of being read whole; with
    ``skip_bad_lines`` the long line is read past in pieces and the next record still loads."""
    import specframe.data.sources as sources

    monkeypatch.setattr(sources, "MAX_LINE_CHARS", 200)
    good = json.dumps({"id": "a", "messages": CONV[1:3]})
    assert len(good) <= 200
    text = good + "\n" + json.dumps({"id": "long", "messages": [{"role": "user", "content": "x" * 1000}]}) + "\n" + \
        json.dumps({"id": "b", "messages": CONV[1:3]}) + "\n"
    p = tmp_path / ("long.jsonl.gz" if gz else "long.jsonl")
    p.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    with pytest.raises(SpecframeError, match=f"^{p}:2: a line longer than 200 characters"):
        load_chat_file(p)
    stats: dict = {}
    ds = load_chat_file(p, skip_bad_lines=True, stats=stats)
    assert stats == {"bad_lines": 1} and [r["id"] for r in ds] == ["a", "b"]
    seen = []
    real = sources._lines

    def spy(f, *args):
        reads = []
        original = f.readline
        f.readline = lambda size=-1: reads.append(size) or original(size)
        yield from real(f, *args)
        seen.extend(reads)

    monkeypatch.setattr(sources, "_lines", spy)
    list(sources.read_jsonl(p, skip_bad_lines=True))
    assert seen and all(0 < size <= 201 for size in seen)  # never an unbounded read
    exact = tmp_path / "exact.jsonl"  # a line of exactly the cap is read
    exact.write_text(json.dumps({"id": "e", "messages": CONV[1:3]}).ljust(200) + "\n")
    assert [r["id"] for r in load_chat_file(exact)] == ["e"]


def test_bad_conversations_are_skipped_and_counted(tiny):  # noqa: F811
    recs = chat_records(3) + [
        {"source": "toy", "id": "empty", "messages": []},
        {"source": "toy", "id": "long", "messages": [{"role": "user", "content": "x " * 300}, {"role": "assistant", "content": "y"}]},
        {"source": "toy", "id": "noasst", "messages": [{"role": "user", "content": "only a question"}]},
    ]
    stats = EncodeStats()
    out = list(encode_dataset(tiny.tokenizer, recs, max_length=200, stats=stats))
    assert [e.id for e in out] == ["0", "1", "2"]
    assert (stats.kept, stats.empty, stats.too_long, stats.no_assistant) == (3, 1, 1, 1)
    assert stats.skipped_ids == ["toy:empty", "toy:long", "toy:noasst"]
    assert stats.summary() == "3 kept, 3 skipped (1 empty, 1 over max length, 1 without assistant turn)"


def test_encoding_in_processes_matches_in_process(tiny, monkeypatch):  # noqa: F811
    from specframe.data import chat
    from specframe.data.sources import _dataset

    used = []
    parallel = chat._encode_in_processes
    monkeypatch.setattr(chat, "_encode_in_processes", lambda tok, ds, procs: used.append(procs) or parallel(tok, ds, procs))

    recs = chat_records(9) + [
        {"source": "toy", "id": "empty", "messages": []},
        {"source": "toy", "id": "long", "messages": [{"role": "user", "content": "x " * 300}, {"role": "assistant", "content": "y"}]},
        {"source": "toy", "id": "noasst", "messages": [{"role": "user", "content": "only a question"}]},
    ] + chat_records(5, source="more")
    ds = _dataset(recs)
    runs = {}
    for workers in (1, 3):
        stats = EncodeStats()
        out = list(encode_dataset(tiny.tokenizer, ds, max_length=200, stats=stats, workers=workers))
        runs[workers] = ([(e.source, e.id, e.input_ids, e.loss_mask) for e in out], stats)
    (one, s1), (three, s3) = runs[1], runs[3]
    assert used == [3]  # the second run went through datasets' map in 3 processes
    assert one == three and len(one) == 14  # same conversations, same order, same tokens and masks
    assert (s1.kept, s1.empty, s1.too_long, s1.no_assistant, s1.skipped_ids) == \
        (s3.kept, s3.empty, s3.too_long, s3.no_assistant, s3.skipped_ids)


def test_a_template_error_in_a_worker_is_the_in_process_error(tiny, monkeypatch):  # noqa: F811
    from specframe.data.sources import _dataset

    # a template that numbers the turns up front renders no conversation as a prefix of the longer one
    monkeypatch.setattr(tiny.tokenizer, "chat_template",
                        "{{ messages|length }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    ds = _dataset(chat_records(6))
    errors = []
    for workers in (1, 2):
        with pytest.raises(SpecframeError) as info:
            list(encode_dataset(tiny.tokenizer, ds, workers=workers))
        errors.append(str(info.value))
    assert errors[0] == errors[1] and errors[0].startswith("record toy:0: the chat template does not render")


def test_data_workers_must_be_positive(tiny):  # noqa: F811
    with pytest.raises(SpecframeError, match="--data-workers must be a positive"):
        list(encode_dataset(tiny.tokenizer, chat_records(2), workers=0))


def test_missing_chat_template_stops(tmp_path):
    t = load_target(tiny_target(tmp_path / "nt", chat_template=None))
    with pytest.raises(SpecframeError, match="has no chat template; conversations cannot be rendered"):
        list(encode_dataset(t.tokenizer, chat_records(1)))


def test_regenerate_resumes_to_the_same_file(tmp_path, tiny):  # noqa: F811
    recs = chat_records(7, turns=1)
    full = tmp_path / "full.jsonl"
    rep = regenerate(tiny, recs, full, batch_size=2, max_new_tokens=6)
    assert rep.generated == 7 and rep.answer_tokens > 0
    part = tmp_path / "part.jsonl"

    class Stop(Exception):
        pass

    def stop_after_two(i, n):
        if i == 2:
            raise Stop

    with pytest.raises(Stop):
        regenerate(tiny, recs, part, batch_size=2, max_new_tokens=6, progress=stop_after_two)
    assert len(read_done(part)) == 4
    with open(part, "a") as f:  # a torn line from a kill mid-write is dropped on resume
        f.write('{"source": "toy", "id": "9", "ans')
    rep2 = regenerate(tiny, recs, part, batch_size=2, max_new_tokens=6)
    assert rep2.already_done == 4 and rep2.generated == 3
    assert part.read_bytes() == full.read_bytes()
    rec = json.loads(full.read_text().splitlines()[0])
    assert set(rec) == {"source", "id", "answer", "prompt_tokens", "answer_tokens", "finished"}


def test_default_training_set_joins_answers_with_prompts():
    from specframe.data.default import ANSWERS, PROVENANCE, load_default

    if not ANSWERS.exists():
        pytest.skip("default training set not generated yet")
    prov = json.loads(PROVENANCE.read_text())
    with gzip.open(ANSWERS, "rt") as f:
        n = sum(1 for _ in f)
    assert prov["counts"]["records"] == n
    ds = load_default(limit=50)
    assert len(ds) == 50
    assert {r["source"] for r in ds} == {"gsm8k", "sharegpt"}  # a prefix mixes the sources
    for r in ds:
        assert [m["role"] for m in r["messages"]][-2:] == ["user", "assistant"]
        if r["source"] == "gsm8k":
            assert int(r["id"]) >= 200  # never the evaluation slice


def test_regenerate_cli_writes_sorted_answers_and_provenance(tmp_path, tiny):  # noqa: F811
    from click.testing import CliRunner

    from specframe.cli import main

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_records(5, turns=1)))
    out = tmp_path / "answers.jsonl.gz"
    args = ["regenerate", "--target", str(tiny.path), "--data", str(data), "--output", str(out),
            "--provenance", str(tmp_path / "prov.json"), "--batch-size", "2", "--max-new-tokens", "4", "--json"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    assert summary["records"] == 5 and summary["generated"] == 5
    with gzip.open(out, "rt") as f:
        assert [json.loads(x)["id"] for x in f] == ["0", "1", "2", "3", "4"]
    prov = json.loads((tmp_path / "prov.json").read_text())
    assert prov["target_weights_hash"] == tiny.weights_hash and prov["counts"]["records"] == 5
    assert prov["batches_logged"] == 3 and prov["generation"]["max_new_tokens"] == 4
    again = CliRunner().invoke(main, args)  # resumes: nothing left to do, same file
    assert json.loads(again.output[again.output.index("{"):])["already_done"] == 5
    fin = CliRunner().invoke(main, args + ["--finalize-only"])  # merge what exists, generate nothing
    assert json.loads(fin.output[fin.output.index("{"):])["generated"] == 0
    assert json.loads((tmp_path / "prov.json").read_text())["counts"]["records"] == 5


def test_prepare_cli_reports_malformed_line(tmp_path, tiny):  # noqa: F811
    from click.testing import CliRunner

    from specframe.cli import main

    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"messages": CONV}) + "\n[1, 2\n")
    res = CliRunner().invoke(main, ["prepare", "--target", str(tiny.path), "--data", str(data), "--output", str(tmp_path / "c")])
    assert res.exit_code == 1
    assert f"error: {data}:2: malformed JSON line" in res.output
    assert not (tmp_path / "c").exists()
    res = CliRunner().invoke(main, ["prepare", "--target", str(tiny.path), "--data", str(data), "--output",
                                    str(tmp_path / "c"), "--skip-bad-lines", "--draft-vocab", "16", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    assert summary["examples"] == 1 and summary["bad_lines_skipped"] == 1


def test_prepare_cli_teacher_top_k(tmp_path, tiny):  # noqa: F811
    from click.testing import CliRunner

    from specframe.cli import main

    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"messages": CONV}) + "\n")
    res = CliRunner().invoke(main, ["prepare", "--target", str(tiny.path), "--data", str(data), "--output",
                                    str(tmp_path / "c"), "--teacher-top-k", "8", "--draft-vocab", "16"])
    assert res.exit_code == 0, res.output
    assert "teacher top-8 holds" in res.output and "of the target's probability mass" in res.output
    res = CliRunner().invoke(main, ["prepare", "--target", str(tiny.path), "--data", str(data), "--output",
                                    str(tmp_path / "d"), "--teacher-top-k", "-2"])
    assert res.exit_code != 0 and "--teacher-top-k must be 0 (none) or a positive" in res.output
    assert not (tmp_path / "d").exists()


def test_kept_progress_survives_a_lost_work_folder(tmp_path, tiny):  # noqa: F811
    """--keep: a copy of the progress, refreshed after every batch, from which a run whose work folder went with its
    machine resumes: nothing generated twice, the batch log not counted twice, the same merged file."""
    import shutil

    from click.testing import CliRunner

    from specframe.cli import main

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_records(5, turns=1)))
    work, kept = tmp_path / "work", tmp_path / "checkout" / "progress"
    out = work / "answers.jsonl.gz"
    args = ["regenerate", "--target", str(tiny.path), "--data", str(data), "--output", str(out), "--keep", str(kept),
            "--provenance", str(work / "prov.json"), "--batch-size", "2", "--max-new-tokens", "4", "--json"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert sorted(p.name for p in kept.iterdir()) == [
        "answers.jsonl.gz.part", "answers.jsonl.gz.part.log", "answers.jsonl.gz.runs.jsonl"]
    merged = out.read_bytes()
    shutil.rmtree(work)  # the machine went
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0, again.output
    summary = json.loads(again.output[again.output.index("{"):])
    assert summary["already_done"] == 5 and summary["generated"] == 0
    assert out.read_bytes() == merged
    assert json.loads((work / "prov.json").read_text())["batches_logged"] == 3


def test_keep_copies_whole_lines_and_restore_never_sets_a_run_back(tmp_path):
    from specframe.data.progress import keep, restore

    work, kept = tmp_path / "work", tmp_path / "kept"
    work.mkdir()
    out = work / "a.jsonl"
    part = work / "a.jsonl.part"
    part.write_text('{"source": "s", "id": "0"}\n{"source": "s", "id": "1"}\n{"source": "s", "id')  # mid-append
    (work / "a.jsonl.part.log").write_text('{"records": 2}\n')
    keep(out, kept)
    assert (kept / "a.jsonl.part").read_text().count("\n") == 2
    assert (kept / "a.jsonl.part").read_text().endswith("}\n")
    assert restore(kept, out) == []  # the work folder holds as much: untouched
    part.write_text(part.read_text() + '": "2"}\n')
    assert restore(kept, out) == []  # ... or more (it went on after the copy)
    part.write_text('{"source": "s", "id": "0"}\n')  # less (an older machine state): everything kept comes back
    assert sorted(p.name for p in restore(kept, out)) == ["a.jsonl.part", "a.jsonl.part.log"]
    assert part.read_text().count("\n") == 2
    with pytest.raises(SpecframeError, match="nothing to keep"):
        keep(tmp_path / "none" / "a.jsonl", kept)
