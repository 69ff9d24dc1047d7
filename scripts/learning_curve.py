"""A drafter's learning curve: acceptance against the number of training answers, and what it predicts.

    python scripts/learning_curve.py runs/eval-*.json --answers-per-second 0.8 --aim 3.5 \\
        --plot docs/images/smollm2-135m-learning-curve.png

Each file is the ``--out`` of one `dflash2-hf evaluate` run. The drafter it names holds the ``training.json`` that
`dflash2-hf train` wrote: the number of answers trained on (``budget.training_records``) and the training time
(``budget.cpu_seconds``). Each measure (benchmark x decoding setting: a path alone, or the tree with the copied
branch) is fitted as acceptance = a + b * log10(answers) over the drafters, by least squares; the answers where the
fit reaches ``--aim``, and the time to make and train on them (``--answers-per-second`` of `dflash2-hf data`, and the
training seconds per answer of the measured runs, which used one recipe: a fixed number of passes over the data),
are printed as a Markdown table (``--training-seconds-per-answer`` replaces the latter, e.g. by a run's that had the
CPU to itself). A curve that does not rise predicts nothing, and says so.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first


@dataclass(frozen=True)
class Point:
    """One drafter's acceptance on one measure."""

    measure: str
    answers: int
    training_seconds: float
    acceptance: float


@dataclass(frozen=True)
class Fit:
    """acceptance = intercept + slope * log10(answers), over ``points`` drafters."""

    intercept: float
    slope: float
    points: int

    def acceptance_at(self, answers: float) -> float:
        return self.intercept + self.slope * math.log10(answers)

    def answers_for(self, acceptance: float) -> float | None:
        """The answers where the fit reaches ``acceptance``; None when the curve does not rise."""
        if self.slope <= 0:
            return None
        return 10 ** ((acceptance - self.intercept) / self.slope)


def setting_name(record: dict, path: str) -> str:
    """How one evaluate run decoded: a path alone, or a tree (with the copied branch unless it was turned off)."""
    if record.get("tree_nodes") == 0:
        return f"{path} path"
    branch = "" if record.get("lookup_tokens") == 0 else " + copied branch"
    return f"tree{branch} ({path})"


def read_points(paths: list[Path], temperature: float) -> list[Point]:
    """The points of every evaluate file at ``temperature``; a drafter without its record counts is refused."""
    points = []
    for path in paths:
        record = json.loads(Path(path).read_text())
        budget = json.loads((Path(record["drafter"]) / "training.json").read_text()).get("budget", {})
        if "training_records" not in budget:
            raise SystemExit(f"learning_curve.py: {record['drafter']}/training.json does not say how many answers it "
                             "was trained on (budget.training_records; written by `dflash2-hf train` since 2026-12).")
        for result in record["results"]:
            if result["temperature"] == temperature:
                measure = f"{result['benchmark']}, {setting_name(record, result['path'])}"
                points.append(Point(measure, budget["training_records"], budget["cpu_seconds"],
                                    result["mean_acceptance_length"]))
    return points


