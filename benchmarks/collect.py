"""Copy a long benchmark's finished results files from the clone that ran it into this checkout.

A long preset (``cpu-large``) runs from a clone of a fixed commit outside the checkout
(``$SPECFRAME_HOME/worktrees/<commit>``), so edits here never change a running job. Its results files appear in the
clone's ``benchmarks/results/<preset>/<drafter or baselines>/`` as each part finishes; this writes each one that is
new or changed into the same place here, with the clone's and the work folder's absolute paths made portable
(``specframe.results.portable``), and prints what it wrote, so each part can be committed as it finishes:

    .venv/bin/python benchmarks/collect.py ~/.cache/specframe/worktrees/<commit> --preset cpu-large

A file that still holds an absolute path after that is refused (committed results name no machine's folders).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specframe.home import specframe_home
from specframe.results import absolute_paths, portable

HERE = Path(__file__).resolve().parent


def collect(clone: Path, preset: str, checkout: Path = HERE.parent) -> list[Path]:
    source = clone / "benchmarks" / "results" / preset
    if not source.is_dir():
        raise SystemExit(f"error: {source} does not exist (is {clone} the clone that runs the {preset} preset?)")
    files: list[tuple[Path, bytes]] = []
    # one level down only: pytest-benchmark's own JSON at the top holds timings of the whole session, not results
    for path in sorted(source.glob("*/*.json")):
        document = portable(json.loads(path.read_text()), clone, home=specframe_home())
        left = absolute_paths(document)
        if left:
            raise SystemExit(f"error: {path} still holds absolute paths after rewriting: {left[:3]}")
        files.append((path, (json.dumps(document, indent=2) + "\n").encode()))
    # the gzip copies a run keeps beside its results (plain vLLM's answers to each set, harness.kept_document) hold
    # token ids only: copied as they are
    files += [(path, path.read_bytes()) for path in sorted(source.glob("*/*.json.gz"))]
    written = []
    for path, data in files:
        target = checkout / path.relative_to(clone)
        if target.exists() and target.read_bytes() == data:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(target)
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("clone", type=Path, help="the clone the long preset runs from")
    parser.add_argument("--preset", default="cpu-large")
    args = parser.parse_args(argv)
    for path in collect(args.clone.resolve(), args.preset):
        print(path.relative_to(HERE.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
