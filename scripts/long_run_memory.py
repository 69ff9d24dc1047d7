"""Peak memory of one long generation: the SmolLM2-135M preset target (bf16) with a drafter, greedy.

    python scripts/long_run_memory.py [--drafter FOLDER] [--new-tokens 4096] [--every 512] [--out long_run_memory.json]

The answer to a fixed prompt is generated to exactly ``--new-tokens`` tokens (end-of-turn suppressed). Before
generating and each time the output passes another ``--every`` new tokens, the script records the process's peak
resident set size (``resource.getrusage``: the most memory the process has held so far) and the seconds since
generation started. It prints a Markdown table and writes the numbers as JSON to ``--out``.

The drafter defaults to the one shipped for SmolLM2-135M; without a shipped drafter, pass ``--drafter``.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from dflash2_hf import DFlashDraftModel
from dflash2_hf.presets import default_drafter_folder, load_target

TARGET = "smollm2-135m"
PROMPT = "Write a long, detailed history of computing, from the abacus to today, with one section per decade."


def peak_rss_mib() -> float:
    """The most resident memory this process has held so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


class PeakRssMarks(BaseStreamer):
    """A streamer recording ``{new_tokens, peak_rss_mib, seconds}`` each time the output passes another ``every``
    new tokens (the first ``put``, the prompt, starts the clock)."""

    def __init__(self, every: int, read_peak: Callable[[], float] = peak_rss_mib,
                 clock: Callable[[], float] = time.perf_counter):
        self.every = every
        self.read_peak = read_peak
        self.clock = clock
        self.new_tokens: int | None = None
        self.started = 0.0
        self.marks: list[dict] = []

    def put(self, value: torch.Tensor) -> None:
        if self.new_tokens is None:
            self.new_tokens, self.started = 0, self.clock()
            return
        self.new_tokens += value.numel()
        while self.new_tokens >= (len(self.marks) + 1) * self.every:
            self.marks.append({"new_tokens": (len(self.marks) + 1) * self.every, "peak_rss_mib": self.read_peak(),
                               "seconds": self.clock() - self.started})

    def end(self) -> None:
        pass


def markdown_table(result: dict) -> str:
    """The run's marks as a Markdown table, the peak before generating first."""
    rows = ["| new tokens | peak RSS (MiB) | seconds |", "|---:|---:|---:|",
            f"| 0 (models loaded) | {result['peak_rss_mib_before']:.0f} | 0.0 |"]
    rows += [f"| {m['new_tokens']} | {m['peak_rss_mib']:.0f} | {m['seconds']:.1f} |" for m in result["marks"]]
    return "\n".join(rows)


def run(drafter_folder: Path, new_tokens: int, every: int) -> dict:
    """Generate ``new_tokens`` tokens with the drafter and return the record (see the module docstring)."""
    target, tokenizer = load_target(TARGET, dtype=torch.bfloat16)
    drafter = DFlashDraftModel.from_pretrained(drafter_folder, dtype=torch.bfloat16).eval()
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    before = peak_rss_mib()
    marks = PeakRssMarks(every)
    output = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, streamer=marks, return_dict_in_generate=True)
    stats = output.dflash_stats
    return {"target": TARGET, "drafter": str(drafter_folder), "prompt_tokens": inputs["input_ids"].shape[1],
            "new_tokens": output.sequences.shape[1] - inputs["input_ids"].shape[1],
            "mean_acceptance_length": stats.mean_acceptance_length, "peak_rss_mib_before": before,
            "marks": marks.marks}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, help="drafter folder (default: the one shipped for SmolLM2-135M)")
    parser.add_argument("--new-tokens", type=int, default=4096)
    parser.add_argument("--every", type=int, default=512, help="record every this many new tokens")
    parser.add_argument("--out", type=Path, default=Path("long_run_memory.json"))
    args = parser.parse_args(argv)
    try:
        drafter_folder = args.drafter or default_drafter_folder(TARGET)
    except FileNotFoundError as error:
        parser.error(str(error))
    result = run(drafter_folder, args.new_tokens, args.every)
    args.out.write_text(json.dumps(result, indent=2))
    print(markdown_table(result))
    print(f"\n{result['new_tokens']} new tokens, mean acceptance length {result['mean_acceptance_length']:.2f}; "
          f"written to {args.out}")


if __name__ == "__main__":
    main()