def fit(points: list[Point]) -> Fit:
    """Least-squares line of acceptance over log10(answers); needs two or more different sizes."""
    xs = [math.log10(p.answers) for p in points]
    ys = [p.acceptance for p in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        raise ValueError("a learning curve needs drafters trained on at least two different numbers of answers")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread
    return Fit(mean_y - slope * mean_x, slope, len(points))


def by_measure(points: list[Point]) -> dict[str, list[Point]]:
    """The points grouped by measure, each group by answers, in the order the measures were first read."""
    groups: dict[str, list[Point]] = {}
    for point in points:
        groups.setdefault(point.measure, []).append(point)
    return {measure: sorted(group, key=lambda p: p.answers) for measure, group in groups.items()}


def hours_for(answers: float, group: list[Point], answers_per_second: float,
              training_seconds_per_answer: float | None = None) -> float:
    """Hours to answer ``answers`` prompts and train on them: at the given training seconds per answer, else at the
    measured runs' own."""
    if training_seconds_per_answer is None:
        training_seconds_per_answer = sum(p.training_seconds for p in group) / sum(p.answers for p in group)
    return answers * (1 / answers_per_second + training_seconds_per_answer) / 3600


def table(groups: dict[str, list[Point]], aim: float, answers_per_second: float,
          training_seconds_per_answer: float | None = None) -> str:
    """One Markdown row per measure: acceptance at each size, the fit, and what it predicts for ``aim``."""
    sizes = sorted({p.answers for group in groups.values() for p in group})
    lines = ["| measure | " + " | ".join(f"{n} answers" for n in sizes) + f" | fit | answers for {aim:g} | hours |",
             "|---|" + "---|" * (len(sizes) + 3)]
    for measure, group in groups.items():
        line = fit(group)
        at = {p.answers: f"{p.acceptance:.2f}" for p in group}
        needed = line.answers_for(aim)
        prediction = ("not reached (the curve does not rise)", "-") if needed is None else (
            f"{needed:,.0f}", f"{hours_for(needed, group, answers_per_second, training_seconds_per_answer):,.0f}")
        cells = [at.get(n, "-") for n in sizes] + [f"{line.intercept:.2f} + {line.slope:.2f} log10(n)", *prediction]
        lines.append(f"| {measure} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(groups: dict[str, list[Point]], aim: float, path: Path) -> Path:
    """Acceptance over answers (log scale) per measure, with its fitted line drawn out to the aim."""
    figure, axis = plt.subplots(figsize=(8, 5))
    for measure, group in groups.items():
        line = fit(group)
        shown = axis.plot([p.answers for p in group], [p.acceptance for p in group], marker="o", label=measure)
        reach = line.answers_for(aim) or group[-1].answers
        ends = [group[0].answers, max(group[-1].answers, min(reach, group[-1].answers * 1e4))]
        axis.plot(ends, [line.acceptance_at(n) for n in ends], linestyle=":", color=shown[0].get_color())
    axis.axhline(aim, color="grey", linewidth=0.8, linestyle="--", label=f"aim: {aim:g} tokens per verification")
    axis.set_xscale("log")
    axis.set_xlabel("training answers (target-written)")
    axis.set_ylabel("acceptance length (tokens per verification, T=0)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return Path(path)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("evaluations", nargs="+", type=Path, help="`dflash2-hf evaluate --out` files")
    parser.add_argument("--answers-per-second", type=float, required=True,
                        help="the rate `dflash2-hf data` printed on this machine (> 0)")
    parser.add_argument("--training-seconds-per-answer", type=float,
                        help="training time per answer for the prediction (> 0; default: the measured runs' own, "
                             "from their training.json)")
    parser.add_argument("--aim", type=float, default=3.5, help="acceptance length to predict for (> 1)")
    parser.add_argument("--temperature", type=float, default=0.0, help="the evaluated temperature to read")
    parser.add_argument("--plot", type=Path, help="write the curves to this PNG")
    args = parser.parse_args()
    if args.answers_per_second <= 0 or args.aim <= 1:
        parser.error(f"--answers-per-second must be > 0 and --aim > 1, got {args.answers_per_second} and {args.aim}")
    if args.training_seconds_per_answer is not None and args.training_seconds_per_answer <= 0:
        parser.error(f"--training-seconds-per-answer must be > 0, got {args.training_seconds_per_answer}")
    missing = [str(path) for path in args.evaluations if not path.is_file()]
    if missing:
        parser.error(f"no such evaluate file: {', '.join(missing)}")
    return args


def main() -> None:
    args = arguments()
    groups = by_measure(read_points(args.evaluations, args.temperature))
    if not groups:
        raise SystemExit(f"learning_curve.py: the files hold no result at temperature {args.temperature:g}")
    try:
        print(table(groups, args.aim, args.answers_per_second, args.training_seconds_per_answer))
    except ValueError as error:
        raise SystemExit(f"learning_curve.py: {error}") from None
    if args.plot:
        print(f"plot written to {plot(groups, args.aim, args.plot)}")


if __name__ == "__main__":
    main()
