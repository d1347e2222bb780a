"""The comparison harness's child runs (benchmarks/harness.py): what it records about each `specframe` process,
including how busy the rest of the machine was while a timed run went on."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import claims  # noqa: E402
from harness import beside_cores, busy_cpu_seconds, kept_document, run_cli  # noqa: E402


def test_load_beside_a_child_is_the_machines_busy_time_less_the_childs_own():
    # 10 busy CPU-seconds on the machine over 4 s of wall time, 6 of them the child's: others kept 1 core busy
    assert beside_cores(100.0, 110.0, 6.0, 4.0) == pytest.approx(1.0)
    # the child alone: nothing beside it (clock granularity may make the difference slightly negative)
    assert beside_cores(100.0, 105.0, 5.01, 2.5) == 0.0
    assert beside_cores(None, 110.0, 6.0, 4.0) is None and beside_cores(100.0, 110.0, 6.0, 0.0) is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="the machine's CPU time comes from Linux /proc/stat")
def test_the_machines_busy_time_counts_other_processes_work():
    spin = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"
    before = busy_cpu_seconds()
    subprocess.run([sys.executable, "-c", spin], check=True)
    after = busy_cpu_seconds()
    assert after - before >= 0.5  # the spinning child's CPU time shows in the machine's


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="the machine's CPU time comes from Linux /proc/stat")
def test_a_child_run_reports_exit_memory_time_and_the_load_beside_it(tmp_path):
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a core kept busy beside the child
    try:
        time.sleep(0.3)
        child = run_cli(["plugins"], threads=1, log=tmp_path / "plugins.log")
    finally:
        neighbour.kill()
        neighbour.wait()
    assert child.exit == 0 and child.peak_rss_bytes > 2**20 and child.seconds > 0
    log = (tmp_path / "plugins.log").read_text()
    assert log.startswith("$ ") and "peagle" in log
    # at least half a core on one core (the two share it), about one on two or more
    assert child.beside_cores > 0.3
    failed = run_cli(["train", "--drafter", "no-such-drafter"], threads=1, log=tmp_path / "bad.log")
    assert failed.exit != 0


def test_a_work_folder_is_used_only_under_the_key_it_was_started_with(tmp_path):
    run, marker = tmp_path / "peagle", tmp_path / "peagle.key"
    run.mkdir()
    (run / "latest").write_text("of unknown origin")
    assert claims.claim(run, marker, "k1") is None and not run.exists()  # no marker: never kept
    run.mkdir()
    (run / "latest").write_text("k1's")
    assert claims.claim(run, marker, "k1") is None and (run / "latest").read_text() == "k1's"
    assert claims.claim(run, marker, "k2") is None and not run.exists()  # another key: removed
    assert marker.read_text().strip() == "k2"
    run.mkdir()
    (run / "latest").write_text("k2's")
    # set aside, not removed: named by the key it was started under, and an older one of that name replaced
    (tmp_path / "peagle.stale-k2").mkdir()
    stale = claims.claim(run, marker, "k3", set_aside=True)
    assert stale == tmp_path / "peagle.stale-k2" and (stale / "latest").read_text() == "k2's"
    assert not run.exists() and marker.read_text().strip() == "k3"
    marker.unlink()
    run.mkdir()
    assert claims.claim(run, marker, "k3", set_aside=True).name == "peagle.stale-unknown"


@pytest.mark.slow
def test_a_run_folder_left_by_other_settings_is_set_aside_not_resumed(tmp_path):
    """`train --resume` continues any checkpoint of the drafter, so a run started under more or fewer steps (another
    learning-rate schedule) must not be continued as if it were this preset's run."""
    import attrs

    from harness import Workspace
    from presets import PRESETS

    p = attrs.evolve(PRESETS["ci"], steps=2, eval_every=0)
    first = Workspace(p, tmp_path / "work", tmp_path / "results").trained("peagle")
    assert not first["attempts"][0]["resumed"] and first["steps"] == 2
    longer = attrs.evolve(p, steps=3)
    # the finished record holds another key, and without the harness's check its checkpoint would be resumed
    second = Workspace(longer, tmp_path / "work", tmp_path / "results").trained("peagle")
    assert not second["attempts"][0]["resumed"] and second["steps"] == 3
    stale = list((tmp_path / "work" / "train").glob("peagle.stale-*"))
    assert len(stale) == 1 and (stale[0] / "latest").exists()
    # the same settings again: the finished run is reused as it is
    again = Workspace(longer, tmp_path / "work", tmp_path / "results").trained("peagle")
    assert again == second


def test_a_kept_document_is_read_from_the_committed_copy_when_the_work_folder_lost_it(tmp_path):
    import gzip
    import json

    work, kept = tmp_path / "work" / "contexts-x.json", tmp_path / "results" / "baselines" / "contexts-x.json.gz"
    work.parent.mkdir()
    calls = []

    def compute():
        calls.append(1)
        return {"contexts": {"q#0": [1, 2, 3]}}

    first = kept_document(work, kept, compute)
    assert calls == [1] and json.loads(work.read_text()) == first == json.loads(gzip.decompress(kept.read_bytes()))
    copy = kept.read_bytes()
    work.unlink()  # a fresh machine: the work folder is gone, the committed copy is not
    assert kept_document(work, kept, compute) == first and calls == [1] and work.exists()
    kept.unlink()  # the other way round: the work folder's copy rewrites the committed one, byte for byte
    assert kept_document(work, kept, compute) == first and calls == [1] and kept.read_bytes() == copy
