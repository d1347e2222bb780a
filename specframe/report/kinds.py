"""Every results kind the benchmarks write, who writes it, and the section of ``specframe report`` that renders it.

A new benchmark is a suite that writes its own kind (``specframe.results.write_results(kind=...)``) and one row here,
naming the section function that turns its files into markdown; ``specframe.report.page`` reads this table and
nothing else to decide which sections a page has and in which order. A kind without a section still gets the per-kind
table of scalar figures every page ends with. The names are exactly what committed results files carry, drifted
spellings included (``memory_context`` has no ``bench.`` prefix): renaming one would orphan those files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from specframe.report.ablations import ablations_section
from specframe.report.answers import acceptance_section, memory_section, training_section, vllm_section
from specframe.report.jobs import jobs_section
from specframe.report.peer import peer_section

#: a section: every results file of the page (relative name, document) -> its markdown lines ([] when the files hold
#: nothing for it); it picks its own files, and may read other kinds' (the per-drafter answer reads speed files)
Section = Callable[[list[tuple[str, dict[str, Any]]]], list[str]]


@attrs.frozen
class Kind:
    """One results kind: its name in results files, what writes it and the section that renders it."""

    name: str
    written_by: str
    #: None: only the per-kind table of scalar figures (and whatever other sections read from it)
    section: Section | None = None
    #: "before" the page's answers (a per-drafter run's answer, ablations, peers) or "after" them (the headline
    #: tables below the answers)
    place: str = "after"
    #: whether ``specframe report --summary`` prints the section too
    in_summary: bool = False


#: in the order their sections appear on the page; a section several kinds share runs once, at its first row
KINDS = (
    Kind("bench.job", "benchmarks/test_jobs.py: one per-drafter job's state (done, waiting, checkpoint)",
         jobs_section, place="before", in_summary=True),
    Kind("bench.acceptance.whole-set", "benchmarks/test_jobs.py: whole-set acceptance in vLLM per evaluation set",
         jobs_section, place="before", in_summary=True),
    Kind("bench.acceptance.subset", "benchmarks/test_jobs.py: acceptance on the reference engine on a subset of "
         "each set, for a drafter vLLM serves at no K", jobs_section, place="before", in_summary=True),
    Kind("bench.ablation", "benchmarks/test_ablations.py: one lever against the baseline", ablations_section,
         place="before", in_summary=True),
    Kind("bench.peer", "benchmarks/test_peer.py: speculators' trainer beside specframe's", peer_section,
         place="before"),
    Kind("bench.acceptance", "`specframe bench acceptance`, benchmarks/test_acceptance.py and test_jobs.py: AL and "
         "speed against plain decoding", acceptance_section),
    Kind("bench.training", "benchmarks/test_training.py and test_jobs.py: training under one budget",
         training_section),
    Kind("bench.memory", "benchmarks/test_memory.py: the longest context under the memory budget", memory_section),
    Kind("bench.vllm", "benchmarks/test_vllm.py: vLLM beside the reference engine", vllm_section),
    Kind("bench.speed", "benchmarks/test_jobs.py: speed in vLLM at batch 1 and concurrent requests (read by the "
         "per-drafter answer and the answers)"),
    Kind("bench.regenerate", "benchmarks/regenerate_speed.py: regeneration speed"),
    Kind("bench.feature_engines", "benchmarks/feature_engines.py: feature extraction engines"),
    Kind("memory_context", "benchmarks/memory_context.py: peak memory against context"),
)


def sections(place: str, *, summary: bool = False) -> list[Section]:
    """The sections at ``place`` ("before" or "after" the answers), in page order, each once (``summary``: only those
    ``specframe report --summary`` prints)."""
    found: list[Section] = []
    for kind in KINDS:
        if kind.section is not None and kind.place == place and (kind.in_summary or not summary) \
                and kind.section not in found:
            found.append(kind.section)
    return found
