"""Wall-clock readings that mean the same on every device.

CUDA, XPU and MPS run kernels asynchronously: ``time.perf_counter()`` right after a forward reads when the work was
queued, not when it finished. Every timing that sizes trees or decides between drafting and plain steps reads
:func:`device_seconds`, which first waits for the device's queued work (a no-op on the CPU).
"""

from __future__ import annotations

import time

import torch


def device_seconds(device: torch.device | str) -> float:
    """``time.perf_counter()`` once every kernel queued on ``device`` has finished."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "xpu":
        torch.xpu.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()
    return time.perf_counter()
