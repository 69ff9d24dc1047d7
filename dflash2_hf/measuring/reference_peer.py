"""The authors' reference implementation (PyPI ``dflash`` 0.1.0) as a peer method of ``dflash2-hf bench``.

The reference pins transformers 5.15, so it runs in a venv of its own (by convention ``.venv-reference``), in a
worker process (``reference_worker.py``, executed by file path with that venv's Python) that answers JSON lines.
:class:`ReferencePeer` exports our drafter in the published DFlash 2 layout to a temporary folder (the code of
``dflash2-hf export --published-layout``), starts the worker on the same target checkpoint and that folder, and
asks it for one generation at a time; :class:`ReferenceMethod` is the :class:`~dflash2_hf.measuring.benchmark.Method` that
:class:`~dflash2_hf.measuring.benchmark.Benchmark` interleaves with the in-process methods. The worker sleeps on its stdin
while the other methods run, so the two processes never compete for the CPU.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import torch
from transformers import GenerationConfig

from ..export import ExportError, export_drafter
from .benchmark import Decoded, Method

#: Where ``dflash2-hf bench --reference-venv`` looks when no folder is given (relative to the working directory).
DEFAULT_VENV = Path(".venv-reference")
WORKER = Path(__file__).with_name("reference_worker.py")
#: The commands that create it (docs/results.md); gguf and accelerate load GGUF targets such as the presets.
INSTALL = ("python -m venv .venv-reference && .venv-reference/bin/pip install torch==2.13.0 dflash==0.1.0 "
           "transformers==5.15.0 safetensors && .venv-reference/bin/pip install gguf accelerate")
#: What the venv must import: the reference's model module (it imports torch and transformers' Qwen3 internals).
PROBE = ("import dflash, dflash.model, json, importlib.metadata as m; "
         "print(json.dumps({n: m.version(n) for n in ('dflash', 'transformers', 'torch')}))")


class ReferencePeerError(RuntimeError):
    """The reference implementation cannot be run or failed; the message says why and what to do."""


def venv_python(venv: str | Path) -> Path:
    """The Python interpreter of a virtual environment folder."""
    return Path(venv) / "bin" / "python"


def check_reference_venv(venv: str | Path) -> dict[str, str]:
    """The versions of ``dflash``, ``transformers`` and ``torch`` in ``venv``, after checking that its Python imports
    the reference; raises :class:`ReferencePeerError` (with the install commands) when it does not."""
    python = venv_python(venv)
    if not python.is_file():
        raise ReferencePeerError(f"No Python at {python}: the reference implementation needs a venv of its own. "
                                 f"Create it with `{INSTALL}`.")
    probe = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True)
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise ReferencePeerError(f"{python} cannot import the reference implementation ({reason}). It pins "
                                 f"transformers 5.15, so give it a venv of its own: `{INSTALL}`.")
    return json.loads(probe.stdout.strip().splitlines()[-1])


def sampling_settings(target) -> dict:
    """Stop tokens, top-p and top-k as the target's ``generate`` applies them when a call sets only the temperature:
    its generation config, else transformers' defaults (``generate`` keeps the 50 most likely tokens when sampling)."""
    config, defaults = target.generation_config, GenerationConfig._get_default_generation_params()
    eos = config.eos_token_id
    stop = None if eos is None else [eos] if isinstance(eos, int) else list(eos)
    top_p = config.top_p if config.top_p is not None else defaults["top_p"]
    top_k = config.top_k if config.top_k is not None else defaults["top_k"]
    return {"stop_token_ids": stop, "top_p": float(top_p), "top_k": int(top_k)}


