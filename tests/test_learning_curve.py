"""scripts/learning_curve.py: acceptance against training answers, fitted on log10(answers) two ways, and what each
predicts."""

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
    assert rows[0] == ("| measure | 100 answers | 1000 answers | log-linear fit | answers for 2 | hours | logistic fit "
                       "| answers for 2 | hours |")
    assert rows[2].startswith("| humaneval, tree + copied branch (greedy) | 1.00 | 1.50 | acceptance = 0.00 + 0.50 "
                              "log10(n) | 10,000 | 11 | not fitted: an acceptance of 1.00 has no per-position rate |")
    assert rows[3].startswith("| mt_bench, tree + copied branch (greedy) | 1.20 | 1.20 |")
    assert rows[3].endswith("| not reached (the curve does not rise) | - |")
    assert "at the largest" not in result.stdout, "two sizes leave none to check a fit against"
    assert (tmp_path / "curve.png").stat().st_size > 1000


@pytest.mark.parametrize("rate", [0.05, 0.5, 0.9])
def test_the_logistic_link_maps_acceptance_to_a_per_position_rate_and_back(rate):
    acceptance = learning_curve.acceptance_for(rate, 16)
    assert acceptance == pytest.approx((1 - rate**16) / (1 - rate))
    assert learning_curve.rate_for(acceptance, 16) == pytest.approx(rate)


@pytest.mark.parametrize("acceptance", [1.0, 0.9, 16.0, 20.0])
def test_an_acceptance_no_rate_gives_is_refused_by_the_logistic_link(acceptance):
    with pytest.raises(learning_curve.NoRate, match="has no per-position rate"):
        learning_curve.rate_for(acceptance, 16)


def test_the_logistic_fit_recovers_an_s_curve_and_the_answers_where_it_reaches_the_aim():
    link = learning_curve.logistic(16)
    def on_curve(n):  # logit(rate) = -4 + 1 * log10(n)
        return learning_curve.acceptance_for(1 / (1 + math.exp(4 - math.log10(n))), 16)
    line = learning_curve.fit([Point("code", n, 1.0, on_curve(n)) for n in (100, 1000, 10000)], link)
    assert (line.intercept, line.slope) == pytest.approx((-4.0, 1.0))
    aim = on_curve(1e6)
    assert line.answers_for(aim) == pytest.approx(1e6, rel=1e-6)


def test_with_three_sizes_each_fit_on_the_smaller_ones_is_checked_at_the_largest(tmp_path):
    files = [write_run(tmp_path, n, {"humaneval": 1.0 + 0.5 * math.log10(n / 10)}) for n in (100, 1000, 10000)]
    result = run_script(*files, "--answers-per-second", "1", "--aim", "3")
    assert result.returncode == 0, result.stderr
    check = result.stdout.split("at the largest:")[1]
    row = next(line for line in check.splitlines() if line.startswith("| humaneval"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1:4] == ["10000", "2.50", "2.50"], "a log-linear truth: the log-linear fit foretells it exactly"
    assert float(cells[4]) != pytest.approx(2.5, abs=0.005), "the logistic fit bends, so it misses"


def test_a_drafter_record_without_its_answer_count_is_refused_in_one_line(tmp_path):
    old = write_run(tmp_path, 100, {"humaneval": 1.1})
    record = json.loads((tmp_path / "drafter-100" / "training.json").read_text())
    del record["budget"]["training_records"]
    (tmp_path / "drafter-100" / "training.json").write_text(json.dumps(record))
    result = run_script(old, "--answers-per-second", "1")
    assert result.returncode == 2 and "does not say how many answers it was trained on" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--answers-per-second", "0"], "--answers-per-second must be > 0"),
    (["--answers-per-second", "1", "--aim", "1"], "--aim > 1"),
    (["missing.json", "--answers-per-second", "1"], "no such evaluate file: missing.json"),
    (["--answers-per-second", "1", "--training-seconds-per-answer", "-1"], "--training-seconds-per-answer must be > 0"),
    (["--answers-per-second", "1", "--block-size", "1"], "--block-size must be >= 2 and above --aim"),
    (["--answers-per-second", "1", "--block-size", "3"], "--block-size must be >= 2 and above --aim"),
])
def test_bad_arguments_are_refused_before_any_file_is_read(tmp_path, argv, message):
    evaluation = write_run(tmp_path, 100, {"humaneval": 1.1})
    result = run_script(evaluation, *argv)
    assert result.returncode == 2 and message in result.stderr


@pytest.mark.parametrize(("value", "shown"), [(15742.4, "15,742"), (9_999_999, "9,999,999"), (2.9e16, "2.9e+16")])
def test_forecasts_past_ten_million_are_shown_as_powers_of_ten(value, shown):
    assert learning_curve._count(value) == shown


BAD_FILES = {  # what the evaluate file holds -> the refusal
    "an empty file": (b"", "is not a `dflash2-hf evaluate --out` file (JSONDecodeError"),
    "a binary file": (bytes(range(256)), "is not a `dflash2-hf evaluate --out` file (UnicodeDecodeError"),
    "JSON of another shape": (b"[1, 2]", "is not a `dflash2-hf evaluate --out` file (a JSON object)"),
    "an object without its drafter": (b'{"results": []}', "is not a `dflash2-hf evaluate --out` file (no field 'drafter')"),
}


@pytest.mark.parametrize("content, message", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_a_file_that_is_not_an_evaluate_file_is_refused_in_one_line(tmp_path, content, message):
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    result = run_script(bad, "--answers-per-second", "1")
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("plot", ["missing-folder/curve.png", "."], ids=["in a missing folder", "a folder"])
def test_a_plot_that_cannot_be_written_is_refused_before_any_file_is_read(tmp_path, plot):
    evaluation = write_run(tmp_path, 100, {"humaneval": 1.1})
    result = run_script(evaluation, "--answers-per-second", "1", "--plot", tmp_path / plot)
    assert result.returncode == 2 and "cannot be written" in result.stderr and "Traceback" not in result.stderr
