"""bf16 linear layers on the CPU with their weights packed once for oneDNN, instead of at every call.

On the CPU, a bf16 ``nn.Linear`` runs oneDNN's matmul, which first reorders the weight into the blocked layout its
kernels read: at every call, for every layer, at every decoding step. :class:`PackedLinears` reorders each weight
once and calls the same oneDNN matmul on the packed copy. On CPUs whose bf16 matmuls go through oneDNN (those with
AVX512-BF16 or AMX) the results are the ones the plain layers give, bit for bit (``tests/test_cpu_kernels.py`` checks
it layer by layer and on whole decodings), so decoding with it is exact relative to the same target; it only skips
the repeated reorder. What it costs: a packed copy of every linear weight next to the weight itself (the weights stay
what ``state_dict``, saving and PEFT see).

Inference only: the packed copies are taken when the layers are packed, so weights trained afterwards are not seen
until :meth:`PackedLinears.enable` runs again (it repacks every weight that changed since).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn


def packed_linears_supported() -> bool:
    """Whether this CPU runs bf16 matmuls through oneDNN (AVX512-BF16 or AMX), where packing changes no result."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _packed_linear(packed: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(hidden, packed, bias, "none", [], "")


class PackedLinears:
    """Every ``nn.Linear`` of the given models, switched between its own forward and a prepacked oneDNN one.

    ```python
    with PackedLinears(target, drafter):
        out = target.generate(**inputs, assistant_model=drafter)
    ```

    or :meth:`enable` / :meth:`disable` for a long-lived process. Refuses, before packing anything, a CPU without
    oneDNN bf16 matmuls and any linear layer whose weight is not bf16 on the CPU.
    """

    def __init__(self, *models: nn.Module):
        if not packed_linears_supported():
            raise ValueError("packed linears need a CPU whose bf16 matmuls run through oneDNN (AVX512-BF16 or AMX); "
                             "this one has neither, so packing would change the results: leave the option off.")
        self.layers = [module for model in models for module in model.modules() if isinstance(module, nn.Linear)]
        for module in self.layers:
            weight = module.weight
            if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
                name = next(name for model in models for name, m in model.named_modules() if m is module)
                raise ValueError(f"packed linears are for bfloat16 weights on the CPU; {name} holds {weight.dtype} "
                                 f"on {weight.device.type} (load the models with dtype=torch.bfloat16).")
        self._packed: dict[nn.Linear, tuple[int, torch.Tensor]] = {}

    def _pack(self, module: nn.Linear) -> torch.Tensor:
        version = module.weight._version
        cached = self._packed.get(module)
        if cached is None or cached[0] != version:
            cached = (version, torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None))
            self._packed[module] = cached
        return cached[1]

    def enable(self) -> PackedLinears:
        """Run every layer on its packed weight (packing those not packed yet or changed since)."""
        for module in self.layers:
            module.forward = partial(_packed_linear, self._pack(module), module.bias)
        return self

    def disable(self) -> None:
        """Give every layer its own forward back (the packed copies are kept for the next :meth:`enable`)."""
        for module in self.layers:
            vars(module).pop("forward", None)

    def __enter__(self) -> PackedLinears:
        return self.enable()

    def __exit__(self, *exc_info) -> None:
        self.disable()