class ReferencePeer:
    """A worker process running the reference implementation on a target checkpoint and our drafter.

    Args:
        venv: the reference's virtual environment (its ``bin/python`` imports ``dflash``).
        target_folder: the target's checkpoint folder, or the folder holding its GGUF file.
        drafter_folder: our DFlash 2 drafter; exported in the published layout for the reference to load.
        gguf_file: the GGUF file name inside ``target_folder``, when the target is one.
        dtype: dtype of both models in the worker (match the in-process methods).
        threads: torch intra-op threads of the worker.

    Use it as a context manager (or call :meth:`start` and :meth:`close`). Starting checks the venv first, so a
    missing or broken venv fails before anything is exported or loaded.
    """

    def __init__(self, venv: str | Path, target_folder: str | Path, drafter_folder: str | Path, *,
                 gguf_file: str | None = None, dtype: torch.dtype = torch.float32, threads: int = 1) -> None:
        self.venv, self.target_folder, self.drafter_folder = Path(venv), Path(target_folder), Path(drafter_folder)
        self.gguf_file, self.dtype, self.threads = gguf_file, dtype, threads
        self.versions: dict[str, str] = {}
        self.ready: dict = {}
        self._process: subprocess.Popen | None = None
        self._log = None
        self._folder: tempfile.TemporaryDirectory | None = None

    def start(self) -> ReferencePeer:
        """Check the venv, export the drafter, start the worker and wait until it has loaded both models."""
        self.versions = check_reference_venv(self.venv)
        self._folder = tempfile.TemporaryDirectory(prefix="dflash2-reference-")
        try:
            self._launch(Path(self._folder.name))
        except BaseException:
            self.close()
            raise
        return self

    def _launch(self, folder: Path) -> None:
        try:
            # The reference has no draft vocabulary: a cut drafter runs there as the drafter it was cut from.
            export_drafter(self.drafter_folder, folder / "drafter", dtype=self.dtype, published_layout=True,
                           whole_head=True)
        except ExportError as error:
            raise ReferencePeerError(f"The reference implementation cannot load this drafter: {error}") from None
        command = [str(venv_python(self.venv)), str(WORKER), "--target", str(self.target_folder),
                   "--drafter", str(folder / "drafter"), "--dtype", str(self.dtype).removeprefix("torch."),
                   "--threads", str(self.threads)]
        if self.gguf_file:
            command += ["--gguf-file", self.gguf_file]
        self._log = (folder / "worker.log").open("w")
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                         text=True, bufsize=1)
        self.ready = self._reply()

    def _reply(self) -> dict:
        """The worker's next JSON line (a stray line printed while it imported is skipped); a worker that died or
        answered an error raises with its own words."""
        while True:
            line = self._process.stdout.readline()
            if not line:
                raise self._exited()
            try:
                reply = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(reply, dict):
                break
        if "error" in reply:
            raise ReferencePeerError(f"The reference implementation failed: {reply['error']}")
        return reply

    def log_tail(self, lines: int = 20) -> str:
        """The last lines the worker wrote to stderr (warnings, tracebacks)."""
        if self._folder is None or self._log is None:
            return ""
        self._log.flush()
        return "\n".join((Path(self._folder.name) / "worker.log").read_text().splitlines()[-lines:])

    def generate(self, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 stop_token_ids: list[int] | None = None, top_p: float = 1.0, top_k: int = 0) -> dict:
        """One generation by the reference: ``{"output_ids", "seconds", "acceptance_lengths"}`` (see the worker)."""
        if self._process is None:
            raise ReferencePeerError("The reference peer is not started; use it in a `with` block or call start().")
        request = {"prompt": [int(t) for t in prompt], "max_new_tokens": max_new_tokens, "temperature": temperature,
                   "seed": seed, "stop_token_ids": stop_token_ids, "top_p": top_p, "top_k": top_k}
        try:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            raise self._exited() from None
        return self._reply()

    def _exited(self) -> ReferencePeerError:
        code = self._process.wait()
        return ReferencePeerError(f"The reference worker exited (code {code}) without answering:\n{self.log_tail()}")

    def close(self) -> None:
        """Stop the worker (it exits when its stdin closes) and delete the exported drafter."""
        if self._process is not None:
            try:
                self._process.stdin.close()
            except BrokenPipeError:  # the worker is gone already
                pass
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process.stdout.close()
            self._process = None
            self._log.close()
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None

    def __enter__(self) -> ReferencePeer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()


class ReferenceMethod(Method):
    """The reference implementation as a benchmark method: each call is one request to a started
    :class:`ReferencePeer`, with the stop tokens, top-p and top-k that the target's ``generate`` would use."""

    def __init__(self, peer: ReferencePeer, name: str = "reference dflash") -> None:
        super().__init__(name)
        self.peer = peer

    def decode(self, target, inputs: torch.Tensor, max_new_tokens: int, temperature: float, seed: int) -> Decoded:
        """Ask the worker; the seconds are those the worker measured around the reference's generate call."""
        if inputs.shape[0] != 1:
            raise ReferencePeerError(f"The reference decodes one prompt at a time; got a batch of {inputs.shape[0]}.")
        reply = self.peer.generate(inputs[0].tolist(), max_new_tokens, temperature, seed, **sampling_settings(target))
        sequence = torch.tensor([reply["output_ids"]], dtype=inputs.dtype)
        return Decoded(sequence, reply["seconds"], reply["acceptance_lengths"])
