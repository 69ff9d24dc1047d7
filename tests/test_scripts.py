"""The scripts in scripts/ run from the command line as the documentation shows them (real model: marked slow)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import smollm2_tiny_target_folder
from dflash2_hf import DFlashDraftModel
from dflash2_hf.cpu.kernels import packed_linears_supported
from dflash2_hf.presets import default_drafter_folder
from dflash2_hf.training.data import read_responses

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_long_run_memory_script_records_the_peak_at_every_mark_and_writes_it(tmp_path):
    """docs/generation.md's `python scripts/long_run_memory.py --drafter ... --out ...` on 24 new tokens instead of
    4,096, marked every 8."""
    out = tmp_path / "long_run_memory.json"
    command = [sys.executable, str(ROOT / "scripts" / "long_run_memory.py"), "--drafter",
               str(default_drafter_folder("smollm2-135m")), "--new-tokens", "24", "--every", "8", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["new_tokens"] == 24
    assert [mark["new_tokens"] for mark in record["marks"]] == [8, 16, 24]
    assert all(mark["peak_rss_mib"] >= record["peak_rss_mib_before"] > 0 for mark in record["marks"])
    assert "| 24 |" in result.stdout and f"written to {out}" in result.stdout


def test_profile_script_refuses_a_bf16_option_in_float32_before_loading_a_model():
    """The profile script makes the CLI's checks, under its own name: --exact-attention without --dtype bfloat16."""
    command = [sys.executable, str(ROOT / "scripts" / "profile_cycle.py"), "--exact-attention"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 1
    assert ("profile_cycle.py: --exact-attention makes bf16 decoding exact (float32 is exact already); add --dtype "
            "bfloat16.") in result.stderr
    assert "Loading" not in result.stderr


@pytest.mark.slow
def test_profile_script_times_every_step_of_the_cycle_and_writes_them(tmp_path):
    """docs/results.md's `python scripts/profile_cycle.py [--dtype bfloat16 [--packed-linears] [--exact-attention]]
    --out ...` on 16 new tokens instead of 128 (in bf16, the dtype of the later profiles; packed and with the float64
    attention where this CPU runs bf16 matmuls through oneDNN)."""
    out = tmp_path / "profile.json"
    packed = ["--packed-linears", "--exact-attention"] if packed_linears_supported() else []
    command = [sys.executable, str(ROOT / "scripts" / "profile_cycle.py"), "--max-new-tokens", "16", "--threads", "1",
               "--dtype", "bfloat16", *packed, "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    steps = record["profiled_seconds_by_step"]
    assert {"draft", "select", "verify_forward", "verify_decide", "cache_crop", "emit", "context", "prefill"} <= set(steps)
    assert steps["verify_forward"] > 0 and steps["draft"] > 0, "the labelled steps were seen by the profiler"
    assert sum(steps.values()) == pytest.approx(record["seconds"], rel=0.05)
    assert record["cycles"] > 0 and record["new_tokens"] == 16
    assert "| verify_forward |" in result.stdout
    assert record["packed_linears"] is bool(packed) and record["exact_attention"] is bool(packed)


@pytest.mark.slow
def test_cpu_options_probe_times_each_option_against_eager_and_checks_the_tokens(tmp_path):
    """docs/results.md's `python scripts/cpu_options_probe.py --options ... --out ...` on 8 new tokens, one thread,
    and the options that need no compilation."""
    out = tmp_path / "cpu_options.json"
    command = [sys.executable, str(ROOT / "scripts" / "cpu_options_probe.py"), "--max-new-tokens", "8", "--threads",
               "1", "--dtype", "float32", "--options", "eager", "static", "quanto-int8", "ours", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["option"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["eager", "static", "quanto-int8", "ours"]
    assert rows["eager"]["ratio_to_eager"] == 1.0 and all(r["tokens_per_second"] > 0 for r in rows.values())
    assert rows["static"]["same_tokens_as_eager"] and rows["ours"]["same_tokens_as_eager"], "exact in fp32"
    assert "| quanto-int8 |" in result.stdout


@pytest.mark.slow
def test_linear_kernels_probe_times_each_kernel_per_row_count_and_checks_rows_are_independent(tmp_path):
    """docs/results.md's `python scripts/linear_kernels_probe.py --out ...` on 1 and 2 rows, one repeat, one thread;
    refused with a clear line on a CPU without oneDNN bf16 matmuls."""
    out = tmp_path / "linear_kernels.json"
    command = [sys.executable, str(ROOT / "scripts" / "linear_kernels_probe.py"), "--rows", "1", "2", "--repeats", "1",
               "--threads", "1", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if not packed_linears_supported():
        assert result.returncode == 2 and "no AVX512-BF16 or AMX" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["linear_layers"] == 30 * 7, "every linear layer of SmolLM2's 30 blocks, the LM head apart"
    assert set(record["ms_per_forward"]) == {"bf16", "int8", "int4"}
    assert all(set(times) == {"1", "2"} and min(times.values()) > 0 for times in record["ms_per_forward"].values())
    assert record["rows_independent"] == {"bf16": True, "int8": True, "int4": True}
    assert "| int4 |" in result.stdout


@pytest.mark.parametrize("argv, message", [
    (["--samples", "0"], "device_check.py: --samples must be >= 1, got 0."),
    (["--per-source", "-2"], "device_check.py: --per-source must be >= 1, got -2."),
    (["--device", "no_such_device"], "device_check.py: --device no_such_device: not usable here ("),
    (["--drafter", "no/such/folder"], "device_check.py: --drafter no/such/folder: no config.json there"),
])
def test_device_check_refuses_bad_input_in_one_line_before_loading_a_model(argv, message):
    command = [sys.executable, str(ROOT / "scripts" / "device_check.py"), *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 1 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Loading" not in result.stderr


@pytest.mark.slow
def test_device_check_passes_its_three_checks_on_the_cpu(tmp_path):
    """scripts/device_check.py as docs/generation.md shows it, on the CPU (CI has no GPU): 1 prompt per source,
    16 new tokens, 300 samples."""
    out = tmp_path / "device_check.json"
    command = [sys.executable, str(ROOT / "scripts" / "device_check.py"), "--device", "cpu", "--per-source", "1",
               "--max-new-tokens", "16", "--samples", "300", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["greedy_identity"]["identical"] == {"custom_generate": 2, "assistant_model": 2}
    assert report["exact_sampling"]["p_value"] > 1e-3 > 1e-6 > report["exact_sampling"]["biased_control_p_value"]
    assert report["speed"]["seconds"]["plain"] > 0 and report["speed"]["seconds"]["dflash2"] > 0


def test_train_on_device_recipe_makes_data_trains_and_exports_a_drafter_at_a_tiny_size(tmp_path):
    """`scripts/train_on_device.sh OUT` (sized for a GPU) run on the CPU with a tiny target and sizes set by its
    environment variables: the answers, the run and the exported drafter with its training record land under OUT."""
    target = smollm2_tiny_target_folder(tmp_path / "target", num_hidden_layers=6)
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Name {n} colours."},
                                                      {"role": "assistant", "content": "Red, green and blue."}]}) + "\n"
                            for n in range(9)))
    sizes = {"TARGET": target, "CHAT_FILE": str(chat), "PROMPTS": "4", "NEW_TOKENS": "8", "DATA_BATCH": "2",
             "STEPS": "2", "TRAIN_BATCH": "2", "BLOCKS": "2", "LAYERS": "1", "DRAFT_VOCAB": "64", "REPLIES": "3",
             "REPLY_STEPS": "1", "DFLASH2_HF": f"{sys.executable} -m dflash2_hf.cli"}
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(ROOT / "scripts" / "train_on_device.sh"), str(out)], capture_output=True,
                            text=True, timeout=600, cwd=ROOT, env=os.environ | sizes)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(read_responses(out / "data")) == 4 and len(read_responses(out / "replies")) == 3
    record = json.loads((out / "drafter" / "training.json").read_text())
    assert record["budget"]["steps"] == 2 and record["config"]["batch_size"] == 2
    assert record["started_from"]["budget"]["steps"] == 1, "the second stage continues the replies' drafter"
    drafter = DFlashDraftModel.from_pretrained(out / "drafter")
    assert drafter.config.num_hidden_layers == 1 and drafter.config.draft_vocab_size == 64
    assert f"the drafter is in {out / 'drafter'}" in result.stdout


