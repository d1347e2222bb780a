"""The results file every benchmark and bench command writes (docs/design.md section 8).

One JSON document: the figures (``metrics``, ``per_prompt``) plus the provenance a reader needs to trust and
reproduce them: command line, specframe version and git commit, target id and weights hash, drafter checkpoint hash,
training token budget, machine description (thread pinning included) and date. ``specframe report`` refuses a file
without provenance. Each ``kind`` a benchmark writes is a row of ``specframe.report.kinds.KINDS``, which names what
writes it and the section of the report that renders it.

Results files are portable: ``write_results`` names every path inside the repository that holds the file (or, outside
one, the repository of the working directory) relative to that repository's root, in commands too, so a committed
file says ``runs/bench/cpu/train/peagle``, never the checkout it was measured in.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from specframe import __version__
from specframe.errors import SpecframeError, read_json

SCHEMA = "specframe.results/1"
#: provenance keys a results file must carry (values may be null only where the key says "none applies")
REQUIRED_PROVENANCE = ("command", "specframe_version", "git_commit", "target", "token_budget", "machine", "date")


def git_commit(path: Path | None = None) -> str | None:
    """The commit of the specframe checkout (``+dirty`` when it has uncommitted changes), or None outside git."""
    where = path or Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where, capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


#: environment variables that pin or size the threads a measurement ran on (recorded in ``machine()["threads"]``)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                    "SPECFRAME_THREADS")


def threads() -> dict[str, Any]:
    """How many threads the measurement used and where they were pinned: torch's intra-op threads, the CPUs this
    process may run on, and the thread variables that were set (``--threads`` sets torch's count)."""
    import torch

    try:
        affinity: list[int] | None = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {
        "torch": torch.get_num_threads(),
        "affinity": _ranges(affinity) if affinity is not None else None,
        "environment": {name: os.environ[name] for name in THREAD_VARIABLES if name in os.environ},
    }


def _ranges(cpus: list[int]) -> str:
    """0,1,2,5 -> '0-2,5'."""
    out: list[str] = []
    for cpu in cpus:
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) == cpu - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{cpu}"
        elif out and "-" not in out[-1] and int(out[-1]) == cpu - 1:
            out[-1] = f"{out[-1]}-{cpu}"
        else:
            out.append(str(cpu))
    return ",".join(out)


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU, core count, memory, accelerator, library versions, threads."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "cpu": cpu_details(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "threads": threads(),
        "memory_bytes": _total_memory(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "accelerator": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


#: the CPU flags that decide which kernels the figures ran on (vector and matrix units, their number formats)
KERNEL_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "vnni", "bf16", "vaes", "vpclmul", "gfni")


def cpu_details(cpuinfo: str | None = None) -> dict[str, Any]:
    """What tells two machines of one model name apart (``AMD EPYC`` names every generation in a VM): family, model,
    stepping, clock, cache and the kernel-relevant flags of the first CPU in /proc/cpuinfo (empty elsewhere). The
    same speedup on two machines can differ because the plain step got faster (issue 57): these fields, with the
    plain step's time, let a reader see which machine a figure came from."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first CPU's block only
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    out: dict[str, Any] = {name: fields[key] for name, key in (
        ("vendor", "vendor_id"), ("family", "cpu family"), ("model", "model"), ("stepping", "stepping"),
        ("microcode", "microcode"), ("mhz", "cpu MHz"), ("cache", "cache size")) if key in fields}
    if "flags" in fields:
        out["kernel_flags"] = sorted(f for f in fields["flags"].split() if f.startswith(KERNEL_FLAG_PREFIXES))
    return out


def _total_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def file_hash(path: Path, exclude: frozenset[str] = frozenset()) -> str:
    """sha256 of a file, or of a directory's files (names and contents, sorted), as ``sha256:<hex>``. ``exclude``:
    names (relative to ``path``) of a directory's files left out."""
    digest = hashlib.sha256()
    files = (sorted(p for p in path.rglob("*") if p.is_file() and str(p.relative_to(path)) not in exclude)
             if path.is_dir() else [path])
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return "sha256:" + digest.hexdigest()


