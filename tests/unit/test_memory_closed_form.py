"""The memory estimate's closed-form element counts (``memory.counts.closed_segments``) against the sampled ones
(``memory.counts.sampled_segments``: the real COD sampler and partitioner on an all-supervised sequence, the estimate's only path
before issue 56, kept as the oracle and as the path up to ``SAMPLED_MAX_LEN`` tokens), and the estimate at 10^8 tokens
under a memory cap.

Every registered drafter is checked, whatever plugins are installed: a full-grid drafter's counts are deterministic
and must be equal; a COD drafter's depend on the draw (seeded, but the closed form cannot replay it), so its counts
must be equal where the draw has no choice and within the draw's own spread elsewhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from transformers import LlamaConfig

from specframe import memory as mem
from specframe import plugins
from specframe.drafting.elements import full_grid as FULL_GRID
from specframe.errors import SpecframeError, UsageError
from specframe.memory import counts as cnt
from specframe.memory.estimate import _drafter

ROOT = Path(__file__).resolve().parents[2]
TINY = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=False)
LENGTHS = (64, 65, 512, 2048, 4096)
PARTITIONS = (("none", 1), ("peagle", 2), ("peagle", 8))


def _options(name: str, depth: int) -> dict:
    """The options the presets give a drafter to train at ``depth`` (``Drafter.comparison_options``), with its
    layers kept few where it has the option (the counts do not depend on them)."""
    cls = plugins.get("drafter", name)
    opts = dict(cls.comparison_options(depth, 256, min(3, depth)))
    if "layers" in attrs.fields_dict(cls.Options):
        opts["layers"] = 1
    return opts


def _config(name: str, length: int, partitioner: str = "none", partitions: int = 1, depth: int = 4,
            builder: str = "chunked") -> mem.MemoryConfig:
    return mem.MemoryConfig(drafter=name, target_config=TINY, seq_len=length, depth=depth, mask_builder=builder,
                            partitioner=partitioner, partitions=partitions, drafter_options=_options(name, depth),
                            features="synthetic")


def _both(cfg: mem.MemoryConfig):
    """(sampled, closed form, training) for ``cfg``; None where the drafter cannot be counted in closed form."""
    drafter, options = _drafter(cfg)
    training = type(drafter).training(options)
    shape = cnt.supervision_shape(drafter)
    if shape is None:
        return None
    sampled = cnt.sampled_segments(cfg, drafter, cfg.depth, training)
    return sampled, cnt.closed_segments(cfg, drafter, cfg.depth, training, shape), training


def _drafters() -> list[str]:
    return list(plugins.load().names("drafter"))


def _trainable(name: str) -> bool:
    drafter, _ = _drafter(_config(name, 64))
    try:
        cnt.supervision_shape(drafter)
    except SpecframeError:  # a drafter that cannot train (ngram) has no elements to count
        return False
    return True


@pytest.mark.parametrize("name", _drafters())
def test_closed_form_counts_equal_the_sampled_ones(name):
    if not _trainable(name):
        with pytest.raises(SpecframeError):
            mem.estimate(_config(name, 10**6))
        return
    for length in LENGTHS:
        for partitioner, parts in PARTITIONS:
            for depth in (4, 8) if length == 2048 else (4,):
                both = _both(_config(name, length, partitioner, parts, depth))
                if both is None:
                    pytest.skip(f"drafter '{name}' supervises otherwise than the closed form describes "
                                "(test_an_undescribed_drafter_is_refused_past_the_run_bound covers it)")
                (sampled, n_sampled), (closed, n_closed), training = both
                where = f"{name} L={length} K={depth} {partitioner} S={parts}"
                assert len(closed) == len(sampled), where
                if training.cod_ratio >= 1.0:  # the full grid: nothing random, so every count is equal
                    assert (closed, n_closed) == (sampled, n_sampled), where
                    continue
                # COD: a floor depth's candidate can drop out at the sequence's end (one element a depth at most)
                assert n_sampled <= n_closed <= n_sampled + depth, where
                if partitioner == "none":
                    (fs, cs, as_), (fc, cc, ac) = sampled[0], closed[0]
                    assert (fc - fs, cc - cs, ac) == (n_closed - n_sampled, n_closed - n_sampled, as_), where
                    continue
                # where the cuts fall depends on which anchors the draw kept: the closed form counts each depth's
                # expected share, within a few per cent of any one draw (about 1 / sqrt(elements) at these sizes)
                for (fs, cs, _), (fc, cc, _) in zip(sampled, closed, strict=True):
                    slack = max(8 * depth, 0.03 * fs)
                    assert abs(fc - fs) <= slack and abs(cc - cs) <= max(8 * depth, 0.03 * cs), (where, sampled,
                                                                                                    closed)


@pytest.mark.parametrize("builder", sorted(plugins.load().names("mask builder")))
@pytest.mark.parametrize("name", ["eagle3", "parallelspec", "dflash", "dspark"])
def test_a_full_grid_estimate_is_byte_identical_in_closed_form(name, builder, monkeypatch):
    """Through every mask builder: the whole estimate (``to_dict``: every figure ``specframe memory`` prints) is the
    same whether the sequence is sampled or counted in closed form."""
    if name not in _drafters():
        pytest.skip(f"drafter '{name}' is not installed")
    for partitioner, parts in PARTITIONS:
        cfg = _config(name, 2048, partitioner, parts)
        sampled = mem.estimate(cfg).to_dict()
        monkeypatch.setattr(cnt, "SAMPLED_MAX_LEN", 0)
        assert mem.estimate(cfg).to_dict() == sampled, (name, builder, partitioner, parts)
        monkeypatch.undo()


def test_a_cod_estimate_is_within_the_draws_spread_in_closed_form(monkeypatch):
    for partitioner, parts in PARTITIONS:
        cfg = _config("peagle", 4096, partitioner, parts, depth=8)
        sampled = mem.estimate(cfg)
        monkeypatch.setattr(cnt, "SAMPLED_MAX_LEN", 0)
        closed = mem.estimate(cfg)
        monkeypatch.undo()
        assert abs(closed.peak_bytes - sampled.peak_bytes) <= 0.01 * sampled.peak_bytes, (sampled, closed)
        assert closed.fixed_bytes == sampled.fixed_bytes and closed.segments == sampled.segments


def test_the_supervision_shapes_the_closed_form_reads():
    shapes = {name: cnt.supervision_shape(_drafter(_config(name, 64))[0]) for name in ("peagle", "pard")}
    assert shapes == {"peagle": (1, 1), "pard": (0, 1)}  # EAGLE's shift and last position; PARD's last position

    class Odd:  # supervises only every other position: not "all but the last few"
        def supervision(self, example):
            sup = example.loss_mask.clone()
            sup[::2] = False
            return sup

    assert cnt.supervision_shape(Odd()) is None


WHOLE = """
    import torch
    from specframe import api

    class Whole(api.Partitioner):  # a third party's: what it does is known only by running it
        name = "whole"

        def partition(self, elements, num_segments):
            n = len(elements)
            return [api.Segment(torch.arange(n), torch.ones(n, dtype=torch.bool))]

    @api.hookimpl
    def register_partitioners(register):
        register(Whole)
