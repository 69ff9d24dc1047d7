"""A drafter's learning curve: acceptance against the number of training answers, and what it predicts.

    python scripts/learning_curve.py runs/eval-*.json --answers-per-second 0.8 --aim 3.5 \\
        --plot docs/images/smollm2-135m-learning-curve.png

Each file is the ``--out`` of one `dflash2-hf evaluate` run. The drafter it names holds the ``training.json`` that
`dflash2-hf train` wrote: the number of answers trained on (``budget.training_records``) and the training time
(``budget.cpu_seconds``). Each measure (benchmark x decoding setting: a path alone, or the tree with the copied
branch) is fitted over the drafters by least squares in two ways, which part where the measured sizes end:

- log-linear: acceptance = a + b * log10(answers), a curve that never bends;
- logistic: the per-position rate r that a block of ``--block-size`` tokens needs for that acceptance
  (acceptance = 1 + r + r^2 + ... + r^(block-1)), with logit(r) = a + b * log10(answers): an S-curve, slow near the
  floor (r near 0), fast in the middle, saturating at the block.

For each, the answers where the fit reaches ``--aim``, and the time to make and train on them
(``--answers-per-second`` of `dflash2-hf data`, and the training seconds per answer of the measured runs, which used
one recipe: a fixed number of passes over the data), are printed as a Markdown table
(``--training-seconds-per-answer`` replaces the latter, e.g. by a run's that had the CPU to itself). With three sizes
or more, a second table checks both: each fitted on all sizes but the largest, its prediction for the largest next to
the measured value. A curve that does not rise predicts nothing, and says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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
class Link:
    """How acceptance is mapped before a straight line in log10(answers) is fitted, and back."""

    name: str
    forward: Callable[[float], float]
    inverse: Callable[[float], float]


LOG_LINEAR = Link("log-linear", lambda acceptance: acceptance, lambda value: value)


def logistic(block_size: int) -> Link:
    """logit of the per-position rate r with acceptance = 1 + r + ... + r^(block_size-1) (see the module doc)."""
    return Link("logistic", lambda acceptance: _logit(rate_for(acceptance, block_size)),
                lambda value: acceptance_for(1 / (1 + math.exp(-value)), block_size))


def acceptance_for(rate: float, block_size: int) -> float:
    """Tokens per verification when each of a block's drafted positions is right at ``rate`` (the anchor counts 1)."""
    return sum(rate**k for k in range(block_size))


class NoRate(ValueError):
    """An acceptance the logistic link cannot map: at the floor or at the block."""


def rate_for(acceptance: float, block_size: int) -> float:
    """The per-position rate whose :func:`acceptance_for` is ``acceptance``, by bisection; refuses the floor (1) and
    the block (``block_size``), which no rate strictly between 0 and 1 gives."""
    if not 1 < acceptance < block_size:
        raise NoRate(f"an acceptance of {acceptance:.2f} has no per-position rate (it must lie strictly between 1 "
                         f"and the block of {block_size})")
    low, high = 0.0, 1.0
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if acceptance_for(middle, block_size) < acceptance else (low, middle)
    return (low + high) / 2


def _logit(rate: float) -> float:
    return math.log(rate / (1 - rate))


@dataclass(frozen=True)
class Fit:
    """link(acceptance) = intercept + slope * log10(answers), over ``points`` drafters."""

    intercept: float
    slope: float
    points: int
    link: Link = LOG_LINEAR

    def acceptance_at(self, answers: float) -> float:
        return self.link.inverse(self.intercept + self.slope * math.log10(answers))

    def answers_for(self, acceptance: float) -> float | None:
        """The answers where the fit reaches ``acceptance``; None when the curve does not rise."""
        if self.slope <= 0:
            return None
        exponent = (self.link.forward(acceptance) - self.intercept) / self.slope
        return 10**exponent if exponent < 300 else math.inf

    def formula(self) -> str:
        shown = "acceptance" if self.link is LOG_LINEAR else "logit(rate)"
        return f"{shown} = {self.intercept:.2f} + {self.slope:.2f} log10(n)"


def setting_name(record: dict, path: str) -> str:
    """How one evaluate run decoded: a path alone, or a tree (with the copied branch unless it was turned off)."""
    if record.get("tree_nodes") == 0:
        return f"{path} path"
    branch = "" if record.get("lookup_tokens") == 0 else " + copied branch"
    return f"tree{branch} ({path})"