def provenance(
    *,
    target: dict[str, Any],
    drafter_checkpoint_hash: str | None = None,
    token_budget: int | None = None,
    command: list[str] | None = None,
) -> dict[str, Any]:
    """The provenance block. ``target`` is at least ``{"id": ..., "weights_hash": ...}``; ``token_budget`` is the
    number of training tokens the drafter saw (None for untrained baselines such as plain or n-gram decoding)."""
    return {
        "command": shlex.join(command if command is not None else sys.argv),
        "specframe_version": __version__,
        "git_commit": git_commit(),
        "target": target,
        "drafter_checkpoint_hash": drafter_checkpoint_hash,
        "token_budget": token_budget,
        "machine": machine(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def write_results(
    path: Path, *, kind: str, metrics: dict[str, Any], per_prompt: list[dict[str, Any]], provenance: dict[str, Any],
    config: dict[str, Any] | None = None,
) -> Path:
    """Write one results file atomically (a reader never sees half a file)."""
    document = {
        "schema": SCHEMA,
        "kind": kind,
        "metrics": metrics,
        "per_prompt": per_prompt,
        "config": config or {},
        "provenance": provenance,
    }
    check_results(document, source=str(path), strict=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = repository_root(path.parent) or repository_root(Path.cwd())
    if root is not None:
        from specframe.home import specframe_home

        document = portable(document, root, home=specframe_home())
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(document, handle, indent=2, sort_keys=False)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def repository_root(where: Path) -> Path | None:
    """The root of the git checkout holding ``where`` (the nearest existing folder), or None outside one."""
    where = Path(where).resolve()
    while not where.exists() and where != where.parent:
        where = where.parent
    for folder in (where, *where.parents):
        if (folder / ".git").exists():
            return folder
    return None


def portable(value: Any, root: Path, home: Path | None = None) -> Any:
    """``value`` (a results document or any part of it) with every absolute path under ``root`` written relative to
    it: a path on its own becomes ``runs/...``, and inside a command line ``--output /checkout/runs/x`` becomes
    ``--output runs/x``. A path under ``home`` (specframe's work folder, where a long benchmark keeps its cache and
    checkpoints outside the checkout) becomes ``$SPECFRAME_HOME/...``: the file says which work folder, not whose.
    Other paths are left as they are."""
    replacements: dict[str, str] = {}
    if home is not None:
        replacements.update({str(Path(home)): "$SPECFRAME_HOME", str(Path(home).resolve()): "$SPECFRAME_HOME"})
    # the checkout wins where it lies inside the work folder (a benchmark's git worktree): longest prefix first
    replacements.update({str(Path(root)): ".", str(Path(root).resolve()): "."})
    return _replace_prefixes(value, sorted(replacements.items(), key=lambda kv: len(kv[0]), reverse=True))


def _replace_prefixes(value: Any, replacements: list[tuple[str, str]]) -> Any:
    if isinstance(value, str):
        for prefix, name in replacements:
            if value == prefix:
                return name
            value = value.replace(prefix + os.sep, "" if name == "." else name + os.sep)
        return value
    if isinstance(value, dict):
        return {k: _replace_prefixes(v, replacements) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_replace_prefixes(v, replacements) for v in value]
    return value


def absolute_paths(value: Any) -> list[str]:
    """Every string in ``value`` (a results document) that holds an absolute path, as a word of its own or after
    ``=``: what a portable results file must not contain."""
    import re

    found: list[str] = []
    if isinstance(value, str):
        for word in re.split(r"[\s=,;'\"]+", value):
            if re.match(r"^/[\w.~-]+/", word) or re.match(r"^[A-Za-z]:[\\/]", word) or word.startswith("~/"):
                found.append(word)
    elif isinstance(value, dict):
        for v in value.values():
            found += absolute_paths(v)
    elif isinstance(value, list | tuple):
        for v in value:
            found += absolute_paths(v)
    return found


def check_results(document: Any, source: str, strict: bool = True) -> None:
    """Refuse a results document without the fields and provenance docs/design.md section 8 requires.

    ``strict=False`` (used when writing) lets a run outside a git checkout record a null commit; ``strict`` (used by
    ``specframe report``) refuses it, since such figures cannot be traced to code.
    """
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        raise SpecframeError(f"{source}: not a specframe results file (schema {SCHEMA!r} missing)")
    for key in ("kind", "metrics", "per_prompt", "provenance"):
        if key not in document:
            raise SpecframeError(f"{source}: results file has no '{key}'")
    prov = document["provenance"]
    missing = [key for key in REQUIRED_PROVENANCE if not isinstance(prov, dict) or key not in prov]
    if missing:
        raise SpecframeError(f"{source}: results without provenance ({', '.join(missing)} missing)")
    if strict and prov["git_commit"] in (None, ""):
        raise SpecframeError(f"{source}: results without provenance (git commit unknown)")
    target = prov["target"]
    if not isinstance(target, dict) or not target.get("id") or not target.get("weights_hash"):
        raise SpecframeError(f"{source}: results without provenance (target id or weights hash missing)")


def read_results(path: Path) -> dict[str, Any]:
    document = read_json(path, "a results file")
    check_results(document, source=str(path))
    return document


def is_baseline(metrics: dict[str, Any]) -> bool:
    """Whether a measured method is a baseline rather than a trained drafter, as its results record it: a drafter
    run without a checkpoint (prompt-lookup n-gram, which has no weights), never by the drafter's name."""
    return bool(metrics.get("drafter")) and not metrics.get("checkpoint")
