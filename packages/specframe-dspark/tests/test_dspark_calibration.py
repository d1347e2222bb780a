"""DSpark's confidence calibration (packages/specframe-dspark): fitted by the engine on held-out chains against the
rule that will verify, kept by the checkpoint, read when drafting and carried by the export."""

from __future__ import annotations

import importlib.metadata
import json
import math

import pytest
import torch

from specframe import api, plugins

try:
    DIST = importlib.metadata.distribution("specframe-dspark")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - depends on the environment
    pytest.skip("the specframe-dspark distribution is not installed (pip install --no-deps -e "
                "packages/specframe-dspark)", allow_module_level=True)

from tests.block_fixtures import grid, run, target  # noqa: E402, F401 (target: the module fixture)
from tests.dspark_fixtures import SMALL, block_forward, make, markov_biases  # noqa: E402


def _train_dspark(tmp_path, **options):
    from specframe.engine import TrainConfig, train
    from tests.train_fixtures import build

    target_dir, chat = build(tmp_path / "assets")
    out = tmp_path / "run"
    train(TrainConfig(drafter="dspark", target=str(target_dir), data=str(chat), output=str(out), seq_len=48,
                      max_steps=3, batch_size=2, val_examples=3, eval_every=2, lr=3e-3, mask_builder="dense",
                      drafter_options={**SMALL, **options}), progress=False)
    return target_dir, out, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_engine_calibrates_on_the_held_out_chains_and_the_checkpoint_keeps_it(tmp_path, monkeypatch):
    """API 8 end to end: every validation reports the prefix ECE, the final one's held-out chains (raw logits and
    verdicts, [anchors, block_size]) reach ``calibrate``, and the final checkpoint carries what it fitted, which a
    reloaded drafter drafts with."""
    from specframe.drafting import calibration
    from specframe.drafter_folders import load_drafter
    from specframe.targets import load_target

    import specframe_dspark.sts

    calls = []
    fitted = torch.tensor([0.5, 1.5, 2.0, 3.0], dtype=torch.float64)

    def fake_fit(logits, accepted):
        calls.append((logits.clone(), accepted.clone()))
        return fitted

    monkeypatch.setattr(specframe_dspark.sts, "fit_temperatures", fake_fit)
    monkeypatch.setattr(calibration, "fit_temperatures", lambda *a: pytest.fail("the cross-entropy fit was used"))
    target_dir, out, metrics = _train_dspark(tmp_path, calibration_rule="sampling")
    evals = [m for m in metrics if "val_loss" in m]
    assert len(evals) == 2 and all(0.0 <= m["val_confidence_ece"] <= 1.0 for m in evals)
    record = [m for m in metrics if m.get("calibrated")]
    assert len(record) == 1 and record[0]["step"] == 3 and record[0]["calibration_in_sample"] is False
    n = record[0]["calibration_anchors"]
    assert n > 0 and n == evals[-1]["val_confidence_anchors"]
    # first on the even validation sequences (the odd ones measured out of sample), then on every chain
    assert len(calls) == 2 and calls[1][0].shape == calls[1][1].shape == (n, SMALL["block_size"])
    assert 0 < calls[0][0].shape[0] < n and record[0]["calibration_checked_anchors"] == n - calls[0][0].shape[0]
    assert torch.isfinite(calls[1][0]).all()
    # API 12: what reaches the fit is the drafter's acceptance under its rule (sampling: 1 - TV, a probability),
    # not the engine's 0 / 1 top-1 hits
    accepted = calls[1][1]
    assert accepted.dtype == torch.float64 and ((accepted > 0) & (accepted < 1)).any()
    assert 0.0 <= record[0]["confidence_ece_after"] <= 1.0
    info = json.loads((out / (out / "latest").read_text().strip() / "drafter.json").read_text())
    assert info["confidence_temperature"] == fitted.tolist() and info["confidence_calibration_rule"] == "sampling"
    reloaded = load_drafter(out, load_target(target_dir).config)
    assert reloaded.confidence_temperature.tolist() == fitted.tolist()
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5]])
    assert reloaded.calibrated_confidence(logits).tolist() == torch.sigmoid(logits.double() / fitted).tolist()


