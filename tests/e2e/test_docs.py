"""The front page and the book: README stays a front page, the docs site builds strictly, every design citation in the
code resolves, and no document points outside the repository.

(The per-hook reference is checked against the hookspecs in tests/contract/test_hooks_documented.py.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "design.md"
README_MAX_LINES = 150

#: "docs/design.md section 8", "docs/design.md sections 3, 4 and 8", "docs/design.md section 8.1"
_CITATION = re.compile(r"design\.md,? sections? (\d+(?:\.\d+)*(?:(?:,| and|, and) \d+(?:\.\d+)*)*)", re.IGNORECASE)
#: the old spelling, which named a file that was never in the repository
_OLD_CITATION = re.compile(r"(?<![/\w])DESIGN\.md sections?\b")
_SECTION_HEADING = re.compile(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", re.MULTILINE)
#: Markdown links and images: [text](target) / ![alt](target)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
#: the team's shared folders and this machine's work tree; spelt with a character class so this file names neither
_OUTSIDE_WORDS = re.compile(r"\.\./shared|(?<![\w.])shared[/](?:reviews|data)|/work[/]|/home[/]|/root[/]", re.IGNORECASE)
_CODE_DIRS = ("specframe", "plugins", "packages", "tests", "benchmarks", "examples")


def documents() -> list[Path]:
    """Every hand-written document of the repository: the front page, CONTRIBUTING, the docs site and its config,
    and the READMEs of the example and plugin packages."""
    found = [README, ROOT / "CONTRIBUTING.md", ROOT / "mkdocs.yml"]
    found += sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "docs").rglob("*.py"))
    found += sorted((ROOT / "examples").glob("*/README.md")) + sorted((ROOT / "packages").glob("*/README.md"))
    return [p for p in found if p.is_file()]


def code_files() -> list[Path]:
    files = []
    for folder in _CODE_DIRS:
        files += [p for p in (ROOT / folder).rglob("*.py") if "egg-info" not in str(p) and "/build/" not in str(p)]
    return sorted(files)


# ----------------------------------------------------------------------------------------------------- the front page


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the front page keeps at most " \
        f"{README_MAX_LINES} (move the rest into docs/)"


def test_readme_gives_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert "## The two commands" in text
    assert re.search(r"^make demo +# set up \.venv and run the main job", text, re.MULTILINE), "README lost `make demo`"
    assert re.search(r"^make test +# set up \.venv and run the whole test suite", text, re.MULTILINE), \
        "README lost `make test`"


def test_readme_headline_is_the_committed_report():
    """The answer's table in README is the committed report's, row for row, and README names the command that
    reproduces it, so the front page cannot drift from the results files."""
    text = README.read_text(encoding="utf-8")
    report = (ROOT / "benchmarks" / "results" / "cpu" / "report.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if re.match(r"\| (dflash|eagle3|parallelspec|pard|peagle) \|", line)]
    assert rows, "README's headline table is gone"
    for row in rows:
        assert row in report, f"README row not in benchmarks/results/cpu/report.md (regenerated?): {row}"
    assert "specframe report benchmarks/results/cpu --summary" in text
    assert "make bench PRESET=cpu-large" in text


def test_readme_links_resolve_inside_the_repository():
    text = README.read_text(encoding="utf-8")
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (ROOT / target.split("#")[0]).resolve()
        assert ROOT in path.parents and path.exists(), f"README.md links to {target}, which is not in the repository"


# ------------------------------------------------------------------------------------------------------- the design


def design_sections() -> set[str]:
    return set(_SECTION_HEADING.findall(DESIGN.read_text(encoding="utf-8")))


def design_citations() -> list[tuple[str, int, str]]:
    found = []
    for path in code_files():
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for group in _CITATION.findall(line):
                for number in re.findall(r"\d+(?:\.\d+)*", group):
                    found.append((f"{path.relative_to(ROOT)}:{lineno}", lineno, number))
    return found


def test_design_has_numbered_sections():
    sections = design_sections()
    assert {"3", "4", "7", "8"} <= sections, sorted(sections)


def test_every_design_citation_resolves():
    citations = design_citations()
    assert len(citations) >= 30, f"only {len(citations)} design citations found: has the spelling changed?"
    sections = design_sections()
    missing = [f"{where}: section {number}" for where, _, number in citations if number not in sections]
    assert not missing, "the code cites docs/design.md sections it does not have:\n" + "\n".join(missing)


def test_no_citation_of_a_file_outside_the_repository():
    old = [f"{path.relative_to(ROOT)}:{lineno}" for path in code_files()
           for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
           if _OLD_CITATION.search(line)]
    assert not old, "cite docs/design.md, not DESIGN.md:\n" + "\n".join(old)


# ------------------------------------------------------------------------------------------- nothing outside the repo


def test_no_document_refers_outside_the_repository():
    offenders = []
    for path in documents():
        text = path.read_text(encoding="utf-8")
        for lineno, line in enumerate(text.splitlines(), 1):
            if _OUTSIDE_WORDS.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
        if path.suffix != ".md":
            continue
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if target.startswith("/"):
                offenders.append(f"{path.relative_to(ROOT)}: absolute link {target}")
                continue
            resolved = (path.parent / target.split("#")[0]).resolve()
            if resolved != ROOT and ROOT not in resolved.parents:
                offenders.append(f"{path.relative_to(ROOT)}: link {target} leaves the repository")
    assert not offenders, "documents pointing outside the repository:\n" + "\n".join(offenders)


def test_outside_check_bites(tmp_path):
    assert _OUTSIDE_WORDS.search("see " + "../" + "shared/reviews/2026-12-architecture.md")
    assert _OUTSIDE_WORDS.search("/".join(["", "work", "main", "README.md"]))
    assert not _OUTSIDE_WORDS.search("benchmarks/results/cpu/report.md")
    assert _LINK.findall("[a](../../x.md) ![b](c.png)") == ["../../x.md", "c.png"]


# ------------------------------------------------------------------------------------------------------ the site


def _mkdocs_available() -> bool:
    return all(importlib.util.find_spec(m) for m in ("mkdocs", "material", "mkdocstrings", "mkdocs_click"))


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """``mkdocs build --strict`` (what ``make docs`` and CI run) into a temporary folder, once per module."""
    if not _mkdocs_available():
        if os.environ.get("CI"):
            pytest.fail("the docs extras are not installed: pip install -e '.[docs]' (make setup does)")
        pytest.skip("the docs extras are not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    return done, out


@pytest.fixture(scope="module")
def site(build) -> Path:
    done, out = build
    if done.returncode:
        pytest.fail("mkdocs build --strict failed (test_docs_build_strictly shows why)")
    return out


def test_docs_build_strictly(build):
    done, site = build
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert (site / "index.html").is_file()
    assert (site / "design" / "index.html").is_file()
    assert (site / "bad-inputs" / "index.html").is_file()


def test_results_pages_are_the_generated_reports(site):
    reports = sorted((ROOT / "benchmarks" / "results").glob("*/report.md"))
    assert reports
    for report in reports:
        page = site / "results" / report.parent.name / "index.html"
        assert page.is_file(), f"no docs page for {report.relative_to(ROOT)}"
        html = page.read_text(encoding="utf-8")
        assert f"specframe report benchmarks/results/{report.parent.name}" in html
        for image in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", report.read_text(encoding="utf-8")):
            assert (page.parent / image).is_file(), f"{report.relative_to(ROOT)}'s figure {image} is not published"


def test_api_page_has_every_version(site):
    from specframe import api

    html = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "Version history" in html
    for version in range(1, int(api.API_VERSION) + 1):
        assert re.search(rf"&quot;{version}&quot;|\"{version}\"", html), f"API version {version} missing"
    for name in ("Drafter", "MaskBuilder", "Partitioner", "Verifier", "ElementSet"):
        assert f'id="specframe.api.{name}"' in html, f"the API page does not document specframe.api.{name}"


def test_cli_page_has_every_command(site):
    from specframe.cli import COMMANDS

    html = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    for command in COMMANDS:
        assert f'id="specframe-{command}"' in html, f"the CLI reference has no `specframe {command}`"


def test_readme_answer_quotes_only_what_the_reports_print():
    """Every figure in README's answer (each decimal number, interval and token count) is one that `specframe report`
    prints from the committed results folders the section names (`--summary`, or the folder's report.md page), so a
    stale or hand-rounded figure fails here."""
    from specframe import report

    text = README.read_text(encoding="utf-8")
    section = text[text.index("## The answer so far"):text.index("## The two commands")]
    folders = sorted(set(re.findall(r"benchmarks/results/([\w-]+)", section)))
    assert folders, "README's answer names no results folder"
    # what `report --summary` prints now, and the pages `specframe report` wrote (their tables)
    printed = "\n".join([line for name in folders for line in report.summary(ROOT / "benchmarks" / "results" / name)]
                        + [(ROOT / "benchmarks" / "results" / name / "report.md").read_text() for name in folders])
    # a figure with its interval is checked as one ("0.99 [0.97, 1.02]", an "x" after the value or not), the others
    # (bare decimals, token counts) each alone
    unit = lambda t: re.sub(r"(\d)x \[", r"\1 [", t)  # noqa: E731
    printed, section = unit(printed), unit(section)
    banded = r"\d+\.\d+ \[\d+\.\d+, \d+\.\d+\]"
    figures = re.findall(banded, section)
    figures += re.findall(r"(?<![\d.,\[])\d+\.\d+(?![\d.]| \[)|\d{1,3}(?:,\d{3})+", re.sub(banded, "", section))
    assert figures, "README's answer quotes no figure"
    stale = [figure for figure in figures if figure not in printed]
    assert not stale, f"README's answer quotes figures no committed report prints: {stale}"


def test_deviations_quote_only_what_the_committed_results_give():
    """The deviations page's decisions rest on figures: each difference it quotes with its interval ("+0.001 [-0.007,
    +0.009]", validation or served AL against the baseline) is one the committed ablations report prints, and the
    served cost of the whole-vocabulary head (row 6) is the committed vocab_head_cpu.json's, so a figure left stale
    by a rerun, or rounded by hand, fails here."""
    text = (ROOT / "docs" / "training" / "deviations.md").read_text(encoding="utf-8")
    levers = text[text.index("## The levers"):text.index("## What each option does")]
    report = (ROOT / "benchmarks" / "results" / "ablations" / "report.md").read_text(encoding="utf-8")
    differences = re.findall(r"[+-]\d+\.\d+ \[[+-]\d+\.\d+, [+-]\d+\.\d+\]", levers)
    assert len(differences) >= 20, "the levers table quotes fewer measured differences than P-EAGLE's suite gave"
    stale = [figure for figure in differences if figure not in report]
    assert not stale, f"deviations quote differences the ablations report does not print: {stale}"
    # row 6's served cost: the 8,192 head's tokens/s over the whole head's at each K, with the interval over repeats
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script's own rule for which head a method served
    try:
        from vocab_head_cost import head_of
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    metrics = json.loads((ROOT / "benchmarks" / "results" / "vocab_head_cpu.json").read_text())["metrics"]
    label = {(m["k"], head_of(m)): name for name, m in metrics["methods"].items() if head_of(m)}
    ks = sorted({k for k, _ in label})
    assert ks == [2, 3], label
    for k in ks:
        otps = metrics["ratios"][f"{label[k, 'v8192']} / {label[k, 'whole']}"]["otps"]
        quoted = f"{otps['mean']:.2f}x [{otps['low']:.2f}, {otps['high']:.2f}]"
        assert quoted in levers, f"row 6 does not quote K = {k}'s {quoted}"


def test_the_api_version_the_docs_give_is_the_codes():
    """A page that gives the public API's current version ("public API (version N") gives specframe.api's (the
    results audit found README and status at 10 while the code said 11)."""
    from specframe.api import API_VERSION

    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    stated = {(page.name, m.group(1)) for page in pages
              for m in re.finditer(r"public API \(version (\d+)", page.read_text(encoding="utf-8"))}
    assert stated, "no page states the API version any more (docs/status.md did)"
    assert {v for _, v in stated} == {API_VERSION}, f"pages state API versions {sorted(stated)}, the code {API_VERSION}"
