"""The generation settings and prompts a DFlash call is refused for, checked once, before any forward.

:func:`check_generation_arguments` refuses the prompts and generation settings the decoder cannot honour exactly.
The per-call ``dflash_*`` options are :class:`~dflash2_hf.drafting.options.DraftOptions` (also importable from here).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from ..drafting.options import EXACTNESS, DraftOptions

__all__ = ["EXACTNESS", "UNSUPPORTED_OUTPUTS", "DraftOptions", "check_generation_arguments"]


UNSUPPORTED_OUTPUTS = ("output_attentions", "output_hidden_states")


def check_generation_arguments(
    generation_config: GenerationConfig, input_ids: torch.Tensor, context_length: int | None = None
) -> None:
    """Refuse, before any work, prompts and generation settings this decoder cannot honour exactly.

    ``context_length`` is the target's ``max_position_embeddings``: a longer prompt cannot be decoded faithfully.
    """
    batch_size, prompt_length = input_ids.shape
    if batch_size != 1:
        raise ValueError(f"DFlash decoding supports batch size 1 (one prompt per generate call); got {batch_size}.")
    if prompt_length == 0:
        raise ValueError("The prompt is empty: DFlash decoding needs at least one prompt token to draft from.")
    if context_length is not None and prompt_length >= context_length:
        raise ValueError(f"The prompt has {prompt_length} tokens; the target's context holds {context_length} "
                         "(max_position_embeddings). Shorten the prompt.")
    if generation_config.num_beams not in (None, 1):
        raise ValueError("DFlash decoding does not support beam search (num_beams > 1).")
    requested = [name for name in UNSUPPORTED_OUTPUTS if getattr(generation_config, name, False)]
    if requested:
        raise ValueError(f"DFlash decoding does not return {', '.join(requested)}; scores and logits are supported.")
    if generation_config.do_sample and (generation_config.temperature is None or generation_config.temperature <= 0):
        raise ValueError(f"temperature must be > 0 when sampling, got {generation_config.temperature}.")
    top_p = generation_config.top_p
    if generation_config.do_sample and top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    ngram = generation_config.max_matching_ngram_size
    if ngram is not None and (isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 1):
        raise ValueError(f"max_matching_ngram_size (the longest suffix the context lookup matches) must be an integer "
                         f">= 1, got {ngram!r}.")
