"""The defaults the drafter comparison runs at are the documented ones (issue 56: the EAGLE family's COD floor went
from 0.2 to 0.02 and no test noticed).

The equal-budget comparison sets only the depth, the draft vocabulary and K on each drafter; everything else it
compares is a default, so each default is written in a table on the drafter's docs page (``docs/drafters.md`` for the
built-ins, the package pages for DFlash and DSpark and DSpark's ``scheduled`` verifier) and this test holds the code
to those tables: a changed default, a row for an option that is gone, and an option without a row all fail, with the
page to edit named. Components of other distributions (a third-party plugin installed beside) are not this
project's to pin and are left out, so the test holds whatever else is installed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs
import pytest

from specframe import plugins

ROOT = Path(__file__).resolve().parents[2]
#: the distributions whose defaults this project documents
OURS = ("specframe", "specframe-dflash", "specframe-dspark")
BUILTIN_DRAFTERS = {"peagle", "eagle3", "pard", "parallelspec", "ngram"}
#: (kind, name) -> (page, a text of the heading the table follows); built-in drafters: docs/drafters.md, "(`name`)"
TABLES = {
    ("drafter", "dflash"): ("docs/plugins/dflash.md", "## Options"),
    ("drafter", "dspark"): ("docs/plugins/dspark.md", "## Options"),
    ("verifier", "scheduled"): ("docs/plugins/dspark.md", "`scheduled` verifier's options"),
}
HEADER = ["option", "default", "meaning"]


def table_of(kind: str, name: str) -> tuple[str, str]:
    return TABLES.get((kind, name), ("docs/drafters.md", f"(`{name}`)"))


def read_table(page: str, heading: str) -> dict[str, str]:
    """option -> its default cell, from the first ``| option | default | meaning |`` table after the heading line that
    contains ``heading``. A row may name several options with as many comma-separated defaults."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("#") and heading in line), None)
    assert start is not None, f"{page} has no heading with {heading!r}"
    rows: list[list[str]] = []
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert rows and rows[0] == HEADER, f"{page}, after {heading!r}: no | option | default | meaning | table"
    out: dict[str, str] = {}
    for row in rows[2:]:
        names = re.findall(r"`([^`]+)`", row[0])
        cells = [c.strip() for c in row[1].split(",")] if len(names) > 1 else [row[1]]
        assert len(cells) == len(names), f"{page}: row {row[0]} names {len(names)} options and {len(cells)} defaults"
        out.update(zip(names, cells, strict=True))
    return out


def parse_default(cell: str) -> Any:
    """A default cell: ``null`` (what it stands for may follow in brackets), ``true`` / ``false``, a number or a list
    (JSON), or a string in backticks."""
    head = cell.split(" (", 1)[0].strip()
    if head == "null":
        return None
    if head in ("true", "false"):
        return head == "true"
    if len(head) > 1 and head[0] == head[-1] == "`":
        return head[1:-1]
    try:
        return json.loads(head)
    except ValueError:
        raise ValueError(f"cannot read the default {cell!r} (null, true / false, a number, or a `string`)") from None


def same(code: Any, doc: Any) -> bool:
    if isinstance(code, bool) or isinstance(doc, bool):
        return type(code) is type(doc) and code == doc
    if isinstance(code, tuple):
        code = list(code)
    return code == doc


def code_default(field: attrs.Attribute) -> Any:
    d = field.default
    return d.factory() if isinstance(d, attrs.Factory) else d


def ours() -> list[tuple[str, str]]:
    """The drafters of this project's distributions, and the verifiers of its plugin packages (the built-in
    verifiers' options are sampling settings the comparison names itself)."""
    registry = plugins.load()
    dist = {p.name: p.distribution for p in registry.plugins}
    out = []
    for kind in ("drafter", "verifier"):
        for name in registry.names(kind):
            d = dist.get(registry.plugin_of(kind, name))
            if d in OURS and (kind == "drafter" or d != "specframe"):
                out.append((kind, name))
    return out


def test_every_comparison_default_is_the_documented_one():
    components = ours()
    assert BUILTIN_DRAFTERS <= {n for k, n in components if k == "drafter"}  # the test is not vacuous
    problems = []
    for kind, name in components:
        page, heading = table_of(kind, name)
        documented = read_table(page, heading)
        fields = {f.name: f for f in attrs.fields(plugins.get(kind, name).Options)}
        for option, field in fields.items():
            if option not in documented:
                problems.append(f"{kind} '{name}' option '{option}' (default {code_default(field)!r}) has no row in "
                                f"{page} under {heading!r}: add one with its default")
                continue
            doc = parse_default(documented[option])
            if not same(code_default(field), doc):
                problems.append(f"{kind} '{name}' option '{option}': default {code_default(field)!r} in the code, "
                                f"{documented[option]!r} in {page}: change one to match the other, on purpose")
        for option in sorted(set(documented) - set(fields)):
            problems.append(f"{page} under {heading!r} documents '{option}', which {kind} '{name}' does not have")
    assert not problems, "\n".join(problems)


def test_the_tables_are_read_as_written():
    # the reader itself: a misread cell would let a wrong default through
    assert parse_default("0.2") == 0.2 and parse_default("16384") == 16384 and parse_default("[1, 3]") == [1, 3]
    assert parse_default("null (`block_size` - 1)") is None and parse_default("`vanilla`") == "vanilla"
    assert parse_default("true") is True and parse_default("false") is False
    assert not same(1, True) and not same(0.02, 0.2) and same(4.0, 4) and same((1, 2), [1, 2])
    with pytest.raises(ValueError, match="cannot read the default"):
        parse_default("evenly spaced")
    dspark = read_table("docs/plugins/dspark.md", "## Options")
    assert (dspark["ce_weight"], dspark["l1_weight"], dspark["confidence_weight"]) == ("0.1", "0.9", "1.0")
    assert read_table("docs/drafters.md", "(`peagle`)")["cod_min_ratio"] == "0.2"
