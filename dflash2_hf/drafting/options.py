"""The per-call drafting options, resolved against the drafter config's defaults and checked by rule, once.

:class:`DraftOptions` resolves the ``dflash_*`` options of one call (path, block size, candidates, tree, copied
branch, cost cut, plain fallback, packed linears, exactness) against the drafter config's defaults and checks them by
rule (types, ranges, bounds by vocabulary, block size and context) before any forward. The cycle's steps (the block
drafter, the cycle cost, the loop) read them from here.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from ..modeling import DFlashDraftModel
from .lattice import PathStrategy

#: The greedy-decoding promises a call can ask for (:mod:`~dflash2_hf.generation.exact_widths`): identical except
#: where two logits tie within float rounding (the default), or plain decoding's tokens bit for bit.
EXACTNESS = ("rounding", "bitwise")


#: The plan measured best for a CPU-trained drafter (docs/results.md): a token tree of up to 8 drafted tokens sized
#: every cycle by the measured cost, with a branch of up to 8 tokens copied from the context. What ``train`` and
#: ``export`` write into a drafter config that sets no plan of its own.
RECOMMENDED_PLAN = {"default_tree_nodes": 8, "default_adaptive_block": True, "default_lookup_tokens": 8}
#: A config's plan fields at their class defaults: one path, no tree, no copied branch.
BARE_PLAN = {"default_tree_nodes": 0, "default_adaptive_block": False, "default_lookup_tokens": 0}


def with_recommended_plan(config) -> bool:
    """Give a drafter config that sets the bare plan (:data:`BARE_PLAN`) the recommended one, its tree cut to the
    branches its lattice holds; whether it was changed. A config with a plan of its own keeps it."""
    if any(getattr(config, name) != value for name, value in BARE_PLAN.items()):
        return False
    branches = sum(config.selector_top_k**depth for depth in range(1, min(config.block_size, 4)))  # enough to cap 8
    for name, value in RECOMMENDED_PLAN.items():
        setattr(config, name, min(value, branches) if name == "default_tree_nodes" else value)
    return True


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
            paying for its cost (:mod:`dflash2_hf.cost.cycle_cost`): ``True`` uses this machine's measured (and cached)
            cycle cost; a :class:`~dflash2_hf.cost.cycle_cost.CycleCost` (or any object with its ``verified_length``
            and ``worthwhile_size``) is used as given.
        tree_nodes: when > 0, verify a token tree of at most this many drafted tokens in one target forward
            instead of one path (:mod:`dflash2_hf.drafting.tree`): greedy decoding takes the likeliest nodes, sampling merges
            independently drawn paths; 0 verifies one path. With ``adaptive_block`` the tree is sized per cycle by
            the cycle cost, up to this many nodes.
        lookup_tokens: with a token tree, also verify up to this many tokens copied from the context, the ones that
            followed the latest earlier occurrence of the last few tokens (:mod:`dflash2_hf.drafting.lookup`), as one
            more branch of the tree; 0: none.
        plain_fallback: decode plainly (one-token target steps) whenever drafting is measured slower than that,
            here and now, probing drafting again now and then (:class:`~dflash2_hf.cost.guard.DraftingGuard`); so the
            call is never much slower than plain ``generate``. Greedy decoding times the steps; sampling prices them
            by this machine's measured, cached cycle cost, so a seed gives the same text from run to run. ``False``
            drafts every cycle, whatever it costs; a :class:`~dflash2_hf.cost.cycle_cost.CycleCost` prices the steps
            by that cost model.
        packed_linears: on a CPU, run both models' linears on oneDNN-packed weights for the call
            (:func:`~dflash2_hf.cpu.kernels.packed_for_the_call`: float32, or bf16 where packing changes no result;
            packed once, reused by later calls); ``False`` runs them as they are.
        exactness: what greedy decoding of a float32/float64 target promises (:mod:`~dflash2_hf.generation.exact_widths`):
            ``"rounding"`` (default) verifies at any width: the output is plain decoding's wherever the target's
            choice is clear, and may part from it only where two logits tie within float rounding
            (:mod:`~dflash2_hf.measuring.greedy_difference` shows which); ``"bitwise"``, the strict opt-in, gives
            plain decoding's tokens bit for bit by verifying only at widths this machine computes as one-token
            forwards (measured; none: the call decodes plainly and warns).
    """

    path: PathStrategy
    block_size: int
    top_k: int
    record_drafts: bool = False
    adaptive_block: object = False
    tree_nodes: int = 0
    lookup_tokens: int = 0
    plain_fallback: object = False
    packed_linears: bool = True
    exactness: str = "rounding"

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
        packed_linears: bool | None = None,
        exactness: str | None = None,
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
        path = _resolved_path(config, path)
        block_size, top_k = _resolved_block(config, block_size, top_k, _vocabulary_size(config, target))
        adaptive_block, tree_nodes = _resolved_tree(config, adaptive_block, tree_nodes, block_size, top_k)
        lookup_tokens = _resolved_lookup(config, lookup_tokens, tree_nodes)
        _check_fits_context(tree_nodes, lookup_tokens, target)
        return cls(path=path, block_size=block_size, top_k=top_k, record_drafts=_flag("record_drafts", record_drafts),
                   adaptive_block=adaptive_block, tree_nodes=tree_nodes, lookup_tokens=lookup_tokens,
                   plain_fallback=_resolved_fallback(config, plain_fallback),
                   packed_linears=_flag("packed_linears", _first_set(packed_linears, True)),
                   exactness=_resolved_exactness(exactness))


