"""Serve the authors' reference implementation (PyPI ``dflash`` 0.1.0) to ``dflash2-hf bench`` as JSON lines.

The reference pins transformers 5.15, so this script runs under the Python of a venv of its own, executed by file
path: it imports only the standard library, torch, transformers and dflash, never ``dflash2_hf``.

    python reference_worker.py --target FOLDER [--gguf-file NAME] --drafter FOLDER [--dtype float32] [--threads N]

It loads the target (a checkpoint folder, or a GGUF file in it) and a drafter folder in the published layout, runs
one short warm-up generation, and writes ``{"ready": true, ...}`` (versions, drafter class, block size). Then, for
every request line on stdin

    {"prompt": [ids], "max_new_tokens": n, "temperature": t, "seed": s,
     "stop_token_ids": [ids] or null, "top_p": p, "top_k": k}

it seeds torch, runs the reference's ``spec_generate`` and writes

    {"output_ids": [prompt ids + new ids], "seconds": s, "acceptance_lengths": [n, ...]}

``seconds`` is measured around the ``spec_generate`` call only. ``acceptance_lengths[c]`` is what the reference
itself reports with ``return_stats=True`` (which calls ``torch.cuda.synchronize`` and so needs a GPU): the tokens
verification cycle ``c`` emitted, the target's own token included. Here it is read off the positions where the
target's forward passes start (a forward pre-hook that only reads its arguments): after the prefill, every forward
verifies one block, and a cycle emits as many tokens as the next block starts further on. A request that fails gets
``{"error": "..."}`` and the worker keeps serving; it exits when stdin closes. Anything the libraries print goes
to stderr, so stdout carries the protocol alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from importlib.metadata import version
from typing import TextIO

import torch
from dflash.model import DFlash2DraftModel, DFlashDraftModel
from transformers import AutoConfig, AutoModelForCausalLM

WARMUP_PROMPT_LENGTH = 8
WARMUP_NEW_TOKENS = 16


class VerificationLog:
    """The first position of every forward pass of the target, recorded by a pre-hook that changes nothing."""

    def __init__(self, target: torch.nn.Module) -> None:
        self.starts: list[int] = []
        self._handle = target.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        positions = kwargs.get("position_ids")
        if positions is None:
            raise RuntimeError("The reference called the target without position_ids; this worker cannot count its "
                               "verification cycles (is the installed dflash 0.1.0?).")
        self.starts.append(int(positions[0, 0]))

    def close(self) -> None:
        """Remove the hook."""
        self._handle.remove()

    def acceptance_lengths(self, sequence_length: int) -> list[int]:
        """Tokens emitted per verification cycle of the generation that ended with ``sequence_length`` tokens.

        The first forward is the prefill; cycle ``c`` verifies from ``starts[c + 1]``, and the generation ends one
        position after the last cycle's end (the reference keeps the token that the next cycle would start from).
        """
        cycle_starts = self.starts[1:]
        ends = cycle_starts[1:] + [sequence_length - 1]
        return [end - start for start, end in zip(cycle_starts, ends)]


def load_models(args: argparse.Namespace) -> tuple[torch.nn.Module, DFlashDraftModel]:
    """The target (checkpoint folder or GGUF file) and the drafter, in ``args.dtype``, in eval mode."""
    dtype = getattr(torch, args.dtype)
    gguf = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, **gguf).eval()
    architectures = AutoConfig.from_pretrained(args.drafter).architectures or []
    drafter_class = DFlash2DraftModel if "DFlash2DraftModel" in architectures else DFlashDraftModel
    return target, drafter_class.from_pretrained(args.drafter, dtype=dtype).eval()


def generate(target: torch.nn.Module, drafter: DFlashDraftModel, request: dict) -> dict:
    """One request: the reference's ``spec_generate``, timed alone, and its verification cycles."""
    prompt = torch.tensor([request["prompt"]], dtype=torch.long)
    torch.manual_seed(int(request.get("seed", 0)))
    log = VerificationLog(target)
    try:
        started = time.perf_counter()
        output = drafter.spec_generate(
            target, prompt, int(request["max_new_tokens"]), request.get("stop_token_ids"),
            temperature=float(request.get("temperature", 0.0)), top_p=float(request.get("top_p", 1.0)),
            top_k=int(request.get("top_k", 0)),
        )
        seconds = time.perf_counter() - started
    finally:
        log.close()
    sequence = output[0].tolist()
    return {"output_ids": sequence, "seconds": seconds, "acceptance_lengths": log.acceptance_lengths(len(sequence))}


def serve(target: torch.nn.Module, drafter: DFlashDraftModel, requests: TextIO, replies: TextIO) -> None:
    """Answer request lines until ``requests`` ends; a failed request is answered with its error."""
    for line in requests:
        if not line.strip():
            continue
        try:
            reply = generate(target, drafter, json.loads(line))
        except Exception as error:  # noqa: BLE001 - every failure is reported to the caller, who decides
            traceback.print_exc()
            reply = {"error": f"{type(error).__name__}: {error}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve the reference dflash implementation as JSON lines.")
    parser.add_argument("--target", required=True, help="checkpoint folder (holding the GGUF file when --gguf-file)")
    parser.add_argument("--gguf-file", help="GGUF file name inside --target")
    parser.add_argument("--drafter", required=True, help="drafter folder in the published layout")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    # The protocol gets its own copy of stdout; whatever else writes to stdout lands on stderr.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    torch.set_num_threads(args.threads)
    try:
        target, drafter = load_models(args)
        warmup = {"prompt": [0] * WARMUP_PROMPT_LENGTH, "max_new_tokens": WARMUP_NEW_TOKENS, "stop_token_ids": None}
        generate(target, drafter, warmup)
    except Exception as error:  # noqa: BLE001 - reported on the protocol, then the worker exits
        traceback.print_exc()
        replies.write(json.dumps({"error": f"{type(error).__name__}: {error}"}) + "\n")
        return 1
    versions = {name: version(name) for name in ("dflash", "transformers", "torch")}
    replies.write(json.dumps({"ready": True, "versions": versions, "drafter": type(drafter).__name__,
                              "block_size": drafter.block_size, "threads": torch.get_num_threads()}) + "\n")
    serve(target, drafter, sys.stdin, replies)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
