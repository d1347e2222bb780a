"""Training suite: every drafter on the same feature cache, supervised tokens, seed and memory budget.

    .venv/bin/pytest benchmarks/test_training.py --preset cpu --benchmark-only -p no:cacheprovider

Each drafter trains through `specframe train --cache ... --memory-budget ...` in its own process (its peak RSS is
its own, read with ``os.wait4``); a finished run is reused, a killed one resumes. The table: validation loss, top-1
accuracy per depth, the expected acceptance length those imply (1 + sum_k prod_{i<=k} acc_i), peak memory and
training tokens per second (step time only). Validation losses are not comparable across objectives (eagle3, peagle
and parallelspec: KL to the target over their draft vocabulary; pard: cross-entropy on the data tokens); accuracy
and expected AL are.
"""

from __future__ import annotations

import pytest

from harness import command, target_provenance
from presets import resolve


def pytest_generate_tests(metafunc):
    if "drafter" in metafunc.fixturenames:
        metafunc.parametrize("drafter", list(resolve(metafunc.config.getoption("--preset")).drafters))


def test_train(benchmark, workspace, drafter):
    box = {}
    benchmark.pedantic(lambda: box.update(record=workspace.trained(drafter)), rounds=1, iterations=1)
    record = box["record"]
    benchmark.extra_info.update({k: v for k, v in record.items() if k not in ("attempts",)})
    if "refused" in record:
        pytest.skip(f"{drafter} does not fit {workspace.preset.memory_budget}: {record['refused']}")
    assert record["steps"] == workspace.preset.steps
    assert record["first_train_loss"] > record["last_train_loss"], "training did not lower the loss"


def row(record: dict) -> dict:
    if "refused" in record:
        return {"refused": record["refused"]}
    out = {key: record[key] for key in ("val_loss", "val_expected_al", "tokens_per_second", "train_tokens",
                                        "supervised_elements", "peak_rss_bytes", "first_train_loss", "last_train_loss")}
    for key in ("val_expected_al_method", "val_product_al", "val_vocab_masked", "learning_curve", "beside_cores"):
        if record.get(key) is not None:
            out[key] = record[key]
    for depth, acc in enumerate(record["val_accuracy"] or [], start=1):
        out[f"acc@{depth}"] = acc
    out["layers"] = record["options"].get("layers", _default_layers(record["drafter"]))
    return out


def _default_layers(drafter: str) -> int | None:
    """The layer count a drafter trains with when the preset leaves it to the drafter (an installed plugin's own
    default, e.g. DFlash's 5)."""
    import attrs

    from specframe import plugins

    field = attrs.fields_dict(plugins.get("drafter", drafter).Options).get("layers")
    return None if field is None else field.default


def table(rows: dict[str, dict], depth: int) -> str:
    head = ["drafter", "layers", "val loss", *[f"acc@{d}" for d in range(1, depth + 1)], "exp. AL", "peak RSS MiB",
            "train tok/s", "train tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows.items():
        if "refused" in r:
            lines.append(f"| {name} | does not fit: {r['refused']} |")
            continue
        cells = [name, str(r["layers"]), f"{r['val_loss']:.4f}",
                 *[f"{r.get(f'acc@{d}', float('nan')):.3f}" for d in range(1, depth + 1)],
                 f"{r['val_expected_al']:.3f}", f"{r['peak_rss_bytes'] / 2**20:.0f}", f"{r['tokens_per_second']:.1f}",
                 str(r["train_tokens"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_training_table(benchmark, workspace, trained):
    import attrs

    from specframe.results import provenance, write_results

    p = workspace.preset
    rows = {name: row(record) for name, record in trained.items()}
    box = {}

    def write():
        budget = {n: r.get("train_tokens") for n, r in rows.items()}
        box["path"] = write_results(
            workspace.results / "training.json", kind="bench.training",
            metrics={"methods": rows, "memory_budget": p.memory_budget},
            per_prompt=[], config={"preset": attrs.asdict(p), "commands": {n: r["command"] for n, r in trained.items()}},
            provenance=provenance(target=target_provenance(workspace.target()), token_budget=budget,
                                  command=command()),
        )

    benchmark.pedantic(write, rounds=1, iterations=1)
    text = table(rows, p.depth)
    print(f"\npreset {p.name}: {p.steps} steps x {p.batch_size} sequences of <= {p.seq_len} tokens, depth {p.depth}, "
          f"memory budget {p.memory_budget}\n{text}")
    benchmark.extra_info.update({"results": str(box["path"]), "table": text})
    fitted = [r for r in rows.values() if "refused" not in r]
    assert fitted, "no drafter fits the preset's memory budget"
    assert len({r["train_tokens"] for r in fitted}) == 1, "drafters saw different training tokens"
