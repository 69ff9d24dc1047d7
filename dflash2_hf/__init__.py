"""dflash2-hf: DFlash 2 block-drafting speculative decoding for Hugging Face transformers.

Importing the package registers the drafter with the transformers Auto classes, so ``AutoConfig`` and ``AutoModel``
load saved drafter folders without ``trust_remote_code``, and lets ``target.generate(assistant_model=drafter)`` run
DFlash decoding, as does the public seam ``target.generate(custom_generate=dflash2_hf.custom_generate,
drafter=drafter)`` (see :mod:`dflash2_hf.generation.integration`).
"""

from transformers import AutoConfig, AutoModel

from . import _moved
from .cost.cycle_cost import CycleCost
from .drafting.lattice import PathStrategy
from .generation import integration
from .generation.integration import custom_generate
from .generation.stats import DFlashGenerateOutput, DFlashStats
from .modeling import (
    CandidateSelector,
    DFlash2DraftModel,
    DFlashConfig,
    DFlashDraftModel,
    DrafterLoadError,
)

AutoConfig.register(DFlashConfig.model_type, DFlashConfig, exist_ok=True)
AutoModel.register(DFlashConfig, DFlashDraftModel, exist_ok=True)
integration.install()
_moved.install()

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
    "custom_generate",
]