"""


def test_a_third_party_partitioner_is_run_up_to_the_bound_and_refused_past_it_in_one_line(site):
    site.add("specframe-whole", "whole", WHOLE)
    ran = mem.estimate(_config("peagle", mem.SAMPLED_MAX_LEN + 64, "whole"))  # run on the sequence, as before
    assert ran.segments == 1 and ran.largest_segment["forwarded"] == ran.elements
    with pytest.raises(UsageError) as err:
        mem.estimate(_config("peagle", mem.RUN_MAX_LEN + 1, "whole"))
    message = str(err.value)
    assert message == (f"cannot estimate --seq-len {mem.RUN_MAX_LEN + 1}: partitioner 'whole' declares no rule it "
                       "counts its segments by without running it (Partitioner.counted_as), so its segments are "
                       "counted by running it on the sequence, which the estimate does up to "
                       f"{mem.RUN_MAX_LEN} tokens; use --seq-len {mem.RUN_MAX_LEN} or less")
    assert "\n" not in message


def test_a_partitioner_that_declares_its_rule_is_counted_in_closed_form(site):
    """The closed form follows what a partitioner declares (``counted_as``), never its class path: a third party's
    one-segment partitioner that says so is counted past the run bound, as ``none`` is."""
    site.add("specframe-whole", "whole", WHOLE.replace('name = "whole"', 'name = "whole"\n        counted_as = "whole"'))
    declared = mem.estimate(_config("peagle", mem.RUN_MAX_LEN + 1, "whole"))
    assert declared.to_dict() == mem.estimate(_config("peagle", mem.RUN_MAX_LEN + 1, "none")).to_dict()


def test_a_subclass_that_cuts_otherwise_does_not_inherit_the_rule(site):
    """A rule is read from the class that defines ``partition``: a subclass of P-EAGLE's partitioner with its own cuts
    is run (and refused past the bound), not counted as P-EAGLE's cuts."""
    site.add("specframe-halves", "halves", """
    import torch
    from specframe import api
    from specframe_plugins.partition_peagle import PeaglePartitioner

    class Halves(PeaglePartitioner):
        name = "halves"

        def partition(self, elements, num_segments):
            n = len(elements)
            return [api.Segment(torch.arange(n), torch.ones(n, dtype=torch.bool))]

    @api.hookimpl
    def register_partitioners(register):
        register(Halves)
""")
    with pytest.raises(UsageError, match="partitioner 'halves' declares no rule"):
        mem.estimate(_config("peagle", mem.RUN_MAX_LEN + 1, "halves", 2))


