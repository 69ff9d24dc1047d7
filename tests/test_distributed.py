"""`accelerate launch` with 2 CPU processes (DDP over gloo) trains like 1 process on the same global batches.

Each process takes its rows of the same global batch and normalises its loss by the global batch's weight per
process, so DDP's gradient average equals the 1-process gradient up to float summation order.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "distributed_train.py"


def launch(processes: int, out: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    # `--multi_gpu` selects accelerate's torchrun launcher; with no GPU the trainer's Accelerator(cpu=True) joins a
    # gloo process group (accelerate's MULTI_CPU mode). `--cpu` alone would start a single process.
    launcher = ["--multi_gpu"] if processes > 1 else ["--cpu"]
    command = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "--num_processes", str(processes),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--num_cpu_threads_per_process", "1", str(SCRIPT), str(out)]
    # One thread per process in both runs: the same kernels, so only the all-reduce changes the sums' order.
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"processes={processes}" in result.stdout
    return load_file(out / "initial.safetensors"), load_file(out / "drafter.safetensors")


def test_two_processes_match_one_process(tmp_path):
    initial, single = launch(1, tmp_path / "one")
    _, double = launch(2, tmp_path / "two")
    assert single.keys() == double.keys() == initial.keys()
    updates = {k: (single[k] - initial[k]).abs().max().item() for k in single}
    assert max(updates.values()) > 1e-3, "training must move the weights"
    for name in single:
        torch.testing.assert_close(double[name], single[name], atol=1e-5, rtol=1e-4)
    deviation = sum((double[k] - single[k]).abs().sum() for k in single)
    update = sum((single[k] - initial[k]).abs().sum() for k in single)
    assert deviation < 0.01 * update, "the 2-process run must take the same steps as the 1-process run"
