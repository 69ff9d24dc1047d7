"""The target's features of training sequences, computed once and kept on disk for every later step and run.

A training step needs, for each sequence, the hidden states of the target layers the drafter reads: one target
forward over the whole sequence, which on a CPU costs more than the drafter's own step. :class:`FeatureStore` keeps
them as one safetensors file per sequence (read back memory-mapped), named by the hash of the sequence's token ids,
under a folder named by what computed them (the target's config, the layers read and the dtype). So a resumed run, a
run with more steps, and runs on a subset or a superset of the same answers (a learning curve) compute each
sequence's features once; features of another target or another layout are never mixed in. Each file is written to
a temporary name and then renamed: a stop mid-write leaves no partial file behind.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file


def layout_key(target_config, layers: Sequence[int], dtype: torch.dtype) -> str:
    """A short name for features of ``layers`` (hidden-state indices) of the target with ``target_config`` in
    ``dtype``: equal exactly when the three are."""
    described = json.dumps({"target": target_config.to_dict(), "layers": list(layers), "dtype": str(dtype)},
                           sort_keys=True, default=str)
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def sequence_key(input_ids: torch.Tensor) -> str:
    """The name of a sequence's features: the hash of its token ids."""
    return hashlib.sha256(input_ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()


class FeatureStore:
    """Target features ``[T, width]`` by sequence, on disk under ``folder/<layout key>/``."""

    def __init__(self, folder: str | os.PathLike, layout: str):
        self.folder = Path(folder) / layout

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.safetensors"

    def load(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The stored features of ``input_ids``, or ``None`` when they are not stored (or their file cannot be
        read, e.g. a disk that filled up: they are computed again and the file replaced)."""
        path = self._path(sequence_key(input_ids))
        if not path.exists():
            return None
        try:
            features = load_file(path)["features"]
        except (OSError, SafetensorError, KeyError):
            return None
        return features if features.ndim > 0 and features.shape[0] == input_ids.shape[0] else None

    def save(self, input_ids: torch.Tensor, features: torch.Tensor) -> None:
        """Keep ``features`` of ``input_ids`` (written whole, then renamed into place)."""
        path = self._path(sequence_key(input_ids))
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        save_file({"features": features.detach().cpu().contiguous()}, temporary)
        os.replace(temporary, path)
