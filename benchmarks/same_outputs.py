"""Are a refactor's outputs byte-identical? Train every built-in and packaged drafter 2 seeded steps on the tiny
target, export it, and write a sha256 for every file the run and the export wrote (issue 31: "results files and
exports byte-identical on the tiny target before and after"). Run it at two commits over the same folder, then
compare:

    git worktree add --detach /tmp/old <commit>
    (cd /tmp/old && PYTHONPATH=$PWD:<its plugins and packages> python benchmarks/same_outputs.py /tmp/same --out old.json)
    python benchmarks/same_outputs.py /tmp/same --out new.json --against old.json

The tiny target is built once under the folder and kept (its path is recorded in every run's config, so both runs
must share it); the drafters' runs are removed before each run. ``--against`` prints the files that differ and exits
1 if any does; ``train.lock`` (it holds the writer's pid) and ``metrics.jsonl`` (wall times) are not compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OPTIONS = {
    "peagle": {"layers": 2, "draft_vocab_size": 128, "k_train": 3},
    "eagle3": {"draft_vocab_size": 128, "ttt_steps": 3},
    "pard": {"layers": 1, "k_train": 3},
    "parallelspec": {"draft_vocab_size": 128, "k_train": 3},
    "dflash": {"layers": 2, "aux_layer_ids": [1, 3], "block_size": 4},
    "dspark": {"layers": 2, "aux_layer_ids": [1, 3], "block_size": 4, "markov_rank": 8},
}
SKIPPED = ("train.lock", "metrics.jsonl")


def hashes(root: Path) -> dict[str, str]:
    import torch

    from specframe import plugins
    from specframe.drafter_folders import export_checkpoint
    from specframe.engine import TrainConfig, train
    from tests.train_fixtures import build

    torch.set_num_threads(1)
    target, chat = build(root / "assets")
    registered = set(plugins.load().names("drafter"))
    out: dict[str, str] = {}
    for name, options in OPTIONS.items():
        if name not in registered:
            continue
        run, export = root / name, root / f"{name}-export"
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(export, ignore_errors=True)
        train(TrainConfig(drafter=name, target=str(target), data=str(chat), output=str(run), seq_len=48, max_steps=2,
                          batch_size=2, val_examples=2, lr=3e-3, mask_builder="dense", seed=0,
                          drafter_options=options), progress=False)
        export_checkpoint(run, export)
        for path in sorted([*run.rglob("*"), *export.rglob("*")]):
            if path.is_file() and path.name not in SKIPPED and "tensorboard" not in path.parts:
                out[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="work folder (the tiny target is kept here between runs)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the hashes (JSON)")
    parser.add_argument("--against", type=Path, help="hashes of another commit's run to compare with")
    args = parser.parse_args()
    mine = hashes(args.folder)
    args.out.write_text(json.dumps(mine, indent=1, sort_keys=True))
    if args.against is None:
        return 0
    theirs = json.loads(args.against.read_text())
    differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    for key in differ:
        print(f"differs: {key} ({'missing here' if key not in mine else 'missing there' if key not in theirs else 'content'})")
    print(f"{len(mine)} files, {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