def test_an_unknown_counting_rule_is_refused_at_load_naming_the_plugin(site):
    from specframe import plugins

    site.add("specframe-whole", "whole", WHOLE.replace('name = "whole"', 'name = "whole"\n        counted_as = "cubic"'))
    registry = plugins.load()
    assert "whole" not in registry.names("partitioner")
    assert any("specframe-whole" in e and "counted_as must be one of whole, balanced_ranges" in e
               for e in registry.errors)


def test_an_undescribed_drafter_is_refused_past_the_run_bound(monkeypatch):
    monkeypatch.setattr(cnt, "supervision_shape", lambda drafter: None)
    with pytest.raises(UsageError, match=r"drafter 'pard' supervises an all-loss sequence otherwise than every "
                                         r"position but the last few"):
        mem.estimate(_config("pard", mem.RUN_MAX_LEN + 1))  # not 10^8: a regression would sample it


def test_a_bad_partition_count_fails_as_the_partitioner_says():
    """The closed form runs the partitioner's own checks on a tiny sequence: the same message as the sampled path."""
    with pytest.raises(UsageError) as small:
        mem.estimate(_config("peagle", 512, "peagle", 0))
    with pytest.raises(UsageError) as large:
        mem.estimate(_config("peagle", mem.SAMPLED_MAX_LEN + 1, "peagle", 0))
    assert str(small.value) == str(large.value)


# ---------------------------------------------------------------------------------------------- 10^8 under a cap
CHILD = r"""
import json, resource, sys
import attrs
from transformers import LlamaConfig
from specframe import memory as mem, plugins

tc = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)  # SmolLM2-135M's shape
names = [n for n in plugins.load().names("drafter") if n != "ngram"]
runs = [(n, p, s) for n in names for p, s in (("none", 1), ("peagle", 8))]
for name, part, parts in runs:  # warm: every import, drafter class and cache the answer below uses
    mem.advice(mem.MemoryConfig(drafter=name, target_config=tc, seq_len=64, partitioner=part, partitions=parts),
               2**30)
data, hwm = mem.status_bytes("VmData"), mem.status_bytes("VmHWM")
cap = data + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.getrlimit(resource.RLIMIT_DATA)[1]))
out = []
for name, part, parts in runs:
    cfg = mem.MemoryConfig(drafter=name, target_config=tc, seq_len=10**8, partitioner=part, partitions=parts)
    est = mem.estimate(cfg)
    out.append({"drafter": name, "partitioner": part, "elements": est.elements, "segments": est.segments,
                "forwarded": est.largest_segment["forwarded"], "peak": est.peak_bytes,
                "advice": mem.advice(cfg, 8 * 2**30)})
print(json.dumps({"runs": out, "grew": mem.status_bytes("VmHWM") - hwm}))
"""


