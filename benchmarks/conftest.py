"""Options and shared fixtures of the comparison suites (``pytest benchmarks --preset cpu``).

``--preset`` (or ``SPECFRAME_BENCH_PRESET``) picks the scale (``benchmarks/presets.py``); ``--bench-work`` the work
folder that keeps the feature cache and the trained drafters between runs (default ``$SPECFRAME_HOME/bench/<preset>``,
outside the checkout, so a long run survives a fresh checkout; the ci presets: ``runs/bench/<preset>``);
``--results-dir`` where results files go (default ``benchmarks/results/<preset>``; ci presets ``<work>/results``, so CI
never overwrites the committed figures).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import ROOT, Workspace, default_work
from presets import ABLATIONS, PRESETS, resolve


def pytest_addoption(parser):
    group = parser.getgroup("specframe", "specframe comparison suites")
    group.addoption("--preset", default=os.environ.get("SPECFRAME_BENCH_PRESET", "ci"), choices=sorted(PRESETS),
                    help="scale of the suites (default ci, or $SPECFRAME_BENCH_PRESET)")
    group.addoption("--bench-work", default=None, help="work folder (default $SPECFRAME_HOME/bench/<preset>; ci presets: "
                    "runs/bench/<preset>)")
    group.addoption("--results-dir", default=None, help="results folder (default benchmarks/results/<preset>; ci: "
                    "<work>/results)")


@pytest.fixture(scope="session")
def workspace(request) -> Workspace:
    import torch

    preset = resolve(request.config.getoption("--preset"))
    torch.set_num_threads(preset.threads)
    work = Path(request.config.getoption("--bench-work") or default_work(preset))
    results = request.config.getoption("--results-dir")
    if results is None:
        results = ROOT / "benchmarks" / "results" / preset.name if preset.committed else work / "results"
    return Workspace(preset, work.resolve(), Path(results).resolve())


@pytest.fixture(scope="session")
def trained(workspace):
    """Every drafter of the preset trained (or reused) under the same budget: name -> record (``harness.trained``)."""
    return {name: workspace.trained(name) for name in workspace.preset.drafters}


def pytest_benchmark_update_json(config, benchmarks, output_json):
    """pytest-benchmark's own JSON names files relative to the repository, as results files do (portable)."""
    from specframe.results import portable

    output_json.update(portable(dict(output_json), ROOT))


# What the per-drafter jobs (test_jobs.py) do in one job per drafter, these suites do table by table; a preset runs
# one way or the other, the memory suite (independent of training) either way.
SUITE_BY_SUITE = ("test_training.py", "test_acceptance.py", "test_vllm.py")


def pytest_collection_modifyitems(config, items):
    preset = PRESETS[config.getoption("--preset")]
    kept, dropped = [], []
    for item in items:
        name = Path(str(item.fspath)).name
        per_drafter = name == "test_jobs.py"
        # an ablation preset runs its own suite alone, and no other preset runs it
        if (name == "test_ablations.py") != (preset.name in ABLATIONS):
            dropped.append(item)
        elif name in SUITE_BY_SUITE + ("test_jobs.py",) and per_drafter != preset.per_drafter_jobs:
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
