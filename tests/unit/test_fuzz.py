"""Robustness fuzzing: every test states its property and checks both outcomes. An input is either refused with
the documented error class and a one-line message (``SpecframeError`` for a user's bad data, ``ValueError`` /
``UsageError`` for a programmer passing nonsense to a library function, ``InvalidDraftError`` for a malformed draft),
or accepted, and then the result is checked to be valid (never just "did not crash").

The property tests elsewhere check that valid inputs give correct results; these feed the same entry points
arbitrary bytes, arbitrary JSON and out-of-range arguments. CI runs them derandomized (tests/conftest.py); a failing
example found by any run is added to its test with ``@example`` and stays there as a regression test.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specframe import api, plugins
from specframe.data.sources import load_chat_file, read_jsonl
from specframe.drafting.elements import ElementSet, check_partition, cod_sample, full_grid
from specframe.errors import InvalidDraftError, PluginError, SpecframeError, UsageError
from tests.contract.test_visibility_oracle import naive_visible

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
    """``fn``'s result, or None when it refused with one of ``allowed`` and a one-line message."""
    try:
        return fn(*args, **kwargs)
    except allowed as e:
        assert str(e) and "\n" not in str(e), f"{type(e).__name__} without a one-line message: {e!r}"
        return None


def user_data(fn, *args, path=None):
    """A data file is user input: any refusal must be a SpecframeError (a one-line message, no traceback) that
    names the file."""
    try:
        return fn(*args)
    except SpecframeError as e:
        assert str(e) and "\n" not in str(e), repr(e)
        if path is not None:
            assert str(path) in str(e), f"the message does not name the file: {e}"
        return None


def check_chat_rows(data) -> None:
    """What a loader accepts is a list of records whose messages are role / content strings."""
    assert isinstance(data, list)
    for row in data:
        assert isinstance(row["messages"], list)
        for m in row["messages"]:
            assert isinstance(m["role"], str) and isinstance(m["content"], str)


@FUZZ
@given(data=st.binary(max_size=300), suffix=st.sampled_from([".jsonl", ".json", ".jsonl.gz"]))
@example(data=b"\xff\xfe{}", suffix=".jsonl")
@example(data=b"\x1f\x8b\x08\x00", suffix=".jsonl.gz")  # a gzip header cut short
@example(data=b"[]", suffix=".json")
def test_chat_files_of_random_bytes(tmp_path, data, suffix):
    """Random bytes as a data file: a SpecframeError naming the file, or records of role / content strings."""
    path = tmp_path / f"f{suffix}"
    path.write_bytes(data)
    objects = user_data(lambda: list(read_jsonl(path)), path=path)
    if objects is not None:
        assert all(isinstance(o, dict) for o in objects)
    rows = user_data(load_chat_file, path, path=path)
    if rows is not None:
        check_chat_rows(list(rows))


@FUZZ
@given(lines=st.lists(records | json_values, max_size=5), suffix=st.sampled_from([".jsonl", ".json"]))
def test_chat_files_of_random_json(tmp_path, lines, suffix):
    """Any JSON values as records: a SpecframeError naming the file, or a clean list of role / content pairs."""
    path = tmp_path / f"f{suffix}"
    text = json.dumps(lines) if suffix == ".json" else "".join(json.dumps(x) + "\n" for x in lines)
    path.write_text(text)
    data = user_data(load_chat_file, path, path=path)
    if data is not None:
        check_chat_rows(list(data))


small_int = st.integers(min_value=-3, max_value=12)


@FUZZ
@given(n=small_int, depth=small_int, docs=st.lists(st.integers(0, 3), max_size=12))
def test_full_grid_on_any_sizes(n, depth, docs):
    """Any sizes: a ValueError for a non-positive size or a doc vector of another length, else exactly the
    elements (a, d), d < depth, whose position a + d lies in the sequence and in a's document."""
    doc = torch.tensor(sorted(docs), dtype=torch.long) if docs else None
    elems = only_allowed(full_grid, n, depth, doc, allowed=ValueError)
    if n < 1 or depth < 1 or (doc is not None and doc.shape != (n,)):
        assert elems is None
        return
    assert elems is not None
    d = doc if doc is not None else torch.zeros(n, dtype=torch.long)
    expected = [(a, k) for a in range(n) for k in range(depth) if a + k < n and d[a + k] == d[a]]
    assert list(zip(elems.anchor.tolist(), elems.depth.tolist())) == expected
    assert torch.equal(elems.doc, d[elems.anchor])


