"""Linear layers on the CPU with their weights packed once for the matmul library, instead of at every call.

On the CPU, a bf16 ``nn.Linear`` runs oneDNN's matmul and a float32 one MKL's sgemm; both first reorder the weight
into the blocked layout their kernels read: at every call, for every layer, at every decoding step. For one row that
reorder is cheap next to reading the weight; for the 8-32 rows a verification forward holds it is most of the
layer's time. :class:`PackedLinears` reorders each weight once for oneDNN and runs oneDNN's matmul on the packed
copy:

* **bf16** (oneDNN): on CPUs whose bf16 matmuls go through oneDNN, one-row inputs (plain decoding's steps) get the
  plain layers' results bit for bit. Many-row blocks do too where a block's rows round as each row alone, for the
  plain and the packed kernel (:func:`bf16_rows_independent` measures both), which is where bf16 is the exact
  default. Where they do not (seen on AMD EPYC Zen 4 CPUs with AVX512-BF16), a plain block already rounds a few
  values differently from single rows, and a packed block may round others differently again.
* **float32** (oneDNN's float32 matmul, full float32 arithmetic): one-row inputs (plain decoding's steps) keep the
  layer's own forward, bit for bit; wider inputs agree with it within float32 rounding (the layer's own sgemm
  already rounds differently at each width). Greedy output stays token-identical to plain decoding in float32
  (tested on tiny and real models). For the 2-16 rows of a verification forward oneDNN's kernels run faster than
  MKL's packed sgemm, which this class used before (``docs/results.md``, "oneDNN for packed float32 linears").

What it costs: a packed copy of every linear weight next to the weight itself (the weights stay what ``state_dict``,
saving and PEFT see).

Inference only: the packed copies are taken when the layers are packed, so weights trained afterwards are not seen
until :meth:`PackedLinears.enable` runs again (it repacks every weight that changed since).
"""

from __future__ import annotations

import copy
import hashlib
import os
import platform
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path

import torch
from torch import nn

PACKED_DTYPES = (torch.bfloat16, torch.float32)


