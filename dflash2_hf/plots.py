"""Training curves as PNG (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first


def _smooth(values: list[float], window: int = 20) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def training_curves(history: list[dict], path: str | Path) -> Path:
    """Loss (drafter, selector) over steps, top-1 accuracy by block position over the last 10% of steps, and the
    held-out acceptance length over steps."""
    figure, (losses, accuracy, acceptance) = plt.subplots(1, 3, figsize=(15, 4))
    steps = [h["step"] for h in history]
    losses.plot(steps, _smooth([h["drafter_loss"] for h in history]), label="drafter (decay-weighted CE)")
    losses.plot(steps, _smooth([h["selector_loss"] for h in history]), label="selector (K-way CE)")
    losses.set_xlabel("step")
    losses.set_ylabel("loss (moving average)")
    losses.legend()
    tail = history[-max(1, len(history) // 10) :]
    positions = len(tail[0]["accuracy_by_position"])
    mean = [sum(h["accuracy_by_position"][k] for h in tail) / len(tail) for k in range(positions)]
    accuracy.bar(range(1, positions + 1), mean)
    accuracy.set_xlabel("block position")
    accuracy.set_ylabel("top-1 accuracy (training batches)")
    evaluated = [h for h in history if "heldout_acceptance" in h]
    acceptance.plot([h["step"] for h in evaluated], [h["heldout_acceptance"] for h in evaluated], marker="o")
    acceptance.set_xlabel("step")
    acceptance.set_ylabel("held-out acceptance length (argmax path)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return Path(path)
