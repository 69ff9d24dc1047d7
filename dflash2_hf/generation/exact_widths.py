"""Which verification widths give greedy decoding plain decoding's tokens bit for bit, measured on this machine.

A drafted cycle verifies the anchor and every drafted token in one target forward of many rows; plain decoding runs
one row per forward. Matrix kernels choose their blocking, and so the order in which they sum, by the number of rows,
so a row of a many-row forward can round differently from the same row alone (float32 on an AMD EPYC Zen 4 and an
Intel Xeon with AMX: every width from 2 up). Such a difference is far below any logit gap that matters, but where two
logits tie within it, greedy decoding with a drafter may pick the other token, and the outputs part ways.

By default (``exactness="rounding"``) a call verifies at any width: the output is then plain decoding's except
where two logits tie within float rounding. How large that rounding is here is measured too
(:func:`logit_rounding`: the largest logit difference between a verification forward's rows and one-token steps),
so that a difference from plain decoding can be shown to be such a tie
(:mod:`~dflash2_hf.measuring.greedy_difference`).

Greedy decoding in float32 (or float64) with ``exactness="bitwise"``, the strict opt-in, verifies only at widths
measured here to give every row, bit for bit, the logits a chain of one-token forwards gives it, for a drafted path
(causal mask) and for a branched tree (tree mask and positions): up to the widest width below which every width
passes. Where no width passes, the call decodes plainly, one token per forward, and says so once.

The measurement runs the target itself, under the call's kernels (packed linears, grouped attention), on random
tokens after a short random context; it is kept per target, dtype, device, thread count and kernel setting, and it
stops at the first width that fails (on the CPUs above: the first one, three forwards).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
import weakref

import torch
from transformers import DynamicCache

from ..cpu.kernels import linears_packed
from ..drafting.tree import DraftTree
from ..drafting.options import DraftOptions

#: Dtypes whose greedy output is promised identical to plain decoding's (bf16's is not: docs/generation.md).
EXACT_DTYPES = (torch.float32, torch.float64)
PROBE_CONTEXT = 24
PLAIN_DECODING = (
    "Decoding plainly (one token per target forward): on this machine a {dtype} target forward over 2 or more "
    "tokens rounds some logits unlike one-token forwards (measured), so verifying a draft could break a near-tie "
    "differently from plain decoding, and this call asked for dflash_exactness='bitwise'. The default, "
    "dflash_exactness='rounding' (command line: leave out --exactness bitwise), drafts: the output is then plain "
    "decoding's except where two logits tie within float rounding."
)

#: Per target, per (dtype, device, threads, kernel setting): the widest exact verification width measured (and
#: whether the next one failed), and the logit rounding measured (keys starting with ``"rounding"``).
_MEASURED: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, object]] = weakref.WeakKeyDictionary()


def bitwise_rule_applies(target: torch.nn.Module, options: DraftOptions, do_sample: bool) -> bool:
    """Whether this call's verification widths must be measured: greedy decoding of a float32/float64 target with
    ``exactness="bitwise"``. Sampling promises the target's distribution, not bits; bf16 promises no identity."""
    return options.exactness == "bitwise" and not do_sample and target.dtype in EXACT_DTYPES


def plain_decoding_only(target: torch.nn.Module, options: DraftOptions, do_sample: bool) -> bool:
    """Whether the call drafts nothing, known before its kernels are set up: the rule applies and the target, as it
    is, computes not even a 2-token forward as one-token steps. Such a call then runs plain decoding on the models
    as they are (no packed weights, no drafter copy), at plain decoding's speed."""
    return bitwise_rule_applies(target, options, do_sample) and exact_verify_width(target, 2) < 2


def exact_options(target: torch.nn.Module, options: DraftOptions,
                  do_sample: bool) -> tuple[DraftOptions | None, int | None]:
    """The call's options cut to the widest verification this machine computes as one-token steps, and that width;
    ``None`` options (decode plainly, with a warning) where not even two tokens are; the options as given and no
    width where the rule does not apply. Run under the call's kernels (packed linears, grouped attention)."""
    if not bitwise_rule_applies(target, options, do_sample):
        return options, None
    widest = max(options.block_size, options.tree_nodes + options.lookup_tokens + 1)
    width = exact_verify_width(target, widest)
    if width < 2:
        warnings.warn(PLAIN_DECODING.format(dtype=str(target.dtype).removeprefix("torch.")), stacklevel=2)
        return None, width
    if width >= widest:
        return options, width
    tree_nodes = min(options.tree_nodes, width - 1)
    lookup_tokens = min(options.lookup_tokens, width - 1 - tree_nodes) if tree_nodes else 0
    return dataclasses.replace(options, block_size=min(options.block_size, width), tree_nodes=tree_nodes,
                               lookup_tokens=lookup_tokens), width