class Refused(Exception):
    """A user's mistake: printed as one line naming the script, exit status 2."""


def read_json(path: Path, what: str) -> dict:
    """The JSON object in ``path``; a file that cannot be read, is not UTF-8 JSON or holds no object is refused."""
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise Refused(f"{path} is not {what} ({type(error).__name__}: {error})") from None
    if not isinstance(record, dict):
        raise Refused(f"{path} is not {what} (a JSON object)")
    return record


def read_points(paths: list[Path], temperature: float) -> list[Point]:
    """The points of every evaluate file at ``temperature``; a file that is not one, or a drafter without its record
    counts, is refused naming the file."""
    points = []
    for path in paths:
        record = read_json(Path(path), "a `dflash2-hf evaluate --out` file")
        try:
            budget = read_json(Path(record["drafter"]) / "training.json", "a training record").get("budget", {})
            if "training_records" not in budget:
                raise Refused(f"{record['drafter']}/training.json does not say how many answers it was trained on "
                              "(budget.training_records; written by `dflash2-hf train` since 2026-12).")
            for result in record["results"]:
                if result["temperature"] == temperature:
                    measure = f"{result['benchmark']}, {setting_name(record, result['path'])}"
                    points.append(Point(measure, budget["training_records"], budget["cpu_seconds"],
                                        result["mean_acceptance_length"]))
        except (KeyError, TypeError) as error:
            raise Refused(f"{path} is not a `dflash2-hf evaluate --out` file (no field {error})") from None
    return points


def fit(points: list[Point], link: Link = LOG_LINEAR) -> Fit:
    """Least-squares line of link(acceptance) over log10(answers); needs two or more different sizes."""
    xs = [math.log10(p.answers) for p in points]
    ys = [link.forward(p.acceptance) for p in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        raise ValueError("a learning curve needs drafters trained on at least two different numbers of answers")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread
    return Fit(mean_y - slope * mean_x, slope, len(points), link)


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
          training_seconds_per_answer: float | None = None, links: tuple[Link, ...] = (LOG_LINEAR,)) -> str:
    """One Markdown row per measure: acceptance at each size, then per link the fit and what it predicts for
    ``aim``."""
    sizes = sorted({p.answers for group in groups.values() for p in group})
    predicted = " | ".join(f"{link.name} fit | answers for {aim:g} | hours" for link in links)
    lines = ["| measure | " + " | ".join(f"{n} answers" for n in sizes) + f" | {predicted} |",
             "|---|" + "---|" * (len(sizes) + 3 * len(links))]
    for measure, group in groups.items():
        at = {p.answers: f"{p.acceptance:.2f}" for p in group}
        cells = [at.get(n, "-") for n in sizes]
        for link in links:
            cells += prediction_cells(group, link, aim, answers_per_second, training_seconds_per_answer)
        lines.append(f"| {measure} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def prediction_cells(group: list[Point], link: Link, aim: float, answers_per_second: float,
                     training_seconds_per_answer: float | None) -> list[str]:
    """The fit, the answers where it reaches ``aim`` and the hours they take; a group the link cannot map (an
    acceptance at the floor) or a curve that does not rise says so."""
    try:
        line = fit(group, link)
    except NoRate as error:
        return ["not fitted: " + str(error).split(" (")[0], "-", "-"]
    needed = line.answers_for(aim)
    if needed is None:
        return [line.formula(), "not reached (the curve does not rise)", "-"]
    if math.isinf(needed):
        return [line.formula(), "beyond 10^300", "-"]
    hours = hours_for(needed, group, answers_per_second, training_seconds_per_answer)
    return [line.formula(), _count(needed), _count(hours)]


def _count(value: float) -> str:
    """Thousands separated up to ten million, powers of ten beyond (where a forecast stops meaning a number)."""
    return f"{value:,.0f}" if value < 1e7 else f"{value:.1e}"


