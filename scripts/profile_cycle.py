"""Where one DFlash 2 decoding cycle spends its time, on a real target and drafter (issue 9's profile).

    python scripts/profile_cycle.py [--target smollm2-135m] [--drafter FOLDER] [--dtype float32] [--threads 2]
                                    [--block-size 16] [--max-new-tokens 128] [--packed-linears] [--exact-attention]
                                    [--out profile.json]

Runs ``generate`` once to warm up, then once under ``torch.profiler`` and reads the wall time of each step of the
cycle, as labelled in :mod:`dflash2_hf.generation.loop` (``dflash2.draft``, ``dflash2.select``, ``dflash2.verify_forward``,
``dflash2.verify_decide``, ``dflash2.cache_crop``, ``dflash2.emit``, ``dflash2.context``, and the fallback's
``dflash2.plain_step``); what no label covers is
the loop's own Python work. Plain decoding of the same prompt is timed in the same run for scale (with
``--packed-linears``, both run on packed linears (oneDNN, bf16 or float32;
:class:`dflash2_hf.cpu.kernels.PackedLinears`); with
``--exact-attention``, the target runs the float64 attention of :mod:`dflash2_hf.cpu.exact_attention` in both). Prints a
Markdown table and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dflash2_hf import DFlashDraftModel
from dflash2_hf.cli.checks import check_bf16_cpu_options
from dflash2_hf.cpu.exact_attention import ExactAttention
from dflash2_hf.cpu.kernels import PackedLinears
from dflash2_hf.presets import default_drafter_folder, load_target

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and a short test."
STEPS = ("draft", "select", "verify_forward", "verify_decide", "cache_crop", "emit", "context", "plain_step")


def step_seconds(prof: profile) -> dict[str, float]:
    """Total wall seconds under each ``dflash2.<step>`` label (profiler CPU times are in microseconds)."""
    totals = {event.key: event.cpu_time_total / 1e6 for event in prof.key_averages() if event.key.startswith("dflash2.")}
    return {step: totals.get(f"dflash2.{step}", 0.0) for step in STEPS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafter")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--packed-linears", action="store_true",
                        help="linear weights packed once (oneDNN, bf16 or float32)")
    parser.add_argument("--exact-attention", action="store_true",
                        help="bf16 only: the target's attention in float64, for ours and plain decoding alike")
    parser.add_argument("--out", default="profile.json")
    args = parser.parse_args()
    check_bf16_cpu_options(args, "profile_cycle.py")  # the CLI's own refusals, before any model loads

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_target(args.target, dtype=dtype)
    drafter = DFlashDraftModel.from_pretrained(args.drafter or default_drafter_folder(args.target), dtype=dtype).eval()
    if args.packed_linears:
        PackedLinears(target, drafter).enable()
    if args.exact_attention:
        ExactAttention(target).enable()
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    settings = dict(do_sample=False, max_new_tokens=args.max_new_tokens)
    ours = dict(assistant_model=drafter, dflash_block_size=args.block_size,
                dflash_exactness="rounding",  # a drafted cycle at every width: the cycle is what this profiles
                **settings)
    target.generate(**inputs, **ours)  # warm-up
    target.generate(**inputs, **settings)

    started = time.perf_counter()
    plain = target.generate(**inputs, **settings)
    plain_seconds = time.perf_counter() - started
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        stats = target.generate(**inputs, **ours, return_dict_in_generate=True).dflash_stats
        total = time.perf_counter() - started
    steps = step_seconds(prof)
    steps["prefill"] = stats.prefill_seconds
    steps["other (generate set-up, loop)"] = max(0.0, total - sum(steps.values()))
    plain_tokens = plain.shape[1] - inputs["input_ids"].shape[1]
    record = {"target": args.target, "dtype": args.dtype, "threads": args.threads, "packed_linears": args.packed_linears,
              "exact_attention": args.exact_attention,
              "block_size": stats.block_size,
              "cycles": stats.cycles, "new_tokens": stats.new_tokens, "mean_acceptance_length": stats.mean_acceptance_length,
              "seconds": total, "profiled_seconds_by_step": steps,
              "plain": {"new_tokens": plain_tokens, "seconds": plain_seconds}}
    Path(args.out).write_text(json.dumps(record, indent=2))
    packed = ", packed linears" if args.packed_linears else ""
    packed += ", float64 attention" if args.exact_attention else ""
    print(f"{args.target} {args.dtype}{packed}, {args.threads} threads, block {stats.block_size}: {stats.cycles} cycles, "
          f"{stats.new_tokens} tokens, mean acceptance {stats.mean_acceptance_length:.2f}; "
          f"plain decoding {1000 * plain_seconds / plain_tokens:.1f} ms/token (unprofiled)")
    print("\n| step | ms per cycle | share |\n|---|---|---|")
    for step, seconds in steps.items():
        print(f"| {step} | {1000 * seconds / max(1, stats.cycles):.2f} | {100 * seconds / total:.1f}% |")


if __name__ == "__main__":
    main()
