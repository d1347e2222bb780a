"""How a drafter's checkpoint is written and read: its module's weights as safetensors (nothing is ever unpickled)
beside the JSON record ``Drafter.describe()`` returns, which says which drafter wrote them and with what options.

``Drafter.save`` / ``load`` / ``read_checkpoint_info`` / ``from_checkpoint`` delegate here; the hooks a drafter
overrides (``describe``, ``check_checkpoint``, ``restore_checkpoint``) stay on the class and are called from here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specframe.errors import SpecframeError, read_json


def save(drafter: Any, directory: Path) -> None:
    """Write ``drafter``'s module weights (safetensors) and ``describe()`` (JSON) into ``directory``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.module().state_dict().items()}
    save_file(state, str(directory / drafter.CHECKPOINT_WEIGHTS), metadata={"drafter": drafter.name})
    (directory / drafter.CHECKPOINT_INFO).write_text(json.dumps(drafter.describe(), indent=1))


def load(drafter: Any, directory: Path) -> None:
    """Load what ``save`` wrote into ``drafter``: its ``check_checkpoint`` vets the recorded description before any
    weight is read, its ``restore_checkpoint`` takes back the non-tensor state after."""
    from safetensors.torch import load_file

    directory = Path(directory)
    info = drafter.read_checkpoint_info(directory)
    drafter.check_checkpoint(directory, info)
    try:
        drafter.module().load_state_dict(load_file(str(directory / drafter.CHECKPOINT_WEIGHTS)))
    except RuntimeError as exc:
        raise SpecframeError(f"{directory}: weights do not fit this {drafter.name} drafter: {exc}") from exc
    drafter.restore_checkpoint(info)


def read_info(cls: Any, directory: Path) -> dict[str, Any]:
    """The checkpoint's ``describe()`` record, refused unless drafter class ``cls`` wrote it."""
    path = Path(directory) / cls.CHECKPOINT_INFO
    if not path.exists():
        raise SpecframeError(f"{directory} is not a {cls.name} checkpoint (no {cls.CHECKPOINT_INFO})")
    info = read_json(path, f"the {cls.name} drafter's description")
    if info.get("drafter") != cls.name:
        raise SpecframeError(f"{directory} holds a '{info.get('drafter')}' drafter, not '{cls.name}'")
    return info


def rebuild(cls: Any, directory: Path, target_config: Any) -> Any:
    """A drafter of class ``cls`` rebuilt from ``save``'s files (options included) for the given target config."""
    from specframe.structuring import structure_options

    info = cls.read_checkpoint_info(directory)
    # the one converter and error format (specframe.structuring): a damaged record names the option
    drafter = cls(target_config, structure_options(info["options"], cls.Options, f"{directory}: drafter '{cls.name}'"))
    drafter.load(directory)
    return drafter