def check_table(groups: dict[str, list[Point]], links: tuple[Link, ...]) -> str | None:
    """Each link fitted on all sizes but the largest, its acceptance there next to the measured one: which curve
    foretold the newest point. None with fewer than three sizes in every measure."""
    checked = {measure: group for measure, group in groups.items() if len({p.answers for p in group}) >= 3}
    if not checked:
        return None
    lines = ["| measure | largest size | measured | " + " | ".join(f"{link.name} from the rest" for link in links)
             + " |", "|---|---|---|" + "---|" * len(links)]
    for measure, group in checked.items():
        largest = group[-1]
        rest = [p for p in group if p.answers < largest.answers]
        cells = []
        for link in links:
            try:
                cells.append(f"{fit(rest, link).acceptance_at(largest.answers):.2f}")
            except NoRate:
                cells.append("not fitted")
        lines.append(f"| {measure} | {largest.answers} | {largest.acceptance:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(groups: dict[str, list[Point]], aim: float, path: Path, links: tuple[Link, ...] = (LOG_LINEAR,)) -> Path:
    """Acceptance over answers (log scale) per measure, with each link's fitted curve drawn out towards the aim
    (dotted: log-linear, dashed: logistic)."""
    figure, axis = plt.subplots(figsize=(8, 5))
    for measure, group in groups.items():
        shown = axis.plot([p.answers for p in group], [p.acceptance for p in group], marker="o", label=measure)
        for link, style in zip(links, (":", "--")):
            try:
                line = fit(group, link)
            except NoRate:
                continue
            reach = min(line.answers_for(aim) or group[-1].answers, group[-1].answers * 1e3)
            ends = [10**x for x in _steps(math.log10(group[0].answers), math.log10(max(reach, group[-1].answers)))]
            axis.plot(ends, [line.acceptance_at(n) for n in ends], linestyle=style, color=shown[0].get_color())
    axis.axhline(aim, color="grey", linewidth=0.8, linestyle="-.", label=f"aim: {aim:g} tokens per verification")
    axis.set_xscale("log")
    axis.set_ylim(0.9, aim + 0.5)  # a curve past the aim leaves the figure there
    axis.set_xlabel("training answers (target-written)")
    axis.set_ylabel("acceptance length (tokens per verification, T=0)")
    axis.set_title("fits: dotted log-linear, dashed logistic", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return Path(path)


def _steps(start: float, stop: float, count: int = 50) -> list[float]:
    return [start + (stop - start) * i / (count - 1) for i in range(count)]


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
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per block, the anchor included, for the logistic fit's per-position rate (>= 2)")
    parser.add_argument("--plot", type=Path, help="write the curves to this PNG")
    args = parser.parse_args()
    if args.answers_per_second <= 0 or args.aim <= 1:
        parser.error(f"--answers-per-second must be > 0 and --aim > 1, got {args.answers_per_second} and {args.aim}")
    if args.block_size < 2 or args.aim >= args.block_size:
        parser.error(f"--block-size must be >= 2 and above --aim, got {args.block_size} (aim {args.aim})")
    if args.training_seconds_per_answer is not None and args.training_seconds_per_answer <= 0:
        parser.error(f"--training-seconds-per-answer must be > 0, got {args.training_seconds_per_answer}")
    missing = [str(path) for path in args.evaluations if not path.is_file()]
    if missing:
        parser.error(f"no such evaluate file: {', '.join(missing)}")
    if args.plot is not None and (args.plot.is_dir() or not os.access(args.plot.parent.resolve(), os.W_OK)
                                  or not args.plot.parent.is_dir()):
        parser.error(f"--plot {args.plot}: cannot be written (a folder, or its folder is missing or read-only)")
    return args


def report(args: argparse.Namespace) -> None:
    """Print the table and the check of the fits; draw the curves when ``--plot`` asks."""
    groups = by_measure(read_points(args.evaluations, args.temperature))
    if not groups:
        raise Refused(f"the files hold no result at temperature {args.temperature:g}")
    links = (LOG_LINEAR, logistic(args.block_size))
    try:
        print(table(groups, args.aim, args.answers_per_second, args.training_seconds_per_answer, links))
    except ValueError as error:
        raise Refused(str(error)) from None
    check = check_table(groups, links)
    if check:
        print(f"\nEach fit on the smaller sizes, at the largest:\n\n{check}")
    if args.plot:
        try:
            print(f"plot written to {plot(groups, args.aim, args.plot, links)}")
        except OSError as error:
            raise Refused(f"--plot {args.plot}: {error}") from None


def main() -> None:
    """Run :func:`report`: a user's mistake is one line and status 2, Ctrl-C one line and status 130."""
    args = arguments()
    try:
        report(args)
    except Refused as refused:
        print(f"learning_curve.py: {refused}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("learning_curve.py: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
