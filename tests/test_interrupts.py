"""Resuming after a real kill: training and data generation run in a subprocess (``interruptible.py``) that is
SIGKILLed at a seeded random moment in the middle of the run, then restarted.

What the killed run leaves behind must be usable (every checkpoint loads, every shard is complete), the restart
must pick up where the last saved work ends (losing at most the work since it), and the end result must equal an
unbroken run's exactly (run in this process, one thread like the subprocess).

A random kill lands inside a file write only now and then, so the last tests also stop writes at exact points (an
exception raised from inside the write stands for the kill).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from safetensors.torch import save_file as safetensors_save

import interruptible
from conftest import one_torch_thread
from dflash2_hf.training.checkpoint import PREFIX, latest_checkpoint, load_checkpoint, save_checkpoint
from dflash2_hf.training.data import read_responses, shard_files, shard_text
from dflash2_hf.training import checkpoint
from dflash2_hf.training.trainer import DrafterTrainer

SCRIPT = Path(interruptible.__file__)


@dataclass
class Interrupted:
    """A run that was killed and restarted; "units" are training steps or data batches."""

    folder: Path  # where the run writes
    left_behind: Path  # a copy of what the killed run left, taken before the restart
    killed_in: int  # the last unit the killed run had started
    restarted_at: int  # the first unit the restarted run started


def started_units(output: str) -> list[int]:
    return [int(line.split()[1]) for line in output.splitlines() if line.startswith("started ")]


def kill_and_restart(kind: str, folder: Path, kill_in: int, seed: int) -> Interrupted:
    """Run ``interruptible.py kind folder``; once it starts unit ``kill_in``, wait a random 0 to 2 unit durations and
    SIGKILL it; copy what it left; run it again to the end."""
    command = [sys.executable, str(SCRIPT), kind, str(folder)]
    log = folder.parent / f"{kind}-killed.log"
    with log.open("w") as errors:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, bufsize=1)
        started_at = {}
        for line in process.stdout:
            started_at |= {unit: time.monotonic() for unit in started_units(line)}
            if kill_in in started_at:
                break
        assert kill_in in started_at, log.read_text()[-3000:]
        unit_duration = started_at[kill_in] - started_at[kill_in - 1]
        time.sleep(random.Random(seed).uniform(0, 2) * unit_duration)
        process.send_signal(signal.SIGKILL)
        remaining = process.stdout.read()
        process.wait()
    assert process.returncode == -signal.SIGKILL, "the run must still be going when it is killed"
    left_behind = shutil.copytree(folder, folder.parent / f"{folder.name}-left-behind")
    restart = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert restart.returncode == 0, restart.stderr[-3000:]
    return Interrupted(folder, left_behind, max([kill_in, *started_units(remaining)]), started_units(restart.stdout)[0])


@pytest.fixture(scope="module")
def training(tmp_path_factory) -> Interrupted:
    return kill_and_restart("train", tmp_path_factory.mktemp("training"), kill_in=7, seed=0)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Interrupted:
    return kill_and_restart("data", tmp_path_factory.mktemp("data"), kill_in=5, seed=2)


def checkpoint_steps(folder: Path) -> list[int]:
    return sorted(int(path.name.removeprefix(PREFIX)) for path in folder.glob(f"{PREFIX}*"))


def every_checkpoint_loads(folder: Path, trainer: DrafterTrainer) -> list[int]:
    """Load every checkpoint under ``folder``; returns their steps."""
    return [load_checkpoint(path, trainer.unwrapped, trainer.optimizer, trainer.scheduler)["step"]
            for path in sorted(folder.glob(f"{PREFIX}*"))]


def test_a_killed_training_run_leaves_only_checkpoints_that_load(training: Interrupted, tmp_path, one_thread):
    probe = interruptible.trainer(tmp_path)
    folder = training.left_behind / "run"
    assert every_checkpoint_loads(folder, probe) == checkpoint_steps(folder) != []


def test_a_restarted_training_run_resumes_from_the_newest_checkpoint(training: Interrupted):
    """It loses at most the steps since that checkpoint: fewer than ``checkpoint_every``, the killed step included."""
    newest = checkpoint_steps(training.left_behind / "run")[-1]
    assert training.restarted_at == newest
    assert training.killed_in + 1 - interruptible.CHECKPOINT_EVERY <= newest <= training.killed_in + 1


def test_a_restarted_training_run_ends_with_the_weights_of_an_unbroken_run(training: Interrupted, tmp_path, one_thread):
    unbroken = interruptible.trainer(tmp_path)
    unbroken.train()
    resumed = load_file(training.folder / "final.safetensors")
    expected = unbroken.unwrapped.state_dict()
    assert resumed.keys() == expected.keys()
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)


@pytest.fixture(scope="module")
def unbroken_records(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("unbroken-data")
    with one_torch_thread():
        interruptible.response_generator(folder).run(interruptible.prompts())
    return read_responses(folder)


def test_a_killed_data_run_leaves_only_complete_shards_of_what_an_unbroken_run_writes(data: Interrupted,
                                                                                      unbroken_records: list[dict]):
    shards = shard_files(data.left_behind)
    assert shards
    for shard in shards:
        lines = shard_text(shard).splitlines()
        assert len(lines) == interruptible.BATCH_SIZE and all(json.loads(line) for line in lines), shard.name
    left = read_responses(data.left_behind)
    assert left == unbroken_records[: len(left)]


def test_a_restarted_data_run_redoes_at_most_the_batch_it_was_killed_in(data: Interrupted):
    done = len(shard_files(data.left_behind))
    assert data.restarted_at == done
    assert data.restarted_at >= data.killed_in


def test_a_restarted_data_run_writes_the_records_of_an_unbroken_run(data: Interrupted, unbroken_records: list[dict]):
    assert read_responses(data.folder) == unbroken_records
    assert len(unbroken_records) == interruptible.PROMPTS


class Stopped(Exception):
    """Stands for a kill at an exact point inside a write."""


def test_a_stop_while_a_checkpoint_is_written_leaves_the_previous_ones_untouched(tmp_path, monkeypatch):
    run = interruptible.trainer(tmp_path / "probe")
    save = partial(save_checkpoint, tmp_path, model_state=run.unwrapped.state_dict(), optimizer=run.optimizer,
                   scheduler=run.scheduler)
    save(step=1)

    def stop_after_the_weights(tensors, path):
        safetensors_save(tensors, path)
        if path.name == "model.safetensors":
            raise Stopped

    monkeypatch.setattr(checkpoint, "save_file", stop_after_the_weights)
    with pytest.raises(Stopped):
        save(step=2)
    assert every_checkpoint_loads(tmp_path, run) == [1]
    assert latest_checkpoint(tmp_path).name == f"{PREFIX}000001"


def test_a_stop_while_an_old_checkpoint_is_deleted_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    run = interruptible.trainer(tmp_path / "probe")
    save = partial(save_checkpoint, tmp_path, model_state=run.unwrapped.state_dict(), optimizer=run.optimizer,
                   scheduler=run.scheduler, keep=1)
    save(step=1)

    def stop_after_one_file(path, ignore_errors=False):
        files = sorted(Path(path).glob("*")) if Path(path).exists() else []
        if files:
            files[0].unlink()
            raise Stopped

    monkeypatch.setattr(checkpoint.shutil, "rmtree", stop_after_one_file)
    with pytest.raises(Stopped):
        save(step=2)  # step 1 is deleted once step 2 is in place
    assert every_checkpoint_loads(tmp_path, run) == [2]


def test_a_stop_while_a_shard_is_written_leaves_only_the_shards_before_it(tmp_path, monkeypatch, unbroken_records):
    replace = os.replace

    def stop_before_the_second_shard(source, destination):
        if Path(destination).name == f"shard-{interruptible.BATCH_SIZE:07d}.jsonl.gz":
            raise Stopped
        replace(source, destination)

    monkeypatch.setattr(os, "replace", stop_before_the_second_shard)
    with pytest.raises(Stopped), one_torch_thread():
        interruptible.response_generator(tmp_path).run(interruptible.prompts())
    assert read_responses(tmp_path) == unbroken_records[: interruptible.BATCH_SIZE]
