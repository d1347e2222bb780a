"""A data spec as users type it (``--data``): a built-in name, a local file or datasets folder, or a hub id.

It sits above the raw sources (``specframe.data.sources``) and the committed sets (``specframe.data.default``,
``specframe.data.large``), which read the sources themselves: resolving names here, not in ``sources``, keeps the
imports one way (issue 31: the ``sources <-> default`` circle).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from specframe.data.sources import (BUILTIN, _dataset, load_chat_file, load_gsm8k, load_humaneval, load_mtbench,
                                    load_sharegpt, normalize_messages)
from specframe.errors import SpecframeError
from specframe.values import is_int


def load_data(
    spec: str | os.PathLike, *, limit: int | None = None, skip_bad_lines: bool = False, stats: dict | None = None
) -> Any:
    """Resolve a data spec: a built-in name (see module doc), a local file, or a hub dataset id with ``messages``.
    With ``skip_bad_lines``, malformed JSONL lines are counted in ``stats["bad_lines"]``."""
    s = str(spec)
    check_spec(s)
    if limit is not None and not is_int(limit, 1):
        raise SpecframeError(f"--limit must be a positive number of records, got {limit!r}")
    if s == "sharegpt":
        return load_sharegpt(limit=limit)
    if s == "gsm8k":
        return load_gsm8k(split="train", limit=limit)
    if s == "gsm8k-eval":
        return load_gsm8k(split="eval", limit=limit)
    if s == "mt-bench":
        return load_mtbench(limit=limit)
    if s == "humaneval":
        return load_humaneval(limit=limit)
    if s == "default":
        from specframe.data.default import load_default

        return load_default(limit=limit)
    if s == "large":
        from specframe.data.large import load_large

        return load_large(limit=limit)
    p = Path(s).expanduser()
    if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
        import datasets

        try:
            ds = datasets.load_from_disk(str(p))
        except Exception as exc:  # noqa: BLE001 - datasets raises several types for a damaged folder
            raise SpecframeError(f"data folder {p}: not a readable datasets folder ({exc})") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise SpecframeError(f"data folder {p} holds splits {', '.join(ds)} but no 'train'")
            ds = ds["train"]
        return _conversations(ds, str(p), limit)
    if p.is_file() and p.suffix in (".parquet", ".arrow"):
        import datasets

        try:
            ds = datasets.Dataset.from_parquet(str(p)) if p.suffix == ".parquet" else datasets.Dataset.from_file(str(p))
        except Exception as exc:  # noqa: BLE001 - pyarrow's errors for a damaged file vary
            raise SpecframeError(f"data file {p}: not a readable {p.suffix[1:]} file ({exc})") from None
        return _conversations(ds, str(p), limit)
    if p.exists():
        return load_chat_file(p, limit=limit, skip_bad_lines=skip_bad_lines, stats=stats)
    name, _, rest = s.partition(":")
    config, _, split = rest.partition(":")
    import datasets

    try:
        ds = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as exc:  # noqa: BLE001 - hub / network errors vary
        raise SpecframeError(f"cannot load dataset '{s}': {exc}") from exc
    return _conversations(ds, s, limit)


def check_spec(spec: str | os.PathLike) -> None:
    """Refuse a data spec that names nothing this machine has, without reading any data: not a built-in name, no
    such file or folder, and not shaped as a hub id (NAME, NAME:CONFIG or NAME:CONFIG:SPLIT). A command checks this
    before it loads a target or starts an engine, so a mistyped --data costs seconds, not a 70B model's load."""
    s = str(spec)
    if s == "large":
        from specframe.data.large import ANSWERS

        if not ANSWERS.exists():
            raise SpecframeError(f"the large training set {ANSWERS} is not in this installation yet "
                                 "(`make data-large` generates it)")
        return
    if s in BUILTIN or Path(s).expanduser().exists():
        return
    name, _, rest = s.partition(":")
    if s.startswith((".", "/", "~")) or s.endswith((".jsonl", ".json", ".gz", ".parquet", ".arrow")) \
            or name.count("/") != 1 or rest.count(":") > 1:
        raise SpecframeError(f"data '{s}' is neither a built-in name ({', '.join(BUILTIN)}), a file or datasets "
                             "folder, nor a hub id (NAME, NAME:CONFIG or NAME:CONFIG:SPLIT)")


def _conversations(ds: Any, where: str, limit: int | None) -> Any:
    """A ``datasets.Dataset`` with a ``messages`` (or ShareGPT ``conversations``) column as specframe records."""
    col = "messages" if "messages" in ds.column_names else "conversations"
    if col not in ds.column_names:
        raise SpecframeError(f"dataset '{where}' has no 'messages' or 'conversations' column "
                             f"(columns: {', '.join(ds.column_names)})")
    records = []
    for i, r in enumerate(ds):
        if limit is not None and len(records) >= limit:
            break
        rid = str(r.get("id", i))
        records.append({"source": str(r.get("source") or where), "id": rid,
                        "messages": normalize_messages(r[col], f"{where} record {rid}")})
    return _dataset(records)
