"""Drafting one block for a target: context features in, a top-K lattice and a path out.

:class:`BlockDrafter` owns the drafter's context cache for one generation. Each call feeds the target's hidden states
of the tokens verified since the last call, drafts ``[anchor, mask, ...]`` in one drafter forward pass, reads the
drafted positions' logits through the target's LM head, keeps the top-K candidates and scores adjacent pairs with the
selector (DFlash 2), all in batched ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .lattice import Lattice, PathStrategy, build_lattice, score_lattice
from .modeling import DFlashDraftModel


@dataclass(frozen=True)
class DraftOptions:
    """Per-call drafting settings.

    Attributes:
        path: how a path is picked through the lattice in greedy decoding. When sampling, ``argmax`` samples each
            position from the drafter's own top-K distribution (DFlash v1); every selector strategy samples the path
            from the selector's conditional distributions.
        block_size: tokens per block, anchor included (at most the drafter's trained ``block_size``).
        top_k: candidates kept per position.
        record_drafts: keep every cycle's lattice in the statistics (benchmarks).
        adaptive_block: verify each drafted path (or tree) only up to where an extra token's expected gain stops
            paying for its cost (:mod:`dflash2_hf.block_length`): ``True`` uses this machine's measured (and cached)
            cycle cost; a :class:`~dflash2_hf.block_length.CycleCost` (or any object with its ``verified_length``
            and ``worthwhile_size``) is used as given.
        tree_nodes: when > 0, verify a token tree of at most this many drafted tokens in one target forward
            instead of one path (:mod:`dflash2_hf.tree`): greedy decoding takes the likeliest nodes, sampling merges
            independently drawn paths; 0 verifies one path. With ``adaptive_block`` the tree is sized per cycle by
            the cycle cost, up to this many nodes.
        lookup_tokens: with a token tree, also verify up to this many tokens copied from the context, the ones that
            followed the latest earlier occurrence of the last few tokens (:mod:`dflash2_hf.context_lookup`), as one
            more branch of the tree; 0: none.
    """

    path: PathStrategy
    block_size: int
    top_k: int
    record_drafts: bool = False
    adaptive_block: object = False
    tree_nodes: int = 0
    lookup_tokens: int = 0

    @classmethod
    def for_drafter(
        cls,
        drafter: DFlashDraftModel,
        path: str | None = None,
        block_size: int | None = None,
        top_k: int | None = None,
        record_drafts: bool = False,
        adaptive_block: object = None,
        tree_nodes: int | None = None,
        lookup_tokens: int | None = None,
    ) -> DraftOptions:
        """Resolve options: the call's value, else the drafter config's; validated.

        ``tree_nodes`` or ``adaptive_block`` set alone by the call drops the other's config default (a tree of that
        size; one cost-cut path); set together they give a cost-sized tree. ``lookup_tokens`` needs a tree: set by
        the call without one it is refused; the config's default applies to trees only.
        """
        config = drafter.config
        fallback = PathStrategy.GREEDY if config.is_dflash2 else PathStrategy.ARGMAX
        path = _first_set(path, config.default_path_strategy, fallback)
        try:
            path = PathStrategy(path)
        except ValueError:
            raise ValueError(f"Unknown path strategy {path!r}; choose one of {[s.value for s in PathStrategy]}.") from None
        if path is not PathStrategy.ARGMAX and not config.is_dflash2:
            raise ValueError(f"Path strategy {path.value!r} needs a DFlash 2 drafter; this DFlash v1 drafter supports 'argmax'.")
        block_size = int(_first_set(block_size, config.block_size))
        if not 2 <= block_size <= config.block_size:
            raise ValueError(f"block_size must be between 2 and the drafter's {config.block_size}, got {block_size}.")
        top_k = int(_first_set(top_k, config.selector_top_k))
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}.")
        if tree_nodes is not None and adaptive_block is None:
            adaptive_block = False
        if adaptive_block not in (None, False) and tree_nodes is None:
            tree_nodes = 0
        adaptive_block = _first_set(adaptive_block, config.default_adaptive_block)
        if not (isinstance(adaptive_block, bool) or all(
                callable(getattr(adaptive_block, method, None)) for method in ("verified_length", "worthwhile_size"))):
            raise ValueError("adaptive_block must be True, False or a CycleCost (an object with verified_length() and "
                             f"worthwhile_size()); got {adaptive_block!r}.")
        tree_nodes = int(_first_set(tree_nodes, config.default_tree_nodes))
        if tree_nodes < 0:
            raise ValueError(f"tree_nodes must be >= 0 (0: one path), got {tree_nodes}.")
        if lookup_tokens is not None and lookup_tokens < 0:
            raise ValueError(f"lookup_tokens must be >= 0 (0: none), got {lookup_tokens}.")
        if lookup_tokens and not tree_nodes:
            raise ValueError("lookup_tokens adds a branch to a token tree; set tree_nodes > 0 as well (one path "
                             "cannot carry a second guess).")
        lookup_tokens = int(_first_set(lookup_tokens, config.default_lookup_tokens)) if tree_nodes else 0
        return cls(path=path, block_size=block_size, top_k=top_k, record_drafts=bool(record_drafts),
                   adaptive_block=adaptive_block, tree_nodes=tree_nodes, lookup_tokens=lookup_tokens)


def _first_set(*values):
    return next(value for value in values if value is not None)


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
        logits = self.drafter.compute_logits(hidden.to(self.output_embeddings.weight.dtype), self.output_embeddings)
        anchor = torch.tensor([anchor_id], device=logits.device)
        return build_lattice(logits.float(), anchor, self.options.top_k), hidden

    @torch.no_grad()
    def score(self, lattice: Lattice, hidden: torch.Tensor) -> Lattice:
        """Pair-score the lattice with the drafter's selector (a no-op for a drafter without one); a factorised
        selector reads its token codes from the target's input embeddings."""
        if self.drafter.candidate_selector is None:
            return lattice
        return score_lattice(lattice, self.drafter.candidate_selector, hidden, self.input_embeddings.weight)