@FUZZ
@given(
    sup=st.lists(st.booleans(), max_size=12),
    depth=small_int | st.booleans(),
    ratio=st.floats(allow_nan=True, allow_infinity=True) | st.integers(-2, 2),
    min_ratio=st.floats(allow_nan=True, allow_infinity=True),
    seed=st.integers(0, 2**31),
    dtype=st.sampled_from([torch.bool, torch.long, torch.float32]),
)
@example(sup=[True] * 5, depth=3, ratio=float("nan"), min_ratio=0.5, seed=0, dtype=torch.bool)
@example(sup=[True, False, True], depth=True, ratio=0.5, min_ratio=0.0, seed=0, dtype=torch.bool)
def test_cod_sample_on_any_arguments(sup, depth, ratio, min_ratio, seed, dtype):
    """Any arguments: a ValueError / UsageError for a non-bool or empty mask, a depth that is no positive integer
    or a ratio outside its range; else a valid COD set: every position at depth 0, each deeper element a supervised
    position in its anchor's document with its whole chain kept, position-major, at most the rule's count per depth."""
    supervised = torch.tensor(sup, dtype=torch.bool).to(dtype)
    elems = only_allowed(cod_sample, supervised, depth, ratio, min_ratio,
                         generator=torch.Generator().manual_seed(seed))
    valid = (dtype == torch.bool and len(sup) >= 1 and isinstance(depth, int) and not isinstance(depth, bool)
             and depth >= 1 and 0.0 < ratio <= 1.0 and 0.0 <= min_ratio <= 1.0)
    assert (elems is not None) == valid, (valid, elems)
    if elems is None:
        return
    n, n_sup = len(sup), sum(sup)
    pairs = list(zip(elems.anchor.tolist(), elems.depth.tolist()))
    assert pairs == sorted(pairs) and len(set(pairs)) == len(pairs)
    kept = set(pairs)
    assert {a for a, d in pairs if d == 0} == set(range(n))
    for a, d in pairs:
        assert 0 <= d < depth and a + d < n
        if d > 0:
            assert sup[a + d] and (a, d - 1) in kept
    for d in range(1, depth):
        assert sum(1 for _, k in pairs if k == d) <= math.floor(n_sup * max(ratio**d, min_ratio) + 1e-9)


@FUZZ
@given(n=st.integers(1, 10), depth=st.integers(1, 4), parts=st.integers(-2, 12), doc_cuts=st.lists(st.integers(1, 9)))
def test_peagle_partitioner_on_any_sizes(n, depth, parts, doc_cuts):
    """Any segment count: a UsageError / ValueError for a non-positive one, else a partition check_partition
    accepts (each element charged once, every segment causally complete)."""
    doc = torch.zeros(n, dtype=torch.long)
    for cut in doc_cuts:
        doc[cut:] += 1 if cut < n else 0
    elems = full_grid(n, depth, doc)
    cls = plugins.get("partitioner", "peagle")
    segs = only_allowed(cls(cls.Options()).partition, elems, parts)
    assert (segs is None) == (parts < 1), (parts, segs)
    if segs is not None:
        check_partition(elems, segs, "peagle")
        assert is_partition(elems, segs)


def is_partition(elements: ElementSet, segments) -> bool:
    """check_partition's contract written out naively: at least one segment; per segment a strictly increasing
    int64 index into the elements with a bool loss mask of its length; every element charged exactly once; every
    key visible (independent oracle) to a forwarded element forwarded by the same segment."""
    n = len(elements)
    if not segments:
        return False
    charged = [0] * n
    for seg in segments:
        idx, lm = seg.elements.tolist(), seg.loss_mask
        if lm.dtype != torch.bool or len(lm) != len(idx) or any(not 0 <= i < n for i in idx):
            return False
        if any(b <= a for a, b in zip(idx, idx[1:])):
            return False
        for i, charge in zip(idx, lm.tolist()):
            charged[i] += int(charge)
        if idx:
            sees = naive_visible(elements.subset(torch.tensor(idx)), elements)
            if not set(sees.any(0).nonzero().squeeze(1).tolist()) <= set(idx):
                return False
    return charged == [1] * n


@FUZZ
@given(n=st.integers(1, 8), depth=st.integers(1, 3), data=st.data())
@example(n=3, depth=2, data=None)  # None: one segment of everything, all charged (valid)
def test_check_partition_on_random_segments(n, depth, data):
    """Random segments: check_partition raises a PluginError naming the partitioner exactly when they are not a
    valid partition (the naive statement above), and accepts them otherwise."""
    elems = full_grid(n, depth)
    m = len(elems)
    segs = []
    if data is None:
        segs = [api.Segment(torch.arange(m), torch.ones(m, dtype=torch.bool))]
    else:
        for _ in range(data.draw(st.integers(0, 3))):
            if data.draw(st.booleans()):  # often valid-looking: sorted distinct indices in range
                idx = sorted(set(data.draw(st.lists(st.integers(0, m - 1), max_size=m))))
            else:
                idx = data.draw(st.lists(st.integers(-2, m + 2), max_size=m + 2))
            mask = data.draw(st.lists(st.booleans(), min_size=len(idx), max_size=len(idx) + 1))
            segs.append(api.Segment(torch.tensor(idx, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)))
    try:
        check_partition(elems, segs, "fuzz")
        refused = None
    except PluginError as e:
        refused = e
        assert str(e).startswith("partitioner 'fuzz'") and "\n" not in str(e), str(e)
    assert (refused is None) == is_partition(elems, segs), refused


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
    ``api.verify`` refuses a mismatched pair, both with a one-line InvalidDraftError (a tree for a chain-only
    verifier: UsageError); whatever passes verifies into a consistent result, never an error blaming the verifier."""
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
    except (InvalidDraftError, UsageError) as e:
        # the draft or the pair refused before the verifier runs (or a tree for a chain-only verifier); any other
        # PluginError would be api.verify blaming this built-in verifier's result, a bug, and fails the test
        assert str(e) and "\n" not in str(e)
        return
    assert result.emitted.shape[0] == result.accepted.shape[0] + 1
    assert 0 <= int(result.emitted[-1]) < logits.shape[1]


def test_ci_runs_hypothesis_derandomized():
    """tests/conftest.py: CI's profile draws the same examples every run (a red build stays red), and the dev
    profile keeps failures in the repository's fixed example database."""
    from pathlib import Path

    ci = settings.get_profile("ci")
    assert ci.derandomize and ci.database is None and ci.print_blob
    dev = settings.get_profile("dev")
    root = Path(__file__).resolve().parents[2]
    assert getattr(dev.database, "path", None) == root / ".hypothesis" / "examples"
