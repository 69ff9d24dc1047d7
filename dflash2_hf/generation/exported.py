"""DFlash 2 decoding from an exported drafter folder or Hub repo through transformers' own remote-code mechanism:
``target.generate(**inputs, custom_generate="org/drafter", trust_remote_code=True)``.

``dflash2-hf export`` writes ``custom_generate/generate.py`` into the drafter folder; transformers loads it and
calls its ``generate`` (this module's :func:`generate`) with the call's arguments. The drafter is the one in the
folder or repo the call named (or ``drafter=``, a drafter, folder or repo id, to choose another); it is loaded in the
target's dtype onto the target's device once and reused by later calls. Decoding then runs as
``generate(assistant_model=drafter)`` does (streaming and stop strings included) where this process has that route,
and through the public ``custom_generate`` seam otherwise; the ``dflash_*`` options work as documented for both.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

from ..modeling import DFlashDraftModel
from .integration import assistant_route_installed, custom_generate, custom_generate_source, is_drafter

#: Keyword arguments of ``generate`` that transformers also uses to fetch ``custom_generate/generate.py``; they fetch
#: the drafter from the same place.
HUB_DOWNLOAD_ARGUMENTS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "proxies")
#: Drafters kept loaded, newest last (a process usually decodes with one).
LOADED_DRAFTERS: OrderedDict[tuple, DFlashDraftModel] = OrderedDict()
KEPT_DRAFTERS = 2


def generate(model, drafter=None, **generate_arguments):
    """``generate`` with the drafter of the exported folder or repo the call named (see the module docstring)."""
    download = {name: generate_arguments.pop(name) for name in HUB_DOWNLOAD_ARGUMENTS if name in generate_arguments}
    if generate_arguments.get("assistant_model") is not None:
        raise ValueError("custom_generate=<exported drafter> brings its own drafter; pass drafter=<folder, repo id or "
                         "drafter> to use another, not assistant_model.")
    drafter = exported_drafter(drafter, model, download)
    if assistant_route_installed():
        return model.generate(**generate_arguments | {"assistant_model": drafter})
    return model.generate(**generate_arguments, custom_generate=custom_generate, drafter=drafter)


def exported_drafter(drafter, model, download: dict) -> DFlashDraftModel:
    """``drafter`` itself when it is a loaded drafter, else the drafter of the folder or repo id it names (by default
    the one the call's ``custom_generate`` named), in ``model``'s dtype on ``model``'s device, loaded once."""
    if drafter is not None and is_drafter(drafter):
        return drafter
    source = custom_generate_source() if drafter is None else drafter
    if source is None:
        raise ValueError("Could not tell which folder or Hub repo custom_generate named; pass drafter=<the exported "
                         "drafter's folder or repo id>.")
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"drafter= takes a DFlash drafter, a folder or a Hub repo id; got {type(source).__name__}.")
    key = (str(source), model.dtype, str(model.device), weights_stamp(Path(source)), download.get("revision"))
    if key not in LOADED_DRAFTERS:
        loaded = DFlashDraftModel.from_pretrained(str(source), dtype=model.dtype, **download)
        LOADED_DRAFTERS[key] = loaded.to(model.device).eval()
        while len(LOADED_DRAFTERS) > KEPT_DRAFTERS:
            LOADED_DRAFTERS.popitem(last=False)
    LOADED_DRAFTERS.move_to_end(key)
    return LOADED_DRAFTERS[key]


def weights_stamp(folder: Path) -> int | None:
    """When a local folder's weights were last written (a re-exported folder is loaded again); None for a repo id."""
    weights = folder / "model.safetensors"
    return weights.stat().st_mtime_ns if weights.is_file() else None

