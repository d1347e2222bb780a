"""Reading results files for the report: every file under a folder (each checked for provenance), the measured runs
in each (one per method where a file compares several), their labels and scalar figures, and what a run's recorded
metrics say about it (its drafter, whether its "tree" was really a tree)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from specframe.errors import SpecframeError, read_json
from specframe.results import SCHEMA, check_results
from specframe.values import is_number


LABEL_KEYS = ("drafter", "mask_builder", "partitioner", "engine", "verifier", "dataset", "k")


def load_results(directory: Path) -> list[tuple[str, dict[str, Any]]]:
    """Every results file under ``directory`` (sorted by relative path), each checked for provenance."""
    if not directory.is_dir():
        raise SpecframeError(f"results directory {directory} " + ("is a file, not a directory" if directory.exists()
                                                                  else "does not exist"))
    found = []
    for path in sorted(directory.rglob("*.json")):
        document = read_json(path, "a results file", expect=None)
        if not (isinstance(document, dict) and str(document.get("schema", "")).startswith("specframe.results")):
            continue  # e.g. pytest-benchmark's own timing files
        if document["schema"] != SCHEMA:
            raise SpecframeError(f"{path}: results schema {document['schema']!r} is not {SCHEMA!r}")
        check_results(document, source=str(path))
        found.append((str(path.relative_to(directory)), document))
    if not found:
        raise SpecframeError(f"no specframe results files in {directory}")
    return found


def label(name: str, document: dict[str, Any]) -> str:
    """A run's label: its config and metrics keys that name what was measured (``LABEL_KEYS``), else the file name."""
    config = {**document.get("config", {}), **document.get("metrics", {})}
    parts = [f"{key}={config[key]}" for key in LABEL_KEYS if config.get(key) not in (None, "")]
    return ", ".join(parts) or name


def runs(name: str, document: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The measured runs in a results file as (label, metrics): one per method where the file compares several
    side by side (``metrics.methods``, as ``bench acceptance`` writes), else the file itself."""
    return [(run_label, metrics) for _, run_label, metrics in keyed_runs(name, document)]


def keyed_runs(name: str, document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(key, label, metrics) of each run in a results file; the key (method name, or "" for a single-run file)
    pairs runs across directories (``page.render_comparison``)."""
    recorded = document.get("metrics", {})
    config = document.get("config", {})
    methods = recorded.get("methods")
    if isinstance(methods, dict) and methods:
        base = label(name, {"config": config, "metrics": {}})
        return [(method, f"{base}: {method}", metrics) for method, metrics in methods.items() if isinstance(metrics, dict)]
    extra = {key: config[key] for key in ("k", "drafter") if key in config and key not in recorded}
    return [("", label(name, document), {**recorded, **extra})]


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers among a run's metrics (booleans, NaN and infinities left out)."""
    out = {}
    for key, value in metrics.items():
        if not is_number(value):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            continue
        out[key] = value
    return out


def drafter_builds_trees(drafter: str | None, metrics: dict[str, Any] | None = None) -> bool:
    """Whether the drafter named ``drafter`` builds real trees: as a run's ``metrics`` recorded it (newer results),
    else the installed drafter plugin's ``builds_trees`` (False for a drafter that is not installed). By name, for
    results files; ``bench.builds_trees`` asks a drafter instance."""
    if metrics is not None and isinstance(metrics.get("builds_trees"), bool):
        return metrics["builds_trees"]
    if not drafter:
        return False
    try:
        from specframe import plugins

        return bool(getattr(plugins.get("drafter", drafter), "builds_trees", False))
    except Exception:  # noqa: BLE001 - an unknown drafter in old results is not a tree builder
        return False


def is_tree(label: str, metrics: dict[str, Any]) -> bool:
    """Whether a run was measured as a tree (a tree shape recorded, or a ``label/tree`` method label)."""
    return bool(metrics.get("tree")) or label.rsplit("/", 1)[-1] == "tree"


def false_tree(label: str, metrics: dict[str, Any]) -> bool:
    """A "tree" row of a drafter whose propose_tree is its chain (older results measured those)."""
    return is_tree(label, metrics) and not drafter_builds_trees(drafter_name(label, metrics), metrics)


def chain_label(label: str, metrics: dict[str, Any]) -> str:
    """The label a table shows: a chain-only drafter's "tree" row says it was its chain."""
    if not false_tree(label, metrics):
        return label
    depth = (metrics.get("tree") or {}).get("depth")
    return f"{label} (chain{f' k{depth}' if depth else ''}: no tree)"


def drafter_name(label: str, metrics: dict[str, Any]) -> str:
    """The drafter a run measured: recorded in its metrics, else read off its label."""
    return str(metrics.get("drafter") or label.split(":")[-1].strip().split("/")[0])


def drafter_of(label: str) -> str:
    """The drafter of a method label (``peagle/k5`` -> ``peagle``)."""
    return label.split("/")[0]


def token_budgets(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """Training tokens per drafter name, from the provenance of ``documents``."""
    out: dict[str, Any] = {}
    for d in documents:
        budget = d["provenance"].get("token_budget")
        if isinstance(budget, dict):
            out.update({str(k).split("/")[0]: v for k, v in budget.items()})
    return out


def is_finite_number(value: Any) -> bool:
    """A finite int or float (not a bool): what a report computes with (``specframe.values.is_number`` without the
    finiteness, which a results file's NaN would pass)."""
    return is_number(value) and math.isfinite(value)


def all_runs(documents: list[tuple[str, dict[str, Any]]]):
    """(document, run key or label, metrics) of every run in ``documents``."""
    for name, document in documents:
        for key, run_label, metrics in keyed_runs(name, document):
            yield document, key or run_label, metrics


def dataset_of(document: dict[str, Any]) -> str | None:
    """The evaluation set a results file measured."""
    return document.get("config", {}).get("dataset") or document.get("metrics", {}).get("dataset")


def on_reference_engine(document: dict[str, Any]) -> bool:
    """Whether a results file was measured on the reference engine (not vLLM)."""
    engine = document.get("config", {}).get("engine") or document.get("metrics", {}).get("engine") or "reference"
    return document.get("kind") != "bench.vllm" and engine == "reference"
