"""Robustness fuzzing: hostile inputs may be refused, but only as ``SpecframeError`` (a user's bad data or a broken
plugin) or ``ValueError`` (a programmer passing nonsense to a library function), never as any other crash.

The property tests elsewhere check that valid inputs give correct results; these feed the same entry points
arbitrary bytes, arbitrary JSON and out-of-range arguments.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specframe import api, plugins
from specframe.data.sources import load_chat_file, read_jsonl
from specframe.elements import check_partition, cod_sample, full_grid
from specframe.errors import SpecframeError

ALLOWED = (SpecframeError, ValueError)
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
roles = st.sampled_from(["user", "assistant", "system", "tool", "robot", "", "USER", "gpt", "human"])
messages = st.lists(
    st.fixed_dictionaries({"role": roles | json_values, "content": st.text(max_size=10) | json_values}), max_size=4
)
records = st.dictionaries(
    st.sampled_from(["messages", "conversations", "id", "source", "text"]), messages | json_values, max_size=3
)


def only_allowed(fn, *args, allowed=ALLOWED, **kwargs):
    try:
        return fn(*args, **kwargs)
    except allowed:
        return None


def user_data(fn, *args):
    """A data file is user input: any refusal must be a SpecframeError (a one-line message, no traceback)."""
    return only_allowed(fn, *args, allowed=SpecframeError)


@FUZZ
@given(data=st.binary(max_size=300), suffix=st.sampled_from([".jsonl", ".json", ".jsonl.gz"]))
def test_chat_files_of_random_bytes(tmp_path, data, suffix):
    path = tmp_path / f"f{suffix}"
    path.write_bytes(data)
    user_data(lambda: list(read_jsonl(path)))
    user_data(load_chat_file, path)


@FUZZ
@given(lines=st.lists(records | json_values, max_size=5), suffix=st.sampled_from([".jsonl", ".json"]))
def test_chat_files_of_random_json(tmp_path, lines, suffix):
    path = tmp_path / f"f{suffix}"
    text = json.dumps(lines) if suffix == ".json" else "".join(json.dumps(x) + "\n" for x in lines)
    path.write_text(text)
    data = user_data(load_chat_file, path)
    if data is not None:  # whatever is accepted is a clean list of role/content pairs
        for row in data:
            for m in row["messages"]:
                assert isinstance(m["role"], str) and isinstance(m["content"], str)


small_int = st.integers(min_value=-3, max_value=12)


@FUZZ
@given(n=small_int, depth=small_int, docs=st.lists(st.integers(0, 3), max_size=12))
def test_full_grid_on_any_sizes(n, depth, docs):
    doc = torch.tensor(sorted(docs), dtype=torch.long) if docs else None
    elems = only_allowed(full_grid, n, depth, doc)
    if elems is not None:
        assert len(elems) <= max(n, 0) * max(depth, 0)


@FUZZ
@given(
    sup=st.lists(st.booleans(), max_size=12),
    depth=small_int | st.booleans(),
    ratio=st.floats(allow_nan=True, allow_infinity=True) | st.integers(-2, 2),
    min_ratio=st.floats(allow_nan=True, allow_infinity=True),
    seed=st.integers(0, 2**31),
    dtype=st.sampled_from([torch.bool, torch.long, torch.float32]),
)
def test_cod_sample_on_any_arguments(sup, depth, ratio, min_ratio, seed, dtype):
    supervised = torch.tensor(sup, dtype=torch.bool).to(dtype)
    only_allowed(cod_sample, supervised, depth, ratio, min_ratio, generator=torch.Generator().manual_seed(seed))


@FUZZ
@given(n=st.integers(1, 10), depth=st.integers(1, 4), parts=st.integers(-2, 12), doc_cuts=st.lists(st.integers(1, 9)))
def test_peagle_partitioner_on_any_sizes(n, depth, parts, doc_cuts):
    doc = torch.zeros(n, dtype=torch.long)
    for cut in doc_cuts:
        doc[cut:] += 1 if cut < n else 0
    elems = full_grid(n, depth, doc)
    cls = plugins.get("partitioner", "peagle")
    segs = only_allowed(cls(cls.Options()).partition, elems, parts)
    if segs is not None:
        check_partition(elems, segs, "peagle")


@FUZZ
@given(n=st.integers(1, 8), depth=st.integers(1, 3), data=st.data())
def test_check_partition_on_random_segments(n, depth, data):
    elems = full_grid(n, depth)
    m = len(elems)
    segs = []
    for _ in range(data.draw(st.integers(0, 3))):
        idx = data.draw(st.lists(st.integers(-2, m + 2), max_size=m + 2))
        mask = data.draw(st.lists(st.booleans(), min_size=len(idx), max_size=len(idx) + 1))
        segs.append(api.Segment(torch.tensor(idx, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)))
    only_allowed(check_partition, elems, segs, "fuzz")


@pytest.mark.parametrize("name", ["greedy", "sampling", "tree"])
@FUZZ
@given(data=st.data())
def test_verifiers_on_random_logits_and_drafts(name, data):
    """Any draft the API allows (tokens in the vocabulary, parents topological, N + 1 logit rows) against any logits
    with at least one finite entry per row: the verifier returns a consistent Verification, it never crashes."""
    cls = plugins.get("verifier", name)
    vocab = data.draw(st.integers(1, 6))
    n = data.draw(st.integers(0, 5))
    entry = st.floats(-1e4, 1e4) | st.just(float("-inf"))
    rows = data.draw(st.lists(st.lists(entry, min_size=vocab, max_size=vocab), min_size=n + 1, max_size=n + 1))
    logits = torch.tensor(rows, dtype=torch.float32).reshape(n + 1, vocab)
    finite = torch.isfinite(logits).any(-1)
    logits[~finite, 0] = 0.0
    tokens = torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)), dtype=torch.long)
    parents = None
    if cls.supports_tree and data.draw(st.booleans()):
        parents = torch.tensor([data.draw(st.integers(-1, i - 1)) for i in range(n)], dtype=torch.long)
    probs = None
    if data.draw(st.booleans()):
        raw = torch.rand(n, vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
        probs = raw / raw.sum(-1, keepdim=True)
        probs[torch.arange(n), tokens] += 0.1  # a drawn token had positive drafter probability
        probs = probs / probs.sum(-1, keepdim=True)
    draft = api.Draft(tokens, parents, probs)
    result = cls(cls.Options()).verify(logits, draft, torch.Generator().manual_seed(0))
    assert isinstance(result, api.Verification)
    assert result.emitted.shape[0] == result.accepted.shape[0] + 1
    assert torch.equal(result.emitted[:-1], tokens[result.accepted])
    assert 0 <= int(result.emitted[-1]) < vocab


def _tensor(data, shape_len: int):
    """A tensor that may be of any kind a careless drafter could build: wrong rank, dtype or length."""
    kind = data.draw(st.sampled_from(["long", "float", "bool", "2d", "list"]))
    values = data.draw(st.lists(st.integers(-3, 9), min_size=shape_len, max_size=shape_len))
    if kind == "float":
        return torch.tensor(values, dtype=torch.float32)
    if kind == "bool":
        return torch.tensor(values, dtype=torch.long) > 0
    if kind == "2d":
        return torch.tensor(values, dtype=torch.long).reshape(1, -1)
    if kind == "list":
        return values
    return torch.tensor(values, dtype=torch.long)


@pytest.mark.parametrize("name", ["greedy", "sampling", "tree"])
@FUZZ
@given(data=st.data())
def test_verifiers_behind_api_verify_on_invalid_drafts_and_logits(name, data):
    """Any draft or logits, valid or not: ``api.Draft`` refuses a malformed draft where it is built and
    ``api.verify`` refuses a mismatched pair, both with a clear SpecframeError; whatever passes verifies cleanly."""
    cls = plugins.get("verifier", name)
    n = data.draw(st.integers(0, 4))
    vocab = data.draw(st.integers(1, 8))
    rows = data.draw(st.integers(0, 6))
    logits = torch.randn(rows, data.draw(st.sampled_from([vocab, vocab + 1])),
                         generator=torch.Generator().manual_seed(n))
    if data.draw(st.booleans()):
        logits = logits.long()
    try:
        tokens = _tensor(data, n)
        parents = _tensor(data, data.draw(st.sampled_from([n, n + 1]))) if data.draw(st.booleans()) else None
        probs = torch.rand(data.draw(st.sampled_from([n, n + 1])), vocab) if data.draw(st.booleans()) else None
        draft = api.Draft(tokens, parents, probs)
        result = api.verify(cls(cls.Options()), logits, draft, torch.Generator().manual_seed(0))
    except SpecframeError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert result.emitted.shape[0] == result.accepted.shape[0] + 1
    assert 0 <= int(result.emitted[-1]) < logits.shape[1]
