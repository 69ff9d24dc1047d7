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
    acceptance.plot([h["step"] for h in evaluated], [h["heldout_acceptance"] for h in evaluated], marker="o",
                    label="argmax path")
    walked = [h for h in evaluated if "heldout_selector_acceptance" in h]
    if walked:
        acceptance.plot([h["step"] for h in walked], [h["heldout_selector_acceptance"] for h in walked], marker="s",
                        label="selector (greedy walk)")
    acceptance.set_xlabel("step")
    acceptance.set_ylabel("held-out acceptance length (teacher-forced)")
    acceptance.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return Path(path)


def benchmark_plots(rows: list[dict], folder: str | Path) -> list[Path]:
    """Speedup bars (median, quartile whiskers), suffix decay (recall by block position) and acceptance histograms."""
    folder = Path(folder)
    paths = []
    temperatures = sorted({r["temperature"] for r in rows})

    figure, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4), squeeze=False)
    for axis, temperature in zip(axes[0], temperatures):
        group = [r for r in rows if r["temperature"] == temperature]
        medians = [r["speedup_median"] for r in group]
        errors = [[m - r["speedup_q1"] for m, r in zip(medians, group)], [r["speedup_q3"] - m for m, r in zip(medians, group)]]
        axis.bar(range(len(group)), medians, yerr=errors, capsize=3)
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_xticks(range(len(group)), [r["method"] for r in group], rotation=30, ha="right")
        axis.set_ylabel("speedup over plain generate (paired)")
        axis.set_title(f"temperature {temperature:g}")
    figure.tight_layout()
    paths.append(folder / "speedup.png")
    figure.savefig(paths[-1], dpi=100)
    plt.close(figure)

    drafted = [r for r in rows if r.get("topk_recall_by_position")]
    figure, (decay, histogram) = plt.subplots(1, 2, figsize=(12, 4))
    for row in drafted:
        label = f"{row['method']}, T={row['temperature']:g}"
        positions = range(1, len(row["topk_recall_by_position"]) + 1)
        decay.plot(positions, row["topk_recall_by_position"], marker="o", label=f"top-K, {label}")
        decay.plot(positions, row["top1_recall_by_position"], linestyle="--", label=f"top-1, {label}")
        counts = row["acceptance_histogram"]
        total = sum(counts.values())
        histogram.plot([int(k) for k in counts], [v / total for v in counts.values()], marker=".", label=label)
    decay.set_xlabel("block position")
    decay.set_ylabel("recall of the emitted token")
    decay.set_title("suffix decay")
    histogram.set_xlabel("tokens per verification")
    histogram.set_ylabel("share of cycles")
    for axis in (decay, histogram):
        if drafted:
            axis.legend(fontsize=6)
    figure.tight_layout()
    paths.append(folder / "drafts.png")
    figure.savefig(paths[-1], dpi=100)
    plt.close(figure)
    return paths
