"""Context lookup: a second source of drafted tokens, copied from the text so far.

Answers often repeat what is already in the context (a function's name and arguments from the prompt, a variable
used a line above, a docstring's phrasing). Where the last few tokens occurred before, the tokens that followed them
then are a cheap guess at what follows now (the idea behind prompt-lookup decoding). A token tree can carry that
guess as one more branch next to the drafter's (:meth:`~dflash2_hf.tree.DraftTree.add_lookup_path`): the target
verifies both in the same forward pass, and the walk takes whichever branch it agrees with.

The guess depends on the verified tokens only, never on a drafted or random one, so adding it keeps greedy output
identical and sampled output exact (:func:`~dflash2_hf.verification.verify_tree_sampled`).
"""

from __future__ import annotations

from collections.abc import Sequence


DEFAULT_MAX_NGRAM = 8  # longest suffix matched (transformers' prompt lookup defaults to 2; see docs/results.md)


def lookup_continuation(
    tokens: Sequence[int], length: int, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = 1
) -> list[int]:
    """Up to ``length`` tokens that followed the latest earlier occurrence of the sequence's last n tokens.

    The longest suffix (up to ``max_ngram`` tokens, at least ``min_ngram``) that occurred earlier wins; among its
    occurrences the latest one with at least one token after it (a longer match is the more specific precedent).
    Returns ``[]`` when no suffix recurs or ``length`` < 1. One pass over the text: each earlier occurrence of the
    last token is extended backwards.
    """
    if length < 1 or len(tokens) < 2:
        return []
    tokens = list(tokens)
    end = len(tokens)
    best_size, best_next = 0, 0
    for last in range(end - 2, -1, -1):  # where an occurrence would end, latest first; the text's own end excluded
        if tokens[last] != tokens[-1]:
            continue
        size = 1
        while size < max_ngram and size <= last and tokens[last - size] == tokens[end - 1 - size]:
            size += 1
        if size > best_size:
            best_size, best_next = size, last + 1
            if size == max_ngram:
                break
    if best_size < min_ngram:
        return []
    return tokens[best_next : best_next + length]
