"""Drafting one block for a target: context features in, a top-K lattice and a path out.

:class:`BlockDrafter` owns the drafter's context cache for one generation. Each call feeds the target's hidden states
of the tokens verified since the last call, drafts ``[anchor, mask, ...]`` in one drafter forward pass, reads the
drafted positions' logits through the target's LM head, keeps the top-K candidates and scores adjacent pairs with the
selector (DFlash 2), all in batched ops.
"""

from __future__ import annotations

import operator
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
        plain_fallback: decode plainly (one-token target steps) whenever drafting is measured slower than that,
            here and now, probing drafting again now and then (:class:`~dflash2_hf.planning.DraftingGuard`); so the
            call is never much slower than plain ``generate``. ``False`` drafts every cycle, whatever it costs; a
            :class:`~dflash2_hf.block_length.CycleCost` prices the steps by that cost model instead of timing them.
    """

    path: PathStrategy
    block_size: int
    top_k: int
    record_drafts: bool = False
    adaptive_block: object = False
    tree_nodes: int = 0
    lookup_tokens: int = 0
    plain_fallback: object = False

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
        plain_fallback: object = None,
        *,
        target: torch.nn.Module | None = None,
    ) -> DraftOptions:
        """Resolve options: the call's value, else the drafter config's; validated.

        ``tree_nodes`` or ``adaptive_block`` set alone by the call drops the other's config default (a tree of that
        size; one cost-cut path); set together they give a cost-sized tree. ``lookup_tokens`` needs a tree: set by
        the call without one it is refused; the config's default applies to trees only.

        Sizes must be integers (a bool, float or string is refused rather than rounded). ``top_k`` is at most the
        vocabulary (the target's LM-head rows, else the drafter config's ``vocab_size``); ``tree_nodes`` at most the
        branches the lattice of ``block_size - 1`` drafted positions by ``top_k`` candidates holds; with ``target``,
        the tree and the lookup branch, verified in one forward with their anchor, at most the target's context
        (``max_position_embeddings``). So an absurd size fails here instead of allocating its tensors.
        """
        config = drafter.config
        vocab_size = config.vocab_size if target is None else target.get_output_embeddings().weight.shape[0]
        context_length = None if target is None else getattr(
            target.config.get_text_config(), "max_position_embeddings", None)
        fallback = PathStrategy.GREEDY if config.is_dflash2 else PathStrategy.ARGMAX
        path = _first_set(path, config.default_path_strategy, fallback)
        try:
            path = PathStrategy(path)
        except ValueError:
            raise ValueError(f"Unknown path strategy {path!r}; choose one of {[s.value for s in PathStrategy]}.") from None
        if path is not PathStrategy.ARGMAX and not config.is_dflash2:
            raise ValueError(f"Path strategy {path.value!r} needs a DFlash 2 drafter; this DFlash v1 drafter supports 'argmax'.")
        block_size = _integer("block_size", _first_set(block_size, config.block_size))
        if not 2 <= block_size <= config.block_size:
            raise ValueError(f"block_size must be between 2 and the drafter's {config.block_size}, got {block_size}.")
        top_k = _integer("top_k", _first_set(top_k, config.selector_top_k))
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}.")
        if vocab_size is not None and top_k > vocab_size:
            raise ValueError(f"top_k (candidates kept per drafted position) must be at most the vocabulary size, "
                             f"{vocab_size}; got {top_k}. Lower dflash_top_k.")
        if tree_nodes is not None and adaptive_block is None:
            adaptive_block = False
        if adaptive_block not in (None, False) and tree_nodes is None:
            tree_nodes = 0
        adaptive_block = _first_set(adaptive_block, config.default_adaptive_block)
        if not (isinstance(adaptive_block, bool) or all(
                callable(getattr(adaptive_block, method, None)) for method in ("verified_length", "worthwhile_size"))):
            raise ValueError("adaptive_block must be True, False or a CycleCost (an object with verified_length() and "
                             f"worthwhile_size()); got {adaptive_block!r}.")
        tree_nodes = _integer("tree_nodes", _first_set(tree_nodes, config.default_tree_nodes))
        if tree_nodes < 0:
            raise ValueError(f"tree_nodes must be >= 0 (0: one path), got {tree_nodes}.")
        branches = sum(top_k**depth for depth in range(1, block_size))
        if tree_nodes > branches:
            raise ValueError(f"tree_nodes must be at most {branches}, the branches a lattice of {block_size - 1} "
                             f"drafted positions by {top_k} candidates holds; got {tree_nodes}. Lower "
                             "dflash_tree_nodes, or raise dflash_top_k or dflash_block_size.")
        if tree_nodes:
            lookup_tokens = _first_set(lookup_tokens, config.default_lookup_tokens)
        lookup_tokens = 0 if lookup_tokens is None else _integer("lookup_tokens", lookup_tokens)
        if lookup_tokens < 0:
            raise ValueError(f"lookup_tokens must be >= 0 (0: none), got {lookup_tokens}.")
        if lookup_tokens and not tree_nodes:
            raise ValueError("lookup_tokens adds a branch to a token tree; set tree_nodes > 0 as well (one path "
                             "cannot carry a second guess).")
        width = 1 + tree_nodes + lookup_tokens
        if tree_nodes and context_length is not None and width > context_length:
            raise ValueError(f"A tree of {tree_nodes} nodes and a lookup branch of {lookup_tokens} tokens are verified "
                             f"with their anchor in one target forward of {width} tokens, more than the target's "
                             f"context of {context_length} (max_position_embeddings). Lower dflash_tree_nodes or "
                             "dflash_lookup_tokens.")
        plain_fallback = _first_set(plain_fallback, config.default_plain_fallback)
        if not (isinstance(plain_fallback, bool) or callable(getattr(plain_fallback, "cycle_seconds", None))):
            raise ValueError("plain_fallback must be True, False or a CycleCost (an object with cycle_seconds() and "
                             f"verify_seconds); got {plain_fallback!r}.")
        return cls(path=path, block_size=block_size, top_k=top_k, record_drafts=bool(record_drafts),
                   adaptive_block=adaptive_block, tree_nodes=tree_nodes, lookup_tokens=lookup_tokens,
                   plain_fallback=plain_fallback)


def _first_set(*values):
    return next(value for value in values if value is not None)


def _integer(name: str, value: object) -> int:
    """``value`` as an ``int``: Python, NumPy and torch integers pass; a bool, float or string is refused instead of
    silently rounded or read as 0/1."""
    if not (isinstance(value, bool) or getattr(value, "dtype", None) is torch.bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__}).")


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
