"""The drafter's configuration and model classes (also shipped as Hub remote code next to the weights)."""

from .configuration_dflash import DFLASH_FIELDS, DFlashConfig, spread_target_layer_ids
from .modeling_dflash import (
    CandidateSelector,
    DFlash2DraftModel,
    DFlashDraftModel,
    DFlashPreTrainedModel,
    DrafterLoadError,
    GroupedDynamicConv,
)

__all__ = [
    "CandidateSelector",
    "DFLASH_FIELDS",
    "DFlash2DraftModel",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashPreTrainedModel",
    "DrafterLoadError",
    "GroupedDynamicConv",
    "spread_target_layer_ids",
]
