"""Training checkpoints in safetensors + JSON (no pickle), written to a temporary folder and renamed into place.

A checkpoint folder ``step-000123`` holds ``model.safetensors`` (the trainable weights), ``optimizer.safetensors``
(every optimizer state tensor, flattened), ``rng.safetensors`` and ``state.json`` (step, optimizer parameter
groups, scheduler state, anything JSON-able the trainer adds). A stop at any moment (a kill included) leaves either
the previous complete checkpoint or the new one, never a partial folder under a checkpoint name: a new checkpoint is
written under a temporary name and renamed into place, an old one is renamed away before it is deleted.

:func:`check_writable_folder` refuses, before a command loads anything, an output folder it could not write (the
run folder of ``train``, the data folder of ``data``, the folder ``export`` writes).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

PREFIX = "step-"


def check_writable_folder(folder: str | os.PathLike) -> None:
    """Refuse, before any work, a folder that a command could not create or write to: an existing file, a path under
    a file, or a place where no folder can be made (no permission, a read-only or virtual file system such as
    ``/proc``). Raises ``ValueError``. The nearest existing folder is probed by creating and removing an empty folder
    in it (permissions alone do not tell, e.g. for root), so nothing is left behind."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} exists and is not a folder.")
    existing = next(path for path in [folder.absolute(), *folder.absolute().parents] if path.exists())
    if not existing.is_dir():
        raise ValueError(f"{folder} cannot be made: {existing} is a file, not a folder.")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=existing))
    except OSError as error:
        raise ValueError(f"{folder} cannot be written: no folder can be made in {existing} "
                         f"({error.strerror}).") from None


def _flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], list[dict]]:
    tensors = {}
    for index, values in state["state"].items():
        for name, value in values.items():
            tensor = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{index}.{name}"] = tensor.detach().contiguous().cpu()
    return tensors, state["param_groups"]


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], param_groups: list[dict]) -> dict:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = tensor
    return {"state": state, "param_groups": param_groups}


def save_checkpoint(
    folder: str | os.PathLike,
    step: int,
    model_state: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` under ``folder`` atomically and keep only the newest ``keep`` checkpoints."""
    folder = Path(folder)
    final = folder / f"{PREFIX}{step:06d}"
    temporary = folder / f".{final.name}.tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in model_state.items()}, temporary / "model.safetensors")
    optimizer_tensors, param_groups = _flatten_optimizer(optimizer.state_dict())
    save_file(optimizer_tensors, temporary / "optimizer.safetensors")
    save_file({"torch": torch.get_rng_state()}, temporary / "rng.safetensors")
    state = {"step": step, "param_groups": param_groups, "scheduler": scheduler.state_dict(), "extra": extra or {}}
    (temporary / "state.json").write_text(json.dumps(state, indent=2))
    for path in temporary.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    if final.exists():
        _discard(final)
    os.replace(temporary, final)
    for old in sorted(folder.glob(f"{PREFIX}*"))[:-keep]:
        _discard(old)
    return final


def _discard(checkpoint: Path) -> None:
    """Rename a checkpoint away, then delete it: a stop mid-delete leaves no partial folder under a checkpoint name."""
    trash = checkpoint.with_name(f".{checkpoint.name}.deleting")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(checkpoint, trash)
    shutil.rmtree(trash, ignore_errors=True)


def checkpoints(folder: str | os.PathLike) -> list[Path]:
    """The complete checkpoints under ``folder`` (each renamed into place whole), oldest first."""
    return sorted(p for p in Path(folder).glob(f"{PREFIX}*") if (p / "state.json").exists())


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``folder``, or ``None``."""
    found = checkpoints(folder)
    return found[-1] if found else None


#: What each entry of a checkpoint's ``state.json`` holds, as JSON reads it.
STATE_FIELDS = {"step": int, "param_groups": list, "scheduler": dict, "extra": dict}


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's ``state.json``, or a ``ValueError`` naming the file and what is wrong with it (not UTF-8 JSON,
    not an object, a field missing or of the wrong type), so that a damaged checkpoint is skipped as such."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not JSON ({error})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a JSON {type(state).__name__}, not the object a checkpoint saves")
    wrong = [f"{name} (expected {kind.__name__}, found {type(state.get(name)).__name__})"
             for name, kind in STATE_FIELDS.items()
             if not isinstance(state.get(name), kind) or isinstance(state.get(name), bool)]
    if wrong:
        raise ValueError(f"{path} lacks or mistypes {', '.join(wrong)}")
    return state


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    """Restore model weights, optimizer, scheduler and RNG; returns the saved ``state.json`` content."""
    path = Path(path)
    state = read_state(path / "state.json")
    missing, unexpected = model.load_state_dict(load_file(path / "model.safetensors"), strict=False)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    if unexpected or trainable & set(missing):
        raise ValueError(f"Checkpoint {path} does not match the model: missing {sorted(trainable & set(missing))}, unexpected {unexpected}")
    optimizer.load_state_dict(_unflatten_optimizer(load_file(path / "optimizer.safetensors"), state["param_groups"]))
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(load_file(path / "rng.safetensors")["torch"])
    return state