def _vocabulary_size(config, target: torch.nn.Module | None) -> int:
    """The vocabulary candidates come from: the drafter's draft vocabulary, else the target's LM-head rows, else the
    drafter config's ``vocab_size``."""
    if getattr(config, "draft_vocab_size", None) is not None:
        return config.draft_vocab_size
    return config.vocab_size if target is None else target.get_output_embeddings().weight.shape[0]


def _resolved_path(config, path: str | None) -> PathStrategy:
    """The call's path strategy, else the config's, else greedy (DFlash 2) or argmax (DFlash v1)."""
    fallback = PathStrategy.GREEDY if config.is_dflash2 else PathStrategy.ARGMAX
    path = _first_set(path, config.default_path_strategy, fallback)
    try:
        path = PathStrategy(path)
    except ValueError:
        raise ValueError(f"Unknown path strategy {path!r}; choose one of {[s.value for s in PathStrategy]}.") from None
    if path is not PathStrategy.ARGMAX and not config.is_dflash2:
        raise ValueError(f"Path strategy {path.value!r} needs a DFlash 2 drafter; this DFlash v1 drafter supports 'argmax'.")
    return path


def _resolved_block(config, block_size: int | None, top_k: int | None,
                    vocab_size: int | None) -> tuple[int, int]:
    """Tokens per block (2 up to the drafter's trained block) and candidates per position (1 up to the vocabulary)."""
    block_size = _integer("block_size", _first_set(block_size, config.block_size))
    if not 2 <= block_size <= config.block_size:
        raise ValueError(f"block_size must be between 2 and the drafter's {config.block_size}, got {block_size}.")
    source = _source("top_k", top_k, "selector_top_k")
    top_k = _integer("top_k", _first_set(top_k, config.selector_top_k))
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k} from {source}.")
    if vocab_size is not None and top_k > vocab_size:
        raise ValueError(f"top_k (candidates kept per drafted position) must be at most the vocabulary size, "
                         f"{vocab_size}; got {top_k} from {source}. Pass a smaller dflash_top_k.")
    return block_size, top_k


def _source(option: str, call_value: object, config_field: str) -> str:
    """Where a resolved option came from, for its error message: the call's ``dflash_<option>``, else the drafter
    config's field (which the call can override)."""
    if call_value is not None:
        return f"dflash_{option}"
    return f"the drafter config's {config_field}"


