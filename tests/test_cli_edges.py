"""The command line at its edges: text that is not UTF-8 (from argv or stdin), no prompt at all, prompts longer than
the target's context, and Ctrl-C, each a one-line message with the exit status of its kind, never a traceback."""

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import refusal, smollm2_tiny_target_folder, tiny_drafter
from dflash2_hf.presets import SMOLLM2_135M

LATIN_1 = os.fsdecode(b"caf\xe9 cr\xe8me")  # what Python makes of Latin-1 bytes in argv: surrogate escapes

# command -> (argv with {bad} where the Latin-1 text goes, the name the refusal gives it)
LATIN_1_ARGUMENTS = {
    "generate prompt": (["generate", "{bad}"], "PROMPT"),
    "generate --target": (["generate", "hi", "--target", "{bad}"], "--target"),
    "export OUT": (["export", "drafter", "{bad}"], "OUT"),
    "bench --out": (["bench", "--out", "{bad}"], "--out"),
    "bench --prompts": (["bench", "--prompts", "humaneval", "{bad}"], "--prompts"),
    "data --chat-file": (["data", "--out", "out", "--chat-file", "{bad}"], "--chat-file"),
    "train --data": (["train", "--data", "{bad}", "--out", "run"], "--data"),
    "info FOLDER": (["info", "{bad}"], "FOLDER"),
}


@pytest.mark.parametrize("argv, named", LATIN_1_ARGUMENTS.values(), ids=LATIN_1_ARGUMENTS.keys())
def test_an_argument_that_is_not_utf8_is_refused_naming_it(argv, named, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = refusal([LATIN_1 if word == "{bad}" else word for word in argv])
    assert f": {named} is not valid UTF-8 ('caf\\udce9 cr\\udce8me')" in message
    assert list(tmp_path.iterdir()) == [], "nothing written"


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    """A tiny target with SmolLM2's tokenizer and a context of 64 tokens."""
    return smollm2_tiny_target_folder(tmp_path_factory.mktemp("target"), max_position_embeddings=64)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> str:
    """A tiny drafter folder for :func:`target`."""
    folder = tmp_path_factory.mktemp("drafter")
    vocabulary = len(SMOLLM2_135M.load_tokenizer())
    tiny_drafter("dflash", vocab_size=vocabulary, mask_token_id=vocabulary - 1).save_pretrained(folder)
    return str(folder)


STDIN = {  # what standard input holds -> the refusal
    "closed": (None, "no prompt: pass it as an argument or on standard input."),
    "empty": (b"", "no prompt: standard input was empty"),
    "blank": (b"  \n", "no prompt: standard input was empty"),
    "Latin-1 bytes": (b"caf\xe9", "standard input is not UTF-8 text"),
}


@pytest.mark.parametrize("content, reason", STDIN.values(), ids=STDIN.keys())
def test_generate_without_a_usable_prompt_on_stdin_is_refused(content, reason, target, drafter, monkeypatch):
    monkeypatch.setattr(sys, "stdin", None if content is None else io.TextIOWrapper(io.BytesIO(content)))
    message = refusal(["generate", "--target", target, "--drafter", drafter, "--dtype", "float32"])
    assert reason in message


def test_generate_refuses_a_prompt_past_the_targets_context_before_decoding(target, drafter, monkeypatch):
    decoded = []
    monkeypatch.setattr(torch.nn.Module, "__call__", lambda *a, **k: decoded.append(a) or pytest.fail("decoded"))
    message = refusal(["generate", "word " * 80, "--target", target, "--drafter", drafter, "--dtype", "float32",
                       "--max-new-tokens", "8"])
    assert "the prompt has" in message and "would pass the target's context of 64 tokens" in message


@pytest.mark.parametrize("characters", [400, 275_000], ids=["just past", "a 275,000-character line"])
def test_bench_refuses_a_prompt_past_the_targets_context_before_decoding(target, drafter, tmp_path, monkeypatch,
                                                                        characters):
    prompts = tmp_path / "long.jsonl"
    prompts.write_text('{"prompt": "short"}\n' + '{"prompt": "' + "word " * (characters // 5) + '"}\n')
    monkeypatch.setattr(torch.nn.Module, "__call__", lambda *a, **k: pytest.fail("decoded"))
    message = refusal(["bench", "--target", target, "--drafter", drafter, "--prompts", str(prompts), "--per-source",
                       "2", "--dtype", "float32", "--out", str(tmp_path / "report"), "--max-new-tokens", "8"])
    assert "prompt 2 of long has" in message and "would pass the target's context of 64 tokens" in message
    assert not (tmp_path / "report").exists()


def test_ctrl_c_ends_a_command_with_one_line_and_status_130(target, tmp_path):
    """A real SIGINT to `dflash2-hf data` while it answers: one line on stderr, exit status 130, no traceback."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(f'{{"messages": [{{"role": "user", "content": "question {i}"}}]}}\n' for i in range(400)))
    command = [sys.executable, "-m", "dflash2_hf.cli", "data", "--target", target, "--chat-file", str(chat), "--out",
               str(tmp_path / "out"), "--limit", "400", "--batch-size", "1", "--max-new-tokens", "32"]
    # A shell's background job (`cmd &`, as CI may be started) inherits SIGINT ignored; a terminal's Ctrl-C is not.
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not list((tmp_path / "out").glob("shard-*")) and time.monotonic() < deadline:
        time.sleep(0.2)  # answering has begun once the first shard is written
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("dflash2-hf data: interrupted")
