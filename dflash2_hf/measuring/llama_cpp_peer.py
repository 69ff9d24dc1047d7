"""llama.cpp's plain decoding (``llama-cpp-python``) as a peer method of ``dflash2-hf bench``.

The peer decodes the very GGUF file a preset target is loaded from, natively quantized (transformers de-quantizes
the same file on load), so its tokens can differ from the transformers target's: it is a speed reference for "the
same model in the fastest CPU engine", not an exactness reference. It gets the prompt's token ids as they are (both
read the GGUF tokenizer), the same thread count, and the same stopping tokens (the target's ``eos_token_id``).

Build it with explicit SIMD flags (a default build can die with "Illegal instruction"), AVX-512 only where the CPU
has it: ``install_command()`` writes the command for this CPU (about 15-20 minutes on 2 cores).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..cpu.kernels import cpu_flags
from .benchmark import Decoded, Method


def install_command() -> str:
    """The pip command that builds llama-cpp-python for this CPU: AVX-512 on only where the CPU has AVX-512F."""
    avx512 = "ON" if "avx512f" in cpu_flags() else "OFF"
    return (f'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512={avx512} -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" '
            "pip install --no-cache-dir llama-cpp-python==0.3.36")


class LlamaCppError(RuntimeError):
    """llama.cpp cannot run this benchmark; the message says why and what to do."""


class LlamaCppMethod(Method):
    """Plain decoding of a GGUF file by llama.cpp, timed like ``generate`` (prompt evaluation included)."""

    def __init__(self, gguf_path: str | Path, threads: int, context_tokens: int = 4096):
        super().__init__("llama.cpp plain (GGUF)")
        try:
            import llama_cpp
        except ImportError:
            raise LlamaCppError(f"llama-cpp-python is not installed; build it for this CPU with `{install_command()}`.") from None
        if not Path(gguf_path).is_file():
            raise LlamaCppError(f"No GGUF file at {gguf_path}: the llama.cpp peer needs a GGUF preset target.")
        self.version = llama_cpp.__version__
        self.llama = llama_cpp.Llama(model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads,
                           n_ctx=context_tokens, verbose=False)

    def decode(self, target, inputs: torch.Tensor, max_new_tokens: int, temperature: float, seed: int) -> Decoded:
        """Greedy at temperature 0, else plain sampling at ``temperature`` (no top-k/top-p/min-p truncation).

        Every decode evaluates its whole prompt, as ``generate`` does: llama.cpp would otherwise reuse the previous
        run's cached prefix, timing a repeated prompt without its prefill and computing the last prompt token's
        logits in a batch of one, which changes their rounding and so a seeded draw.
        """
        stop = target.generation_config.eos_token_id
        stop = set(stop if isinstance(stop, list) else [] if stop is None else [stop])
        prompt = inputs[0].tolist()
        self.llama.reset()
        self.llama.set_seed(seed)
        new_tokens = []
        started = time.perf_counter()
        for token in self.llama.generate(prompt, temp=temperature, top_k=0 if temperature > 0 else 1, top_p=1.0,
                                         min_p=0.0, repeat_penalty=1.0, reset=True):
            new_tokens.append(token)
            if token in stop or len(new_tokens) >= max_new_tokens:
                break
        seconds = time.perf_counter() - started
        return Decoded(torch.tensor([prompt + new_tokens]), seconds)
