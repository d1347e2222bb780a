"""speculators 0.9.0's own trainer as a peer of specframe's (issue 54, item 1): its version check, the CPU patches the
peer benchmark applies to a scratch copy of the installed package, and the ``speculators train`` command.

The installed package is never modified: ``scratch_copy`` copies ``site-packages/speculators`` into the work folder,
applies ``PATCHES`` there (each must match the installed source exactly once, else the copy is refused in one line)
and ``speculators train`` runs with ``PYTHONPATH`` pointing at the copy. The patches change where the trainer puts
its tensors and whether it synchronises an accelerator, never what it computes; the three settings the CPU also
needs (``--draft-attn-impl sdpa``, ``--loss-implementation eager``, ``--hidden-states-dtype float32``) are flags
(``CPU_FLAGS``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import attrs

#: the one speculators release these patches and flags were written for (read from its source)
SUPPORTED_VERSION = "0.9.0"


class PeerError(RuntimeError):
    """A peer-benchmark precondition that fails in one line (wrong version, a patch that does not apply)."""


@attrs.frozen
class Patch:
    #: file, relative to the package folder
    file: str
    old: str
    new: str
    why: str


_GUARDED_SYNC = "if torch.accelerator.is_available():  # specframe peer patch: no accelerator to sync on a CPU\n"

PATCHES = (
    Patch("train/trainer.py",
          "            torch.accelerator.synchronize()\n            self._marks[name] = time.perf_counter()",
          "            " + _GUARDED_SYNC + "                torch.accelerator.synchronize()\n"
          "            self._marks[name] = time.perf_counter()",
          "_StepTimer.mark calls torch.accelerator.synchronize(), which raises without an accelerator"),
    Patch("train/trainer.py",
          "        torch.accelerator.synchronize()\n        return time.perf_counter()",
          "        " + _GUARDED_SYNC + "            torch.accelerator.synchronize()\n"
          "        return time.perf_counter()",
          "_StepTimer.now: the same synchronisation"),
    Patch("train/trainer.py",
          '        self.device_type = acc.type if acc is not None else "cuda"\n',
          '        self.device_type = acc.type if acc is not None else "cpu"  # specframe peer patch: was "cuda"\n'
          "        self.device = torch.device(acc.type, self.local_rank) if acc is not None else torch.device('cpu')\n"
          "        self.use_autocast = config.hidden_states_dtype != torch.float32\n",
          "without an accelerator the Trainer picks 'cuda' and local rank 0: train on the CPU instead; CPU autocast "
          "takes bf16/fp16 only, so an fp32 run (--hidden-states-dtype float32) runs without autocast, as fp32 "
          "autocast would compute anyway"),
    Patch("train/trainer.py",
          "            self.model.to(self.local_rank)  # type: ignore[arg-type]\n            if load_checkpoint:",
          "            self.model.to(self.device)  # type: ignore[arg-type]  # specframe peer patch\n"
          "            if load_checkpoint:",
          "the single-process model placement: the CPU device instead of the local rank (a CUDA index)"),
    Patch("train/trainer.py",
          '            timer.mark("pre_h2d")\n            gpu_batch = {\n                k: v.to(self.local_rank, '
          "non_blocking=True)",
          '            timer.mark("pre_h2d")\n            gpu_batch = {\n                k: v.to(self.device, '
          "non_blocking=True)  # specframe peer patch",
          "the training batch's placement: the same device as the model"),
    Patch("train/trainer.py",
          "                synchronize=_should_sync_recovery(i, num_batches - 1),\n"
          "            )\n            gpu_batch = {\n"
          "                k: v.to(self.local_rank, non_blocking=True)",
          "                synchronize=_should_sync_recovery(i, num_batches - 1),\n"
          "            )\n            gpu_batch = {\n"
          "                k: v.to(self.device, non_blocking=True)  # specframe peer patch",
          "the validation batch's placement: the same device as the model"),
    Patch("train/trainer.py",
          "                self.device_type, dtype=self.config.hidden_states_dtype\n            ):\n"
          '                timer.mark("fetch")',
          "                self.device_type, dtype=self.config.hidden_states_dtype, enabled=self.use_autocast\n"
          '            ):\n                timer.mark("fetch")',
          "training autocast off for fp32 (a warning per step on the CPU; fp32 autocast changes nothing)"),
    Patch("train/trainer.py",
          "                self.device_type, dtype=self.config.hidden_states_dtype\n            ):\n"
          "                _draft_tokens, _loss, metrics = self.model(",
          "                self.device_type, dtype=self.config.hidden_states_dtype, enabled=self.use_autocast\n"
          "            ):\n                _draft_tokens, _loss, metrics = self.model(",
          "validation autocast: the same"),
    Patch("utils/util.py", '        return "cuda:0"\n', '        return "cpu"  # specframe peer patch: was "cuda:0"\n',
          "get_current_device (checkpoint loading on --resume) names cuda:0 without an accelerator"),
)

#: flags, not patches: what the CPU needs that speculators already offers as settings
CPU_FLAGS = {
    "--draft-attn-impl": ("sdpa", "FlexAttention (the default) has no backward pass on the CPU"),
    "--loss-implementation": ("eager", "the default fused loss is Triton GPU kernels"),
    "--hidden-states-dtype": ("float32", "fp32 hidden states and compute, as specframe trains on a CPU (speculators' "
                              "default bf16 autocast also runs on a CPU: not a CPU need, a choice so both compute "
                              "alike)"),
    "--num-workers": ("0", "12 spawned loader workers on 2 cores only compete with the step"),
    "--on-missing": ("raise", "every hidden state is written beforehand; no vLLM server generates missing ones"),
}


def installed_version() -> str | None:
    """speculators' installed version, or None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("speculators")
    except metadata.PackageNotFoundError:
        return None


