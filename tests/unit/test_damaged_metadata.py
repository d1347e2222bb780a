"""``specframe.errors.read_json``: every way a JSON file specframe reads can be damaged is one DamagedFileError
(a SpecframeError: the CLI prints one ``error:`` line) naming the file and what it is. The CLI rows are in
docs/bad-inputs.md (``*-not-json``, run by tests/e2e/test_bad_inputs.py)."""

from __future__ import annotations

import pytest

from specframe.errors import DamagedFileError, SpecframeError, read_json


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"step": 4', "{p} is damaged (the state): not valid JSON (Expecting ',' delimiter: line 1, column 11)"),
        (b"", "{p} is damaged (the state): not valid JSON (Expecting value: line 1, column 1)"),
        (b'{"a": "\xff"}', "{p} is damaged (the state): not UTF-8 text (invalid start byte at byte 7)"),
        (b"[1, 2]", "{p} is damaged (the state): expected a JSON object, got list"),
        (None, "{p} is missing (the state)"),
    ],
    ids=["truncated", "empty", "binary", "not-an-object", "missing"],
)
def test_each_damage_is_one_clear_error_naming_the_file(tmp_path, content, message):
    p = tmp_path / "state.json"
    if content is not None:
        p.write_bytes(content)
    with pytest.raises(DamagedFileError) as err:
        read_json(p, "the state")
    assert isinstance(err.value, SpecframeError)
    assert str(err.value) == message.format(p=p)
    assert "\n" not in str(err.value)


def test_a_valid_document_is_returned(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"a": [1, 2]}')
    assert read_json(p, "x") == {"a": [1, 2]}
    p.write_text("[1]")
    assert read_json(p, "x", expect=list) == [1] and read_json(p, "x", expect=None) == [1]
