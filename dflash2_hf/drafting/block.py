"""Drafting one block for a target: context features in, a top-K lattice and a path out.

:class:`BlockDrafter` owns the drafter's context cache for one generation. Each call feeds the target's hidden states
of the tokens verified since the last call, drafts ``[anchor, mask, ...]`` in one drafter forward pass, reads the
drafted positions' logits through the target's LM head (or the drafter's own, over its draft vocabulary, whose
candidates are mapped back to target ids), keeps the top-K candidates and scores adjacent pairs with the
selector (DFlash 2), all in batched ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from ..modeling import DFlashDraftModel
from .lattice import Lattice, build_lattice, score_lattice

if TYPE_CHECKING:  # the options are resolved above this wing, in generation.config
    from .options import DraftOptions


class BlockDrafter:
    """Drafts blocks for one target during one generation, keeping the drafter's context cache in step."""

    def __init__(self, drafter: DFlashDraftModel, target: torch.nn.Module, options: DraftOptions):
        self.drafter = drafter
        self.options = options
        self.input_embeddings = target.get_input_embeddings()
        self.output_embeddings = target.get_output_embeddings()
        # Built from the drafter's config: its sliding-attention layers (if any) keep only their window. Past
        # recording holds the block's states until the crop after each draft.
        self.cache = DynamicCache(config=drafter.config)
        self.cache.activate_past_recording()
        self.block_template = torch.full((1, options.block_size), drafter.mask_token_id, device=drafter.device)

    @property
    def hidden_state_indices(self) -> list[int]:
        """Indices into the target's ``hidden_states`` tuple that the drafter reads (``layer id + 1``)."""
        return [layer + 1 for layer in self.drafter.target_layer_ids]

    def context_features(self, hidden_states: tuple[torch.Tensor, ...], rows: int | list[int]) -> torch.Tensor:
        """Concatenate the tapped layers' hidden states of the first ``rows`` processed tokens (or of the rows listed:
        the accepted branch of a token tree)."""
        select = (lambda states: states[:, :rows]) if isinstance(rows, int) else (lambda states: states[:, rows])
        parts = [select(hidden_states[index]) for index in self.hidden_state_indices]
        return torch.cat(parts, dim=-1).to(device=self.drafter.device, dtype=self.drafter.dtype)

    @torch.no_grad()
    def draft(self, context: torch.Tensor, anchor_id: int, anchor_position: int, length: int) -> tuple[Lattice, torch.Tensor]:
        """Draft a block after ``anchor_id`` (at ``anchor_position``) and return the lattice of its first ``length``
        drafted positions, with the drafter's hidden states of those positions.

        ``context`` holds the features of the tokens at ``anchor_position - context_len .. anchor_position - 1``, the
        ones the drafter has not seen yet.
        """
        block = self.block_template.clone()
        block[0, 0] = anchor_id
        embeds = self.input_embeddings(block).to(self.drafter.dtype) * float(self.drafter.config.input_embedding_scale)
        start = anchor_position - context.shape[1]
        positions = torch.arange(start, anchor_position + self.options.block_size, device=block.device)[None]
        output = self.drafter(embeds, context_hidden_states=context, position_ids=positions, cache=self.cache)
        self.cache.crop(-self.options.block_size)
        hidden = output.last_hidden_state[:, 1 : 1 + length]
        head_dtype = self.drafter.output_head(self.output_embeddings).weight.dtype
        logits = self.drafter.compute_logits(hidden.to(head_dtype), self.output_embeddings)
        anchor = torch.tensor([anchor_id], device=logits.device)
        lattice = build_lattice(logits.float(), anchor, self.options.top_k)
        lattice.candidate_ids = self.drafter.target_token_ids(lattice.candidate_ids)
        return lattice, hidden

    @torch.no_grad()
    def score(self, lattice: Lattice, hidden: torch.Tensor) -> Lattice:
        """Pair-score the lattice with the drafter's selector (a no-op for a drafter without one); a factorised
        selector reads its token codes from the target's input embeddings."""
        if self.drafter.candidate_selector is None:
            return lattice
        return score_lattice(lattice, self.drafter.candidate_selector, hidden, self.input_embeddings.weight)