def exact_verify_width(target: torch.nn.Module, widest: int) -> int:
    """The widest verification forward (anchor included, at most ``widest``) such that every width from 2 to it gives
    each row the logits one-token forwards give, bit for bit; 1 where width 2 already differs. Measured once per
    target and setting, widening as calls need."""
    key = (target.dtype, target.device, torch.get_num_threads(), linears_packed(target),
           getattr(target.config, "_attn_implementation", None))
    known = _MEASURED.setdefault(target, {})
    width, failed = known.get(key, (1, False))  # the widest width passing so far; whether the next one failed
    while not failed and width < widest:
        if rows_as_alone(target, width + 1):
            width += 1
        else:
            failed = True
    known[key] = (width, failed)
    return min(width, widest)


def rows_as_alone(target: torch.nn.Module, width: int) -> bool:
    """Whether a verification forward of ``width`` tokens gives every row the logits a chain of one-token forwards
    gives it, for a drafted path (causal mask) and, from 3 tokens, a branched tree (tree mask and positions)."""
    generator = torch.Generator().manual_seed(width)
    vocabulary = target.get_input_embeddings().weight.shape[0]
    tokens = torch.randint(vocabulary, (PROBE_CONTEXT + width,), generator=generator).tolist()
    context, anchor, drafted = tokens[:PROBE_CONTEXT], tokens[PROBE_CONTEXT], tokens[PROBE_CONTEXT + 1:]
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        _forward(target, context, cache)
        trees = [_chain(drafted)] + ([_branched(drafted)] if len(drafted) >= 2 else [])
        return all(_tree_rows_as_alone(target, cache, anchor, tree) for tree in trees)


def _chain(tokens: list[int]) -> DraftTree:
    tree = DraftTree()
    tree.add_path(tokens)
    return tree


def _branched(tokens: list[int]) -> DraftTree:
    """A tree of these tokens with two branches below the anchor (node ``i``'s parent: node ``i - 2``)."""
    return DraftTree(tokens=list(tokens), parents=[node - 2 if node >= 2 else -1 for node in range(len(tokens))])


def _tree_rows_as_alone(target, cache, anchor: int, tree: DraftTree) -> bool:
    """One forward over the anchor and the tree (as the decoding loop runs it) against one-token forwards down each
    of its branches, from copies of the same context cache."""
    past = cache.get_seq_length()
    together_cache = copy.deepcopy(cache)
    if tree.is_chain():
        together = _forward(target, [anchor] + tree.tokens, together_cache)
    else:
        together = _forward(target, [anchor] + tree.tokens, together_cache,
                            attention_mask=tree.attention_mask(past, target.dtype).to(target.device),
                            position_ids=tree.position_ids(past).to(target.device))
    for leaf in sorted(set(range(len(tree))) - set(tree.parents)):
        branch = tree.branch(leaf)
        alone_cache = copy.deepcopy(cache)
        alone = [_forward(target, [token], alone_cache)[0] for token in [anchor] + [tree.tokens[n] for n in branch]]
        rows = [0] + [1 + node for node in branch]
        if not all(torch.equal(together[row], logits) for row, logits in zip(rows, alone, strict=True)):
            return False
    return True


def logit_rounding(target: torch.nn.Module, widest: int) -> float:
    """The largest difference between a logit of a verification forward's row and the same logit from one-token
    steps, over widths 2 to ``widest``, on this machine, under the target's kernels as they are now. Each width runs
    two blocks in a row, the second on the cache the first filled, so the figure includes what a drafted cache's own
    rounding adds to later logits. Measured once per target and setting (random tokens after a short random context)
    and again only for a wider ``widest``."""
    key = ("rounding", widest, target.dtype, target.device, torch.get_num_threads(), linears_packed(target),
           getattr(target.config, "_attn_implementation", None))
    known = _MEASURED.setdefault(target, {})
    if key not in known:
        known[key] = _blocks_against_steps(target, widest)
    return known[key]


def _blocks_against_steps(target: torch.nn.Module, widest: int) -> float:
    """For every width from 2 to ``widest``: the largest logit difference between two ``width``-token forwards in a
    row and the same tokens one at a time, after a shared context (one chain of one-token steps serves every
    width)."""
    generator = torch.Generator().manual_seed(widest)
    vocabulary = target.get_input_embeddings().weight.shape[0]
    tokens = torch.randint(vocabulary, (PROBE_CONTEXT + 2 * widest,), generator=generator).tolist()
    context, drafted = tokens[:PROBE_CONTEXT], tokens[PROBE_CONTEXT:]
    cache = DynamicCache(config=target.config)
    largest = 0.0
    with torch.no_grad():
        _forward(target, context, cache)
        alone_cache = copy.deepcopy(cache)
        alone = torch.cat([_forward(target, [token], alone_cache) for token in drafted]).double()
        for width in range(2, widest + 1):
            together_cache = copy.deepcopy(cache)
            together = torch.cat([_forward(target, drafted[start:start + width], together_cache)
                                  for start in (0, width)]).double()
            largest = max(largest, float((together - alone[:2 * width]).abs().max()))
    return largest


def _forward(target, tokens: list[int], cache, **kwargs) -> torch.Tensor:
    """The target's logits ``[len(tokens), vocabulary]`` for these tokens after what ``cache`` holds."""
    input_ids = torch.tensor([tokens], device=target.device)
    return target(input_ids=input_ids, cache=cache, use_cache=True, **kwargs).logits[0]
