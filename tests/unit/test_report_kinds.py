"""The results kinds table (``specframe.report.kinds.KINDS``): every kind a benchmark writes has a row, the page runs
the sections the table names in its order, and a new kind is one row (a fixture kind shows up on the page)."""

from __future__ import annotations

import re
from pathlib import Path

from specframe import results
from specframe.report import kinds, render, summary

ROOT = Path(__file__).resolve().parents[2]


def written_kinds() -> set[str]:
    """The kinds the writers name: ``write_results(..., kind="...")`` in benchmarks/ and ``KIND = "..."`` constants
    in benchmarks/ and specframe/."""
    found = set()
    for path in [*ROOT.joinpath("benchmarks").glob("*.py"), *ROOT.joinpath("specframe").rglob("*.py")]:
        text = path.read_text(encoding="utf-8")
        found |= set(re.findall(r'\bkind="([^"]+)"', text)) if path.parts[-2] == "benchmarks" else set()
        found |= set(re.findall(r'^KIND = "([^"]+)"', text, flags=re.M))
    return found


def test_every_written_kind_has_a_row():
    names = [kind.name for kind in kinds.KINDS]
    assert len(names) == len(set(names))
    missing = written_kinds() - set(names)
    assert not missing, f"results kinds without a row in specframe.report.kinds.KINDS: {sorted(missing)}"


def test_sections_run_once_in_table_order_and_say_nothing_without_their_files():
    before = kinds.sections("before")
    assert before == [kinds.KINDS[0].section, kinds.KINDS[3].section, kinds.KINDS[4].section]  # jobs shared by three
    assert kinds.sections("before", summary=True) == before[:2]
    for section in before + kinds.sections("after"):
        assert section([]) == []


def _write(path: Path, kind: str) -> None:
    prov = results.provenance(target={"id": "tiny", "weights_hash": "sha256:abc"}, token_budget=1000,
                              command=["pytest"])
    results.write_results(path, kind=kind, metrics={"figure": 1.5}, per_prompt=[], provenance=prov)


def test_a_new_kind_is_one_row(tmp_path, monkeypatch):
    _write(tmp_path / "new.json", "bench.fixture")

    def fixture_section(documents):
        return [f"## Fixture: {len([d for _, d in documents if d['kind'] == 'bench.fixture'])} file(s)", ""]

    row = kinds.Kind("bench.fixture", "a test", fixture_section, place="before", in_summary=True)
    monkeypatch.setattr(kinds, "KINDS", (*kinds.KINDS, row))
    page = render(tmp_path).read_text()
    assert "## Fixture: 1 file(s)" in page and "## bench.fixture" in page  # its section and its scalar table
    assert summary(tmp_path)[0] == "## Fixture: 1 file(s)"