def _resolved_tree(config, adaptive_block: object, tree_nodes: int | None, block_size: int,
                   top_k: int) -> tuple[object, int]:
    """The cost cut and the tree size. Set alone by the call, either drops the other's config default; a tree holds
    at most the branches of a lattice of ``block_size - 1`` positions by ``top_k`` candidates."""
    if tree_nodes is not None and adaptive_block is None:
        adaptive_block = False
    if adaptive_block not in (None, False) and tree_nodes is None:
        tree_nodes = 0
    adaptive_block = _first_set(adaptive_block, config.default_adaptive_block)
    if not (isinstance(adaptive_block, bool) or all(
            callable(getattr(adaptive_block, method, None)) for method in ("verified_length", "worthwhile_size"))):
        raise ValueError("adaptive_block must be True, False or a CycleCost (an object with verified_length() and "
                         f"worthwhile_size()); got {adaptive_block!r}.")
    source = _source("tree_nodes", tree_nodes, "default_tree_nodes")
    tree_nodes = _integer("tree_nodes", _first_set(tree_nodes, config.default_tree_nodes))
    if tree_nodes < 0:
        raise ValueError(f"tree_nodes must be >= 0 (0: one path), got {tree_nodes} from {source}.")
    branches = sum(top_k**depth for depth in range(1, block_size))
    if tree_nodes > branches:
        raise ValueError(f"tree_nodes must be at most {branches}, the branches a lattice of {block_size - 1} "
                         f"drafted positions by {top_k} candidates holds; got {tree_nodes} from {source}. Pass a "
                         "smaller dflash_tree_nodes, or a larger dflash_top_k or dflash_block_size.")
    return adaptive_block, tree_nodes


def _resolved_lookup(config, lookup_tokens: int | None, tree_nodes: int) -> int:
    """Tokens copied from the context as one more tree branch: the config's default applies to trees only, and the
    call's value needs a tree."""
    if tree_nodes:
        lookup_tokens = _first_set(lookup_tokens, config.default_lookup_tokens)
    lookup_tokens = 0 if lookup_tokens is None else _integer("lookup_tokens", lookup_tokens)
    if lookup_tokens < 0:
        raise ValueError(f"lookup_tokens must be >= 0 (0: none), got {lookup_tokens}.")
    if lookup_tokens and not tree_nodes:
        raise ValueError("lookup_tokens adds a branch to a token tree; set tree_nodes > 0 as well (one path "
                         "cannot carry a second guess).")
    return lookup_tokens


def _check_fits_context(tree_nodes: int, lookup_tokens: int, target: torch.nn.Module | None) -> None:
    """Refuse a tree and lookup branch that, verified with their anchor in one forward, outgrow the target's context."""
    text_config = None if target is None else target.config.get_text_config()
    context_length = getattr(text_config, "max_position_embeddings", None)
    width = 1 + tree_nodes + lookup_tokens
    if tree_nodes and context_length is not None and width > context_length:
        raise ValueError(f"A tree of {tree_nodes} nodes and a lookup branch of {lookup_tokens} tokens are verified "
                         f"with their anchor in one target forward of {width} tokens, more than the target's "
                         f"context of {context_length} (max_position_embeddings). Lower dflash_tree_nodes or "
                         "dflash_lookup_tokens.")


def _resolved_fallback(config, plain_fallback: object) -> object:
    """Whether (and by what cost model) to fall back to plain steps where drafting does not pay."""
    plain_fallback = _first_set(plain_fallback, config.default_plain_fallback)
    if not (isinstance(plain_fallback, bool) or callable(getattr(plain_fallback, "cycle_seconds", None))):
        raise ValueError("plain_fallback must be True, False or a CycleCost (an object with cycle_seconds() and "
                         f"verify_seconds); got {plain_fallback!r}.")
    return plain_fallback


def _resolved_exactness(exactness: str | None) -> str:
    """The call's greedy-decoding promise, ``"rounding"`` unless it asks for ``"bitwise"``."""
    exactness = _first_set(exactness, "rounding")
    if exactness not in EXACTNESS:
        raise ValueError(f"exactness must be one of 'bitwise', 'rounding', got {exactness!r}.")
    return exactness


def _first_set(*values):
    return next(value for value in values if value is not None)


def _flag(name: str, value: object) -> bool:
    """``value`` as a ``bool``: only ``True`` and ``False`` (Python, NumPy or a one-element torch bool) pass; a
    string such as ``"no"``, or a number, is refused instead of being read by its truthiness."""
    if isinstance(value, bool) or type(value).__name__ == "bool_" or (
            isinstance(value, torch.Tensor) and value.dtype is torch.bool and value.numel() == 1):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__}).")


def _integer(name: str, value: object) -> int:
    """``value`` as an ``int``: Python, NumPy and torch integers pass; a bool, float or string is refused instead of
    silently rounded or read as 0/1."""
    if not (isinstance(value, bool) or getattr(value, "dtype", None) is torch.bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__}).")
