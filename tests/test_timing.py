"""Timings that size trees and choose plain steps wait for the device's queued work before reading the clock."""

import pytest
import torch

from dflash2_hf.cost import timing


@pytest.mark.parametrize(("device", "module"), [("cuda:0", torch.cuda), ("xpu", torch.xpu), ("mps", torch.mps)])
def test_an_asynchronous_device_is_synchronised_before_the_clock_is_read(monkeypatch, device, module):
    calls = []
    monkeypatch.setattr(module, "synchronize", lambda *args: calls.append(args))
    before = timing.device_seconds("cpu")
    assert timing.device_seconds(device) >= before
    assert len(calls) == 1


def test_the_cpu_reads_the_clock_without_synchronising(monkeypatch):
    for module in (torch.cuda, torch.xpu, torch.mps):
        monkeypatch.setattr(module, "synchronize", lambda *args: pytest.fail("synchronised on the CPU"))
    assert timing.device_seconds(torch.device("cpu")) > 0
