"""Which well-kept CPU options speed decoding up here (issue 9): plain decoding and ours, each option against eager.

    python scripts/cpu_options_probe.py [--target smollm2-135m] [--dtype float32] [--threads 2]
                                        [--max-new-tokens 128] [--options eager static compile quanto-int8 ...]
                                        [--out cpu_options.json]

Options (each timed on the same 3 prompts, greedy, after one untimed warm-up run that also pays any compilation):

* ``eager``: plain ``generate`` as loaded (the baseline every ratio is taken against);
* ``static``: plain ``generate`` with ``cache_implementation="static"``;
* ``compile``: plain ``generate`` with a static cache and transformers' automatic ``torch.compile`` of the forward
  (``CompileConfig``, enabled on CPU);
* ``quanto-int8`` / ``quanto-int4``: plain ``generate`` on a copy of the target whose linear weights optimum-quanto
  quantized (a different, quantized target);
* ``threads-1``: plain ``generate`` on one thread instead of ``--threads``;
* ``ours``: our decoding with the shipped drafter in its default mode;
* ``ours-quanto-int8``: the same on the int8-quantized target (the drafter unchanged);
* ``ours-compiled``: the same with the target's and the drafter's forwards under ``torch.compile(dynamic=True)``
  (warm-up: every prompt once, as block and tree widths vary).

Prints a Markdown table (tok/s, ratio to eager, whether the tokens equal eager's) and writes it as JSON.
Compilation lies outside what ``dflash2-hf bench`` times per run, which is why this probe exists; the winners
would move into the harness.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from transformers import CompileConfig

from dflash2_hf import DFlashDraftModel
from dflash2_hf.presets import default_drafter_folder, load_target

PROMPTS = ("Write a Python function that checks whether a number is prime.",
           "Explain the difference between a list and a tuple in Python.",
           "Write a function that merges two sorted lists into one sorted list.")
OPTIONS = ("eager", "static", "compile", "quanto-int8", "quanto-int4", "threads-1", "ours", "ours-quanto-int8",
           "ours-compiled")


def quantized(model, bits: int):
    """A copy of ``model`` whose linear weights optimum-quanto stores in int8 or int4."""
    from optimum.quanto import freeze, qint4, qint8, quantize

    copied = copy.deepcopy(model)
    quantize(copied, weights=qint8 if bits == 8 else qint4)
    freeze(copied)
    return copied


def compiled_on_cpu() -> CompileConfig:
    config = CompileConfig()
    config._compile_all_devices = True  # transformers auto-compiles on accelerators only unless told otherwise
    return config


def run_option(option: str, timed, target, drafter, threads: int) -> tuple[float, list[torch.Tensor]]:
    """One option's tokens per second and outputs, by ``timed`` (the model's ``generate`` over every prompt)."""
    if option == "eager":
        return timed(target)
    if option == "static":
        return timed(target, cache_implementation="static")
    if option == "compile":
        return timed(target, cache_implementation="static", compile_config=compiled_on_cpu())
    if option.startswith("quanto"):
        return timed(quantized(target, 8 if option == "quanto-int8" else 4))
    if option == "threads-1":
        torch.set_num_threads(1)
        try:
            return timed(target)
        finally:
            torch.set_num_threads(threads)
    if option == "ours":
        return timed(target, assistant_model=drafter)
    if option == "ours-quanto-int8":
        return timed(quantized(target, 8), assistant_model=drafter)
    eager_forwards = target.forward, drafter.forward  # ours-compiled; the eager forwards are put back afterwards
    target.forward = torch.compile(target.forward, dynamic=True)
    drafter.forward = torch.compile(drafter.forward, dynamic=True)
    try:
        return timed(target, warm_all=True, assistant_model=drafter)
    finally:
        target.forward, drafter.forward = eager_forwards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--options", nargs="+", default=list(OPTIONS), choices=OPTIONS)
    parser.add_argument("--out", default="cpu_options.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_target(args.target, dtype=dtype)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"] for p in PROMPTS]

    def timed(model, warm_all: bool = False, **kwargs) -> tuple[float, list[torch.Tensor]]:
        for ids in prompts if warm_all else prompts[:1]:
            model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs)
        outputs, started = [], time.perf_counter()
        for ids in prompts:
            outputs.append(model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs))
        seconds = time.perf_counter() - started
        return sum(o.shape[1] - i.shape[1] for o, i in zip(outputs, prompts)) / seconds, outputs

    drafter = None
    if any(option.startswith("ours") for option in args.options):
        drafter = DFlashDraftModel.from_pretrained(default_drafter_folder(args.target), dtype=dtype).eval()
    rows, baseline = [], None
    for option in ["eager"] + [o for o in args.options if o != "eager"]:
        rate, outputs = run_option(option, timed, target, drafter, args.threads)
        if baseline is None:
            baseline = (rate, outputs)
        same = all(torch.equal(a, b) for a, b in zip(outputs, baseline[1]))
        rows.append({"option": option, "tokens_per_second": rate, "ratio_to_eager": rate / baseline[0],
                     "same_tokens_as_eager": same})
        print(f"{option}: {rate:.1f} tok/s", flush=True)

    print(f"\n| option ({args.dtype}, {args.threads} threads) | tok/s | vs eager | tokens = eager's |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['option']} | {row['tokens_per_second']:.1f} | {row['ratio_to_eager']:.2f}x | "
              f"{'yes' if row['same_tokens_as_eager'] else 'no'} |")
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    Path(args.out).write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