@pytest.mark.slow  # trains a drafter; per-method verifiers are fast-tested in tests/unit/test_bench.py
def test_bench_measures_the_block_whole_and_scheduled_side_by_side(tmp_path):
    """`bench acceptance --verifier greedy --also-verifier scheduled`: the same DSpark checkpoint decoded under both
    verifiers in one interleaved run, both lossless, the scheduled one labelled and reported as such."""
    from click.testing import CliRunner

    from specframe.cli import main

    _, out, _ = _train_dspark(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "add the fox"}]}) + "\n")
    res = CliRunner().invoke(main, ["bench", "acceptance", "--checkpoint", str(out), "--dataset", str(prompts),
                                    "--max-new-tokens", "12", "--also-verifier", "scheduled", "--json",
                                    "-o", str(tmp_path / "r.json")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    whole = [label for label in summary["methods"] if label.startswith("dspark/") and "+" not in label]
    assert len(whole) == 1 and f"{whole[0]}+scheduled" in summary["methods"]
    scheduled_ = summary["methods"][f"{whole[0]}+scheduled"]
    assert scheduled_["verifier"] == "scheduled" and scheduled_["lossless"] and summary["methods"][whole[0]]["lossless"]
    # API 10: the schedule weighed the round costs measured on this target, and the results file records them
    curve = json.loads((tmp_path / "r.json").read_text())["config"]["also_verifier_options"]["scheduled"]["cost_curve"]
    assert len(curve) == 9 and all(isinstance(t, float) and t > 0 for t in curve)


@pytest.mark.parametrize("rule", ["greedy", "sampling"])
def test_the_confidence_is_calibrated_against_the_rule_that_will_verify(target, rule):
    """The acceptance the calibration is fitted on (``LossTerms.acceptance``) is the verifying rule's: greedy, the
    draft token equals the target's argmax; sampling, 1 - TV(q, p). Random data tokens are not the target's
    argmax: a drafter fitted to them by cross-entropy alone hits them, and is not what either rule accepts."""
    drafter, ex = make(target, length=14, calibration_rule=rule, ce_weight=1.0, l1_weight=0.0)
    elems, sup = grid(drafter, ex)
    opt = torch.optim.Adam([p for p in drafter.module().parameters() if p.requires_grad], lr=1e-2)
    for _ in range(30):
        opt.zero_grad()
        run(drafter, ex, elems, sup)
        opt.step()
    seg = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
    with torch.no_grad():
        terms = drafter.loss(ex, elems, seg, api.SegmentAttention.build(plugins.get("mask builder", "dense")(), elems))
        head = target.model.get_output_embeddings().weight.double()
        charged = sup[elems.position]
        want = []
        for a, d in zip(elems.anchor[charged].tolist(), elems.depth[charged].tolist()):
            hidden = block_forward(drafter, ex, a)
            prev = ex.input_ids[[min(a + 1 + s, ex.input_ids.shape[0] - 1) for s in range(drafter.depth)]]
            q = torch.softmax(drafter.model.lm_head(hidden[d]) + markov_biases(drafter, hidden, prev)[d], -1)
            p = torch.softmax(ex.features["final_hidden"][a + 1 + d] @ head.T, -1)
            want.append(float(q.argmax() == p.argmax()) if rule == "greedy" else float(1 - 0.5 * (q - p).abs().sum()))
    assert terms.acceptance.dtype == torch.float64
    assert torch.allclose(terms.acceptance, torch.tensor(want, dtype=torch.float64), atol=1e-9)
    assert not torch.equal(terms.acceptance, terms.hit.double())
    with pytest.raises(api.UsageError, match="'calibration_rule' must be one of greedy, sampling"):
        plugins.get("drafter", "dspark").Options(calibration_rule="top1")


def test_the_calibration_minimises_the_ece_of_the_product_not_the_cross_entropy():
    """The paper's fit (section 3.2.1): per position, the grid temperature of least ECE of the cumulative product.
    Two groups of anchors no single temperature fits: the ECE and cross-entropy optima differ."""
    from specframe.drafting import calibration
    from specframe_dspark import sts

    z = torch.cat([torch.full((100,), 4.0), torch.full((100,), -1.0)])
    y = torch.cat([torch.arange(100) < 90, torch.arange(100) < 80]).double()

    def ece(t):  # 10 equal-width bins, as the engine reports it, written out
        p = torch.sigmoid(z / t)
        b = (p * 10).long().clamp(0, 9)
        return float(sum((p[b == i].sum() - y[b == i].sum()).abs() for i in range(10)) / len(z))

    fitted = float(sts.fit_temperatures(z[:, None], y[:, None])[0])
    best = min(ece(float(t)) for t in torch.logspace(math.log10(0.05), math.log10(20), 2000))
    assert ece(fitted) <= best + 2e-3
    assert ece(float(calibration.fit_temperatures(z[:, None], y[:, None])[0])) > ece(fitted) + 0.01
    # positions where every anchor's prefix went one way have nothing to fit, and the fit is deterministic
    assert sts.fit_temperatures(torch.stack([z, z], 1), torch.zeros(200, 2)).tolist() == [1.0, 1.0]
    assert torch.equal(sts.fit_temperatures(torch.stack([z, z], 1), torch.stack([y, y], 1)),
                       sts.fit_temperatures(torch.stack([z, z], 1), torch.stack([y, y], 1)))


def test_without_calibration_the_head_is_kept_as_trained(tmp_path):
    _, out, metrics = _train_dspark(tmp_path, calibrate_confidence=False)
    assert not any(m.get("calibrated") for m in metrics)
    assert any("val_confidence_ece" in m for m in metrics)  # still measured
    info = json.loads((out / (out / "latest").read_text().strip() / "drafter.json").read_text())
    assert info["confidence_temperature"] == [1.0] * SMALL["block_size"]


def test_drafting_reads_the_calibrated_confidence(target):
    drafter, ex = make(target)
    drafter.module().eval()
    drafter.start(ex.input_ids[:8], {k: v[:8] for k, v in ex.features.items()})
    raw = drafter.propose(4).confidence.double()
    drafter.confidence_temperature = torch.tensor([0.5, 2.0, 1.0, 4.0], dtype=torch.float64)
    drafter.start(ex.input_ids[:8], {k: v[:8] for k, v in ex.features.items()})
    scaled = drafter.propose(4).confidence.double()
    logit = torch.log(raw / (1 - raw))
    assert scaled.tolist() == pytest.approx(torch.sigmoid(logit / drafter.confidence_temperature).tolist(), rel=1e-5)


def test_a_checkpoint_with_bad_temperatures_is_refused(target):
    drafter, _ = make(target)
    info = {**drafter.describe(), "confidence_temperature": [1.0, -2.0, 1.0, 1.0]}
    with pytest.raises(api.SpecframeError, match="confidence_temperature"):
        drafter.restore_checkpoint(info)
    older = {k: v for k, v in drafter.describe().items() if k != "confidence_temperature"}
    drafter.restore_checkpoint(older)  # written before calibration existed: T = 1
    assert drafter.confidence_temperature.tolist() == [1.0] * SMALL["block_size"]