def test_train_on_device_recipe_without_a_folder_says_how_to_call_it():
    result = subprocess.run(["bash", str(ROOT / "scripts" / "train_on_device.sh")], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr == "usage: scripts/train_on_device.sh OUT (a folder for the data, the run and the drafter)\n"


@pytest.mark.slow
@pytest.mark.parametrize("head", [[], ["--draft-vocab-size", "64"]], ids=["target's head", "draft vocabulary"])
def test_training_throughput_script_times_features_and_steps_on_the_real_target(tmp_path, head):
    """docs/training.md's `python scripts/training_throughput.py --data DIR ...` on two short answers, one step, with
    the target's head and with a draft vocabulary."""
    from dflash2_hf.presets import SMOLLM2_135M

    tokenizer = SMOLLM2_135M.load_tokenizer()
    ids = tokenizer("def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n" * 3).input_ids
    (tmp_path / "shard-0000000.jsonl").write_text("".join(
        json.dumps({"prompt": str(n), "prompt_ids": ids[:8], "response_ids": ids[8 + n:]}) + "\n" for n in range(2)))
    command = [sys.executable, str(ROOT / "scripts" / "training_throughput.py"), "--data", str(tmp_path), "--records",
               "2", "--steps", "1", "--batch-size", "1", "--blocks", "2", "--dtype", "float32", "--threads", "2", *head]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"target float32: features [\d.]+ sequences/s; [\d.]+ s/step, \d+ drafted positions/s",
                     result.stdout)
