"""--data beyond JSON files: a datasets folder (save_to_disk), parquet and arrow files, and hub ids with a config
name and a split (NAME:CONFIG:SPLIT)."""

from __future__ import annotations

import datasets
import pytest

from specframe.data import specs
from specframe.errors import SpecframeError
from tests.target_fixtures import chat_records


@pytest.fixture
def table():
    return datasets.Dataset.from_list(chat_records(5))


def as_lists(ds):
    return [(r["id"], [(m["role"], m["content"]) for m in r["messages"]]) for r in ds]


def test_save_to_disk_folder_parquet_and_arrow_read_the_same_records(table, tmp_path):
    want = as_lists(specs.load_data(_jsonl(table, tmp_path)))
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(str(tmp_path / "splits"))
    table.to_parquet(str(tmp_path / "t.parquet"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for spec in (tmp_path / "saved", tmp_path / "splits", tmp_path / "t.parquet", arrow):
        assert as_lists(specs.load_data(str(spec))) == want, spec
    assert len(specs.load_data(str(tmp_path / "t.parquet"), limit=2)) == 2


def test_a_folder_without_train_or_messages_is_one_clear_error(table, tmp_path):
    datasets.DatasetDict({"test": table}).save_to_disk(str(tmp_path / "no-train"))
    with pytest.raises(SpecframeError, match="no 'train'"):
        specs.load_data(str(tmp_path / "no-train"))
    datasets.Dataset.from_list([{"text": "hello"}]).to_parquet(str(tmp_path / "plain.parquet"))
    with pytest.raises(SpecframeError, match="no 'messages' or 'conversations' column .*columns: text"):
        specs.load_data(str(tmp_path / "plain.parquet"))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(SpecframeError, match="not a readable parquet file"):
        specs.load_data(str(tmp_path / "broken.parquet"))


def test_hub_ids_take_a_config_and_a_split(monkeypatch, table):
    calls = []

    def fake(name, config=None, split=None):
        calls.append((name, config, split))
        return table

    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert len(specs.load_data("org/chats")) == 5
    specs.load_data("org/chats:en")
    specs.load_data("org/chats:en:validation")
    specs.load_data("org/chats::test")
    assert calls == [("org/chats", None, "train"), ("org/chats", "en", "train"), ("org/chats", "en", "validation"),
                     ("org/chats", None, "test")]
    for bad in ("chats", "org/chats:a:b:c", "a/b/c:x"):
        with pytest.raises(SpecframeError, match="NAME:CONFIG:SPLIT"):
            specs.load_data(bad)


def _jsonl(table, tmp_path):
    path = tmp_path / "chat.jsonl"
    table.to_json(str(path), lines=True)
    return str(path)
