"""scripts/learning_curve.py: acceptance against training answers, fitted on log10(answers), and its prediction."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "learning_curve.py"
spec = importlib.util.spec_from_file_location("learning_curve", SCRIPT)
learning_curve = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = learning_curve  # its dataclasses look their module up while being made
spec.loader.exec_module(learning_curve)
Point = learning_curve.Point


def points_on_line(intercept: float, slope: float, sizes=(100, 1000, 10000)) -> list:
    return [Point("code", n, 2.0 * n, intercept + slope * math.log10(n)) for n in sizes]


def test_the_fit_recovers_a_log_linear_curve_and_the_answers_where_it_reaches_the_aim():
    line = learning_curve.fit(points_on_line(0.5, 0.5))
    assert (line.intercept, line.slope, line.points) == pytest.approx((0.5, 0.5, 3))
    assert line.answers_for(3.5) == pytest.approx(1e6), "0.5 + 0.5 * 6 = 3.5"


@pytest.mark.parametrize("slope", [0.0, -0.2])
def test_a_curve_that_does_not_rise_predicts_no_size_and_the_table_says_so(slope):
    group = points_on_line(1.4, slope)
    assert learning_curve.fit(group).answers_for(3.5) is None
    assert "not reached (the curve does not rise)" in learning_curve.table({"code": group}, 3.5, 1.0)


def test_one_size_alone_is_refused_as_no_curve():
    with pytest.raises(ValueError, match="at least two different numbers of answers"):
        learning_curve.fit([Point("code", 300, 10.0, 1.2), Point("code", 300, 10.0, 1.3)])


def test_the_predicted_hours_add_answering_and_training_at_the_measured_rates():
    group = points_on_line(0.5, 0.5)  # 2 training seconds per answer
    assert learning_curve.hours_for(3600, group, answers_per_second=0.5) == pytest.approx(2 + 2)


def test_a_given_training_rate_replaces_the_measured_one_in_the_predicted_hours():
    group = points_on_line(0.5, 0.5)
    assert learning_curve.hours_for(3600, group, 0.5, training_seconds_per_answer=1.0) == pytest.approx(2 + 1)


def write_run(folder: Path, answers: int, acceptance: dict, tree_nodes=0, budget_extra=None) -> Path:
    """A drafter folder's training.json and the evaluate file that measured it."""
    drafter = folder / f"drafter-{answers}"
    drafter.mkdir(parents=True)
    budget = {"steps": answers // 2, "cpu_seconds": 3.0 * answers, "training_records": answers, **(budget_extra or {})}
    (drafter / "training.json").write_text(json.dumps({"budget": budget}))
    results = [{"benchmark": benchmark, "path": "greedy", "temperature": 0.0, "mean_acceptance_length": value}
               for benchmark, value in acceptance.items()]
    evaluation = folder / f"eval-{answers}.json"
    evaluation.write_text(json.dumps({"drafter": str(drafter), "tree_nodes": tree_nodes, "lookup_tokens": None,
                                      "results": results}))
    return evaluation


def run_script(*argv) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "scripts" / "learning_curve.py"), *map(str, argv)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_the_script_tables_each_measure_over_the_sizes_and_draws_the_curves(tmp_path):
    files = [write_run(tmp_path, n, {"humaneval": 1.0 + 0.5 * math.log10(n / 100), "mt_bench": 1.2}, tree_nodes=None)
             for n in (100, 1000)]
    result = run_script(*files, "--answers-per-second", "1", "--training-seconds-per-answer", "3", "--aim", "2",
                        "--plot", tmp_path / "curve.png")
    assert result.returncode == 0, result.stderr
    rows = result.stdout.splitlines()
    assert rows[0] == "| measure | 100 answers | 1000 answers | fit | answers for 2 | hours |"
    assert rows[2] == "| humaneval, tree + copied branch (greedy) | 1.00 | 1.50 | 0.00 + 0.50 log10(n) | 10,000 | 11 |"
    assert rows[3].startswith("| mt_bench, tree + copied branch (greedy) | 1.20 | 1.20 |")
    assert rows[3].endswith("| not reached (the curve does not rise) | - |")
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_a_drafter_record_without_its_answer_count_is_refused_in_one_line(tmp_path):
    old = write_run(tmp_path, 100, {"humaneval": 1.1})
    record = json.loads((tmp_path / "drafter-100" / "training.json").read_text())
    del record["budget"]["training_records"]
    (tmp_path / "drafter-100" / "training.json").write_text(json.dumps(record))
    result = run_script(old, "--answers-per-second", "1")
    assert result.returncode == 1 and "does not say how many answers it was trained on" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--answers-per-second", "0"], "--answers-per-second must be > 0"),
    (["--answers-per-second", "1", "--aim", "1"], "--aim > 1"),
    (["missing.json", "--answers-per-second", "1"], "no such evaluate file: missing.json"),
    (["--answers-per-second", "1", "--training-seconds-per-answer", "-1"], "--training-seconds-per-answer must be > 0"),
])
def test_bad_arguments_are_refused_before_any_file_is_read(tmp_path, argv, message):
    evaluation = write_run(tmp_path, 100, {"humaneval": 1.1})
    result = run_script(evaluation, *argv)
    assert result.returncode == 2 and message in result.stderr
