"""dflash2-hf: DFlash 2 block-drafting speculative decoding for Hugging Face transformers.

Importing the package registers the drafter with the transformers Auto classes, so ``AutoConfig`` and ``AutoModel``
load saved drafter folders without ``trust_remote_code``, and lets ``target.generate(assistant_model=drafter)`` run
DFlash decoding (see :mod:`dflash2_hf.hooks`).
"""

from transformers import AutoConfig, AutoModel

from . import hooks
from .block_length import CycleCost
from .decoding import DFlashGenerateOutput, DFlashStats
from .lattice import PathStrategy
from .modeling import (
    CandidateSelector,
    DFlash2DraftModel,
    DFlashConfig,
    DFlashDraftModel,
    DrafterLoadError,
)

AutoConfig.register(DFlashConfig.model_type, DFlashConfig, exist_ok=True)
AutoModel.register(DFlashConfig, DFlashDraftModel, exist_ok=True)
hooks.install()

__version__ = "0.1.0"

__all__ = [
    "CandidateSelector",
    "CycleCost",
    "DFlash2DraftModel",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashGenerateOutput",
    "DFlashStats",
    "DrafterLoadError",
    "PathStrategy",
    "__version__",
]
