"""What the linear layers of one target forward cost on this CPU, in bf16 and with weight-only int8 / int4 kernels.

    python scripts/linear_kernels_probe.py [--target smollm2-135m] [--rows 1 4 16 25] [--threads 2] [--repeats 5]
                                           [--out linear_kernels.json]

A decoding step reads every weight of the target once. Plain decoding runs one row through each linear layer;
DFlash's verification runs a whole tree (up to 25 rows with the default tree 8 + lookup 16). Low-bit weights read
fewer bytes, which is how llama.cpp decodes a 4-bit GGUF file fast on a CPU. This probe times, for each row count,
every linear layer of the target (the LM head included) on the same real weights through three PyTorch CPU kernels:

* ``bf16``: the weights in bf16, packed once for oneDNN (each layer's forward under
  :class:`dflash2_hf.cpu.kernels.PackedLinears`);
* ``int8``: ``torch.ops.aten._weight_int8pack_mm``, int8 weights with one bf16 scale per output channel;
* ``int4``: ``torch.ops.aten._weight_int4pack_mm_for_cpu``, 4-bit weights in groups of 32 along the input, a bf16
  scale and offset per group (the layout of GGUF's Q4_1 blocks).

The LM head stays bf16 in every kernel's forward (it is the tied input embedding). Each kernel is also checked for
what exact speculative decoding needs of it (on the first decoder layer's weights): a row's result must not depend on
how many rows the call holds. Prints a Markdown table and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from dflash2_hf.cpu.kernels import PackedLinears, packed_linears_supported, rows_match_alone
from dflash2_hf.presets import load_target

GROUP = 32  # input features per int4 group, as in GGUF's Q4_0/Q4_1 blocks


def int8_kernel(weight: torch.Tensor):
    """Symmetric int8 per output channel."""
    scales = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127
    quantized = torch.round(weight.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    scales = scales.to(torch.bfloat16)
    return lambda rows: torch.ops.aten._weight_int8pack_mm(rows, quantized, scales)


def int4_kernel(weight: torch.Tensor):
    """Asymmetric 4-bit in groups of GROUP inputs: w = (q - 8) * scale + offset, q in 0..15."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // GROUP, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    quantized = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(quantized.view(out_features, in_features), 2)
    scale_and_offset = torch.stack([scale.t(), (low + 8 * scale).t()], dim=-1).contiguous().to(torch.bfloat16)
    return lambda rows: torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, GROUP, scale_and_offset)


LOW_BIT_KERNELS = {"int8": int8_kernel, "int4": int4_kernel}


def forward_seconds(layers: list, inputs: dict[int, torch.Tensor], repeats: int) -> float:
    """Mean seconds to run every ``(in_features, kernel)`` layer once (as one forward does), after one untimed pass."""

    def forward():
        for in_features, kernel in layers:
            kernel(inputs[in_features])

    forward()
    started = time.perf_counter()
    for _ in range(repeats):
        forward()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 25])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="linear_kernels.json")
    args = parser.parse_args()
    if not packed_linears_supported():
        parser.error("this probe times oneDNN's bf16 matmuls; this CPU has no AVX512-BF16 or AMX")
    if min(args.rows) < 1 or args.repeats < 1:
        parser.error("--rows and --repeats must be >= 1")

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target, _ = load_target(args.target, dtype=torch.bfloat16)
    PackedLinears(target).enable()  # every layer's forward is now the packed oneDNN call: the bf16 kernel
    head_module = target.get_output_embeddings()
    modules = [module for module in target.modules() if isinstance(module, nn.Linear) and module is not head_module]
    weights = [module.weight.detach() for module in modules]
    kernels = {"bf16": [(m.in_features, m.forward) for m in modules]}
    kernels |= {name: [(w.shape[1], make(w)) for w in weights] for name, make in LOW_BIT_KERNELS.items()}
    head = (head_module.in_features, head_module.forward)
    sizes = {size for size, _ in kernels["bf16"]} | {head[0]}
    record = {"target": args.target, "threads": args.threads, "linear_layers": len(weights),
              "weight_bytes_bf16": sum(w.numel() * 2 for w in weights), "ms_per_forward": {}, "rows_independent": {}}
    for name, layers in kernels.items():
        record["ms_per_forward"][name] = {}
        for rows in args.rows:
            inputs = {size: torch.randn(rows, size).to(torch.bfloat16) for size in sizes}
            record["ms_per_forward"][name][rows] = 1000 * forward_seconds([*layers, head], inputs, args.repeats)
        first_block = layers[: len(layers) // target.config.num_hidden_layers]
        record["rows_independent"][name] = all(rows_match_alone(kernel, torch.randn(max(args.rows), size)
                                                                .to(torch.bfloat16)) for size, kernel in first_block)
    Path(args.out).write_text(json.dumps(record, indent=2))

    print(f"{args.target}: {len(weights)} linear layers + the bf16 LM head, {args.threads} threads; "
          f"ms per forward (each row count: every layer once)\n")
    print("| kernel | " + " | ".join(f"rows: {rows}" for rows in args.rows) + " | rows independent |")
    print("|---|" + "---|" * len(args.rows) + "---|")
    for name in kernels:
        times = " | ".join(f"{record['ms_per_forward'][name][rows]:.1f}" for rows in args.rows)
        print(f"| {name} | {times} | {'yes' if record['rows_independent'][name] else 'NO'} |")


if __name__ == "__main__":
    main()