def test_no_sequence_longer_than_the_sampled_bound_is_materialised(monkeypatch):
    """The fast half of the check below: at 10^8 tokens no path builds an element set (each would hold ~10^8 rows)."""
    from specframe.drafting import elements

    def refuse(*args, **kwargs):
        raise AssertionError("an element set was built for a sequence past SAMPLED_MAX_LEN")

    def guarded(original):
        def call(cfg, *args):
            if cfg.seq_len > mem.SAMPLED_MAX_LEN:
                refuse()
            return original(cfg, *args)
        return call

    monkeypatch.setattr(cnt, "sampled_segments", guarded(cnt.sampled_segments))
    monkeypatch.setattr(elements, "full_grid", lambda n, *a, **k: refuse() if n > 64 else FULL_GRID(n, *a, **k))
    for name in ("peagle", "pard", "eagle3"):
        for partitioner, parts in PARTITIONS:
            est = mem.estimate(_config(name, 10**8, partitioner, parts))
            assert est.elements > 10**8 and est.segments == parts, (name, partitioner)


@pytest.mark.slow  # a child process that imports torch and warms every drafter: 30 s on a loaded machine
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="the cap is an RLIMIT_DATA read from procfs")
def test_every_drafter_answers_at_a_hundred_million_tokens_under_a_memory_cap():
    """Issue 56: 10^8 tokens was killed by the kernel at 16.7 GB. Under a 512 MiB data limit above the warmed
    interpreter, every trainable drafter (and its advice, which searches shorter lengths) must answer, unsplit and in
    8 P-EAGLE segments, with its peak resident set grown by less than 256 MiB."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(512 * 2**20)], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    assert doc["grew"] < 256 * 2**20, doc["grew"]
    assert doc["runs"] and all(run["elements"] > 10**8 - 10 for run in doc["runs"]), doc["runs"]
    for run in doc["runs"]:
        assert run["segments"] == (1 if run["partitioner"] == "none" else 8), run
        assert run["peak"] > 8 * 2**30 and run["advice"], run  # 10^8 tokens never fit 8 GiB: what would is said


def _capped(limit: int):
    def cap():
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    return cap


@pytest.mark.slow  # two CLI processes importing torch
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="RLIMIT_DATA is Linux's")
def test_the_memory_command_answers_the_issues_lengths_under_three_gib():
    """Issue 56's commands, each in a process whose whole data segment is capped at 3 GiB (the 10^8-token DSpark one
    was killed at 16.7 GB resident): each answers, with what would fit."""
    drafters = [n for n in ("dspark", "peagle") if n in _drafters()]
    for drafter, extra in [(d, ["--seq-len", "100000000", "--memory-budget", "1GiB"]) for d in drafters] + [
            ("peagle", ["--seq-len", "10000000", "--memory-budget", "8GiB", "--partitioner", "peagle",
                        "--partitions", "8"])]:
        done = subprocess.run([sys.executable, "-m", "specframe", "memory", "--drafter", drafter, *extra, "--json"],
                              capture_output=True, text=True, cwd=ROOT, timeout=600, preexec_fn=_capped(3 * 2**30))
        assert done.returncode == 0, done.stderr[-2000:]
        doc = json.loads(done.stdout)
        assert doc["fits"] is False and doc["advice"] and doc["elements"] > int(extra[1]) - 10, (drafter, doc)


@pytest.mark.parametrize("parts", [2, 8])
def test_a_whole_partitioner_is_one_segment_in_closed_form_whatever_the_partitions(parts):
    """``none`` declares ``whole``: asked for several partitions it still forwards one segment, as it does when run
    (fails with the closed form cutting every declared rule as ``balanced_ranges`` does)."""
    (sampled, n_sampled), (closed, n_closed), training = _both(_config("eagle3", 512, "none", parts))
    assert training.cod_ratio >= 1.0 and len(sampled) == 1
    assert (closed, n_closed) == (sampled, n_sampled)