def packed_linears_supported(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether linears of this dtype can be packed here: bf16 needs a CPU with bf16 matmul instructions (AVX512-BF16
    or AMX) whose bf16 matmuls oneDNN runs (there packing changes no one-row result; oneDNN's emulation on other
    AVX-512 CPUs does not promise it), float32 PyTorch's oneDNN."""
    if dtype == torch.float32:
        return torch.backends.mkldnn.is_available()
    return (native_bf16_matmuls() and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """The CPU's model name and feature flags from ``/proc/cpuinfo`` (Linux); elsewhere the platform's processor
    name and no flags."""
    cpuinfo = Path("/proc/cpuinfo")
    if platform.system() != "Linux" or not cpuinfo.exists():
        return platform.processor() or platform.machine(), frozenset()
    fields = dict(line.split(":", 1) for line in cpuinfo.read_text().splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    return fields.get("model name", platform.machine()), frozenset(fields.get("flags", "").split())


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as ``/proc/cpuinfo`` names them (``avx2``, ``avx512f``, ...); empty off Linux."""
    return _cpuinfo()[1]


def native_bf16_matmuls() -> bool:
    """Whether this CPU computes bf16 matmuls in hardware (AVX512-BF16 or AMX) and oneDNN may use them. Elsewhere
    oneDNN or PyTorch emulate them with float32 arithmetic plus conversions, and a bf16 model verifies many rows no
    faster (often slower) than a float32 one. ``False`` where the CPU's flags cannot be read, and where
    ``ONEDNN_MAX_CPU_ISA`` holds oneDNN below its bf16 kernels (e.g. ``AVX2``)."""
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if limit and limit not in ("ALL", "DEFAULT") and not any(isa in limit for isa in ("BF16", "AMX", "AVX10")):
        return False
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


#: The probe of :func:`bf16_rows_independent`: reduction lengths (a layer's input width) and block heights. oneDNN
#: picks its blocking by the matrix sizes; seen on an AMD EPYC (Zen 4, AVX512-BF16 without AMX): widths of 1536 and
#: more give a few values of 3-row and taller blocks a different bf16 rounding than the same rows alone.
ROW_PROBE_WIDTHS = (576, 1536, 2048, 4096)
ROW_PROBE_HEIGHTS = (2, 3, 8, 17, 32)


def bf16_rows_independent() -> bool:
    """Whether this CPU's bf16 matmuls give every row of a many-row input, bit for bit, the result the row gets
    alone, which exact bf16 decoding with a drafter needs (a verification forward holds many tokens, plain decoding
    one). Measured once per thread count on random layers of several widths (1,024 outputs each; about 0.2 s),
    with the linears' own forward and, where bf16 linears can be packed, with packed ones, which must also give the
    own forward's results."""
    return _bf16_rows_independent(torch.get_num_threads())


def rows_match_alone(kernel: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor) -> bool:
    """Whether ``kernel`` gives each row, bit for bit, the same result in one call over all ``rows`` as in a call
    of its own."""
    together = kernel(rows)
    return all(torch.equal(together[i : i + 1], kernel(rows[i : i + 1])) for i in range(rows.shape[0]))


def _bf16_kernels(weight: torch.Tensor) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """The bf16 kernels decoding may run a linear of this weight on: its own forward and, where bf16 linears can be
    packed, the packed one."""
    kernels = [partial(nn.functional.linear, weight=weight)]
    if packed_linears_supported(torch.bfloat16):
        kernels.append(partial(_onednn_linear, _onednn_pack(weight), None))
    return kernels


@cache
def _bf16_rows_independent(threads: int) -> bool:
    generator = torch.Generator().manual_seed(0)
    for width in ROW_PROBE_WIDTHS:
        weight = torch.randn(1024, width, generator=generator).to(torch.bfloat16)
        rows = torch.randn(max(ROW_PROBE_HEIGHTS), width, generator=generator).to(torch.bfloat16)
        own, *packed = kernels = _bf16_kernels(weight)
        if not all(rows_match_alone(kernel, rows[:height]) for kernel in kernels for height in ROW_PROBE_HEIGHTS):
            return False
        if not all(torch.equal(kernel(rows), own(rows)) for kernel in packed):
            return False
    return True


def exact_bf16_supported() -> bool:
    """Whether bf16 decoding with the float64 attention gives plain bf16 decoding's tokens on this CPU: bf16 matmul
    instructions that oneDNN runs (packable linears) and a block's rows rounded as they would be alone."""
    return native_bf16_matmuls() and packed_linears_supported(torch.bfloat16) and bf16_rows_independent()


#: Environment variables that hold PyTorch's, MKL's and oneDNN's kernels below what the CPU has (e.g. ``avx2`` on an
#: AVX-512 CPU, to measure what an AVX2-only CPU would do).
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def cpu_description() -> str:
    """The CPU's model name and the flags that decide these kernels' speed (named next to every speed figure), and
    any instruction-set limit set in the environment."""
    name, flags = _cpuinfo()
    shown = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flag in flags]
    limits = [f"{variable}={os.environ[variable]}" for variable in ISA_LIMITS if os.environ.get(variable)]
    limited = f"; kernels limited by {' '.join(limits)}" if limits else ""
    return f"{name} ({', '.join(shown) if shown else 'no AVX2'}; {torch.get_num_threads()} threads{limited})"


@dataclass(frozen=True)
class ExactSetting:
    """A dtype and kernel choice whose greedy output is token-identical to plain decoding with the same choice, and
    why it is the fastest such choice on this CPU."""

    dtype: str
    packed_linears: bool
    exact_attention: bool
    reason: str

    def describe(self) -> str:
        parts = [self.dtype] + ["packed linears"] * self.packed_linears + ["float64 attention"] * self.exact_attention
        return f"{', '.join(parts)}: {self.reason}"


def fastest_exact_setting() -> ExactSetting:
    """The fastest exact setting for this CPU. With bf16 matmul instructions (AVX512-BF16 or AMX) that round a
    block's rows as they would round them alone, bf16 on packed oneDNN linears with the float64 attention (a block
    costs about one token to verify, and the attention makes it exact). Otherwise float32, which is exact as it is:
    bf16 would be emulated and slower, or its blocks would round differently from one-token steps. float32 linears
    run on oneDNN-packed weights where PyTorch has oneDNN. ``docs/results.md`` has the measurements behind the
    choices."""
    if exact_bf16_supported():
        return ExactSetting("bfloat16", True, True, "this CPU multiplies bf16 in hardware (AVX512-BF16/AMX), where "
                            "a bf16 block costs about one token to verify; the float64 attention keeps it exact")
    if native_bf16_matmuls() and packed_linears_supported(torch.bfloat16):
        why = ("this CPU's bf16 matmuls round some values of a many-token block differently from the same token "
               "alone, so bf16 decoding with a drafter would not give plain decoding's tokens; float32 is exact")
    else:
        why = ("this CPU has no bf16 matmul instructions (AVX512-BF16/AMX), so bf16 would be emulated and slower; "
               "float32 is exact")
    packed = packed_linears_supported(torch.float32)
    return ExactSetting("float32", packed, False,
                        why + (", and packed weights make verifying many tokens cheaper" if packed else ""))


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _onednn_linear(packed: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(hidden, packed, bias, "none", [], "")


def _onednn_bf16_linear(layer: nn.Linear, packed: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """A bf16 linear on oneDNN's packed weight; an input of another dtype (autocast at work, e.g. a model prepared by
    accelerate for mixed precision) goes through the layer's own forward."""
    if hidden.dtype != torch.bfloat16:
        return nn.functional.linear(hidden, layer.weight, layer.bias)
    return _onednn_linear(packed, layer.bias, hidden)


def _onednn_float32_linear(layer: nn.Linear, packed: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """A float32 linear on oneDNN's packed weight; one row goes through the layer's own forward (bit for bit), and
    so does an input of another dtype (autocast at work)."""
    if hidden.numel() <= hidden.shape[-1] or hidden.dtype != torch.float32:
        return nn.functional.linear(hidden, layer.weight, layer.bias)
    return _onednn_linear(packed, layer.bias, hidden)


def linears_packed(model: nn.Module) -> bool:
    """Whether the model's linear layers run on packed weights now (a :class:`PackedLinears` is enabled on it)."""
    return any(getattr(vars(module).get("forward"), "func", None) in (_onednn_bf16_linear, _onednn_float32_linear)
               for module in model.modules() if isinstance(module, nn.Linear))


def weight_fingerprint(weight: torch.Tensor) -> tuple:
    """What a copy made from ``weight`` depends on: its dtype, shape and a hash of every value (an XOR of each value's
    bits). Read from the values themselves, so any change is seen however it was made: ``.data`` writes and PEFT's
    merge (which leave the version counter alone), in-place ops, ``load_state_dict``, ``to()``, a swapped
    ``nn.Parameter``."""
    return weight.dtype, tuple(weight.shape), _values_hash(weight.detach())


def _values_hash(weight: torch.Tensor) -> int:
    """A hash of every value of ``weight``: torch's XOR reduction where this torch has it (2.8 on), else BLAKE2 over
    the tensor's bytes (read in place, no copy)."""
    if hasattr(torch, "hash_tensor"):
        return int(torch.hash_tensor(weight).view(torch.int64))
    raw = weight.contiguous().cpu().view(torch.uint8).numpy()
    return int.from_bytes(hashlib.blake2b(memoryview(raw), digest_size=8).digest(), "little")


#: Every packed weight, by its layer: made once and reused by later :class:`PackedLinears` (and ``generate`` calls),
#: remade when the weight's values change (:func:`weight_fingerprint`), dropped with the layer (a weak key; the value
#: holds no reference to the layer), so a long-lived process holds one packed copy per layer however many calls it
#: makes.
PACKED_WEIGHTS: weakref.WeakKeyDictionary[nn.Linear, tuple[tuple, torch.Tensor]] = weakref.WeakKeyDictionary()


def _packing_applies(target: nn.Module, wanted: bool) -> bool:
    """Whether a ``generate`` call packs the target's linears: asked for, on the CPU in a packable dtype this CPU
    packs exactly (bf16 only where a block's rows round as single rows), and not packed already."""
    dtype = target.dtype
    return (wanted and target.device.type == "cpu" and dtype in PACKED_DTYPES and packed_linears_supported(dtype)
            and not (dtype == torch.bfloat16 and not bf16_rows_independent()) and not linears_packed(target))


def packed_for_the_call(target: nn.Module, drafter: nn.Module, wanted: bool) -> AbstractContextManager:
    """What a ``generate`` call with a drafter runs under: every linear of both models on packed oneDNN weights
    (:class:`PackedLinears`) where that is the faster exact setting (``wanted``, both models on the CPU in float32,
    or in bf16 where packing changes no result, not packed already), else nothing. The layers get their own forward
    back when the call ends, so the models compute outside it as they did."""
    if not _packing_applies(target, wanted) or linears_packed(drafter) or drafter.dtype != target.dtype:
        return nullcontext()
    try:
        return PackedLinears(target, drafter)
    except ValueError:  # a layer of another dtype or device: the models run as they are
        return nullcontext()


#: The drafter copies :func:`drafter_for_the_call` made, by the user's drafter: (what the copy was made from, the
#: copy); remade when the drafter's weights change, dropped with the drafter (a weak key).
DRAFTER_COPIES: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, nn.Module]] = weakref.WeakKeyDictionary()


def drafter_for_the_call(target: nn.Module, drafter: nn.Module, wanted: bool) -> nn.Module:
    """The drafter a ``generate`` call drafts with: the user's own, or, where only its dtype keeps the two models off
    packed weights (a drafter saved in bf16, as ``from_pretrained`` loads it, next to a float32 target), a copy in
    the target's dtype. The copy is made once and reused by later calls while the drafter's weights hold the same
    values, so the user's drafter computes outside the call as it did and a long-lived process holds one copy.
    Drafting in another dtype changes what is proposed, never what is emitted (verification is exact for any
    proposal)."""
    if drafter.dtype == target.dtype or hasattr(drafter, "peft_config") or not _packing_applies(target, wanted):
        return drafter
    made_from = (target.dtype, tuple(weight_fingerprint(weight) for weight in drafter.parameters()))
    cached = DRAFTER_COPIES.get(drafter)
    if cached is None or cached[0] != made_from:
        cached = (made_from, copy.deepcopy(drafter).to(target.dtype))
        DRAFTER_COPIES[drafter] = cached
    return cached[1]


class PackedLinears:
    """Every ``nn.Linear`` of the given models, switched between its own forward and one on a weight packed once
    (oneDNN's matmul, bf16 or float32).

    ```python
    with PackedLinears(target, drafter):
        out = target.generate(**inputs, assistant_model=drafter)
    ```

    or :meth:`enable` / :meth:`disable` for a long-lived process. Every layer's weight must be on the CPU, all in
    bf16 or all in float32. Refuses, before packing anything, a layer that is not, and a CPU that cannot pack that
    dtype (bf16 without oneDNN bf16 matmuls, float32 without oneDNN).
    """

    def __init__(self, *models: nn.Module):
        self.layers = [module for model in models for module in model.modules() if isinstance(module, nn.Linear)]
        self.dtype = self.layers[0].weight.dtype if self.layers else torch.bfloat16
        for module in self.layers:
            weight = module.weight
            if weight.dtype not in PACKED_DTYPES or weight.dtype != self.dtype or weight.device.type != "cpu":
                name = next(name for model in models for name, m in model.named_modules() if m is module)
                raise ValueError(f"packed linears are for bfloat16 or float32 weights on the CPU, all of one dtype; "
                                 f"{name} holds {weight.dtype} on {weight.device.type} where the first layer holds "
                                 f"{self.dtype} (load the models with one dtype).")
        if not packed_linears_supported(self.dtype):
            raise ValueError("packed bf16 linears need a CPU whose bf16 matmuls run through oneDNN (AVX512-BF16 or "
                             "AMX); this one has neither, so packing would change the results: leave the option off."
                             if self.dtype == torch.bfloat16 else
                             "packed float32 linears need PyTorch built with oneDNN (mkldnn); this build has none.")

    def _pack(self, module: nn.Linear) -> torch.Tensor:
        fingerprint = weight_fingerprint(module.weight)
        cached = PACKED_WEIGHTS.get(module)
        if cached is None or cached[0] != fingerprint:
            cached = (fingerprint, _onednn_pack(module.weight.detach()))
            PACKED_WEIGHTS[module] = cached
        return cached[1]

    def enable(self) -> PackedLinears:
        """Run every layer on its packed weight (packing those not packed yet or changed since)."""
        for module in self.layers:
            packed = self._pack(module)
            kernel = _onednn_bf16_linear if self.dtype == torch.bfloat16 else _onednn_float32_linear
            module.forward = partial(kernel, module, packed)
        return self

    def disable(self) -> None:
        """Give every layer its own forward back (the packed copies are kept for the next :meth:`enable`)."""
        for module in self.layers:
            vars(module).pop("forward", None)

    def __enter__(self) -> PackedLinears:
        return self.enable()

    def __exit__(self, *exc_info) -> None:
        self.disable()
