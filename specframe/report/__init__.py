"""``specframe report``: results files -> a markdown page with tables and PNG figures (``render``), its answers for a
terminal (``summary``), or two result folders compared figure by figure (``render_comparison``).

One module per idea:

- ``runs``: reading results files and the runs in them (``load_results``, ``runs``, ``label``, ``scalars``);
- ``questions``: the data each question needs (``acceptance_by_dataset``, ``speedup_by_k``, ``learning_curves``,
  ``tokens_to_beat_plain``, ...), shared by the sentences and the figures;
- ``answers``: the sentences and headline tables (``answers`` and one section per results kind);
- ``figures``: matplotlib only (``figures``, ``colour``);
- ``markdown``: tables and cells;
- ``page``: the page (``render``, ``headline``, ``summary``, ``render_comparison``);
- ``kinds``: every results kind and the section that renders it (``KINDS``): a new benchmark is one row there;
- ``jobs``, ``ablations``, ``peer``: the sections of a per-drafter run, an ablation and the peer trainers.

The names below are the ones callers use, re-exported so ``from specframe import report`` keeps working.
"""

from __future__ import annotations

from specframe.report.answers import BUSY_CORES, GOAL_SPEEDUP, answers
from specframe.report.kinds import KINDS, Kind
from specframe.report.page import headline, render, render_comparison, summary
from specframe.report.questions import (
    SPEED_SET,
    acceptance_by_dataset,
    al_at_equal_time,
    learning_curves,
    learning_rates,
    memory_by_context,
    plausible,
    round_cost_ratio,
    speedup_by_k,
    tokens_to_beat_plain,
)
from specframe.report.runs import LABEL_KEYS, drafter_builds_trees, label, load_results, runs, scalars

# last: the plotting function, not its module, is what ``report.figures`` names (importing the module above bound
# the module to that name)
from specframe.report.figures import COLOURS, MAX_SERIES, colour, figures  # noqa: E402, I001

__all__ = [
    "BUSY_CORES", "COLOURS", "GOAL_SPEEDUP", "KINDS", "LABEL_KEYS", "MAX_SERIES", "SPEED_SET", "Kind",
    "acceptance_by_dataset", "al_at_equal_time", "answers", "colour", "drafter_builds_trees", "figures", "headline",
    "label", "learning_curves", "learning_rates", "load_results", "memory_by_context", "plausible", "render",
    "render_comparison", "round_cost_ratio", "runs", "scalars", "speedup_by_k", "summary", "tokens_to_beat_plain",
]
