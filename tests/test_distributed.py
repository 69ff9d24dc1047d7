"""`accelerate launch` with 2 CPU processes (DDP over gloo) trains like 1 process on the same global batches.

Each step's global batch is split across processes and DDP averages the per-process gradients; the per-process
losses are normalised by their own token weights, so the two runs agree closely but not bit for bit.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "distributed_train.py"


def launch(processes: int, out: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", str(processes),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(SCRIPT), str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
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
        torch.testing.assert_close(double[name], single[name], atol=2e-4, rtol=1e-3)
