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


def lookup_continuation(tokens: Sequence[int], length: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``length`` tokens that followed the latest earlier occurrence of the sequence's last n tokens.

    The longest suffix (``max_ngram`` down to ``min_ngram`` tokens) that occurred earlier wins; among its occurrences
    the latest one with at least one token after it. Returns ``[]`` when no suffix recurs or ``length`` < 1.
    """
    if length < 1:
        return []
    tokens = list(tokens)
    end = len(tokens)
    for size in range(min(max_ngram, end - 1), min_ngram - 1, -1):
        suffix = tokens[end - size :]
        for start in range(end - size - 1, -1, -1):  # latest first; the suffix itself (start = end - size) excluded
            if tokens[start : start + size] == suffix:
                return tokens[start + size : start + size + length]
    return []