def installed_package() -> Path:
    """The installed package folder (found without importing it: its import pulls in torch and transformers)."""
    from importlib.util import find_spec

    spec = find_spec("speculators")
    if spec is None or spec.origin is None:
        raise PeerError("speculators is not installed (pip install speculators==0.9.0): the peer benchmark needs it")
    return Path(spec.origin).parent


def check_version(version: str | None) -> None:
    """One line when speculators is missing or is not the release the patches and flags were written for."""
    if version is None:
        raise PeerError("speculators is not installed (pip install speculators==0.9.0): the peer benchmark needs it")
    if version != SUPPORTED_VERSION:
        raise PeerError(f"speculators {version} is installed; the peer benchmark's CPU patches and flags were written "
                        f"for {SUPPORTED_VERSION} only (pip install speculators=={SUPPORTED_VERSION})")


def apply(source: str, patch: Patch) -> str:
    """``source`` with ``patch`` applied; refused unless its text occurs exactly once."""
    found = source.count(patch.old)
    if found != 1:
        raise PeerError(f"speculators patch for {patch.file} ({patch.why}) matches {found} places, not 1: the "
                        f"installed source is not the {SUPPORTED_VERSION} one it was written for")
    return source.replace(patch.old, patch.new)


def patch_list() -> list[dict[str, str]]:
    """The patches and flags as the results' config records them: (file, change, why)."""
    rows = [{"file": f"speculators/{p.file}", "change": p.new.strip(), "why": p.why} for p in PATCHES]
    rows += [{"file": "(flag)", "change": f"{flag} {value}", "why": why} for flag, (value, why) in CPU_FLAGS.items()]
    return rows


def scratch_copy(dest: Path, package: Path | None = None) -> Path:
    """A patched copy of the installed package under ``dest`` (``dest/speculators``); returns ``dest``, the
    ``PYTHONPATH`` entry. Written beside and moved into place, so a failed patch leaves no half-patched copy."""
    check_version(installed_version())
    package = package or installed_package()
    done = dest / "patched.json"
    key = json.dumps([SUPPORTED_VERSION, [attrs.asdict(p) for p in PATCHES]])
    if done.exists() and done.read_text() == key and (dest / "speculators").is_dir():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(package, tmp / "speculators", ignore=shutil.ignore_patterns("__pycache__"))
    for p in PATCHES:
        path = tmp / "speculators" / p.file
        path.write_text(apply(path.read_text(), p))
    (tmp / "patched.json").write_text(key)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest
