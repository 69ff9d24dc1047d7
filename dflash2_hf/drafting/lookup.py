"""Context lookup: a second source of drafted tokens, copied from the text so far.

Answers often repeat what is already in the context (a function's name and arguments from the prompt, a variable
used a line above, a docstring's phrasing). Where the last few tokens occurred before, the tokens that followed them
then are a cheap guess at what follows now (the idea behind prompt-lookup decoding). A token tree can carry that
guess as one more branch next to the drafter's (:meth:`~dflash2_hf.drafting.tree.DraftTree.add_lookup_path`): the target
verifies both in the same forward pass, and the walk takes whichever branch it agrees with.

The guess depends on the verified tokens only, never on a drafted or random one, so adding it keeps greedy output
identical and sampled output exact (:func:`~dflash2_hf.generation.verification.verify_sampled`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_MAX_NGRAM = 8  # longest suffix matched (transformers' prompt lookup defaults to 2; see docs/results.md)
FORESIGHT_NGRAM = 3  # the shortest suffix match whose guess may end a plain-decoding pause
# The shortest suffix match whose copy a step without drafting verifies: after a one-token match a copied token is
# right about one time in five, too close to break-even for a cost model measured at another context length.
LOOKUP_CYCLE_NGRAM = 2


@dataclass
class CopiedBranch:
    """The context lookup's tokens for one cycle and the length of the suffix match they follow."""

    tokens: list[int] = field(default_factory=list)
    matched: int = 0

    def keep(self, count: int) -> None:
        """Keep the first ``count`` tokens only (the ones the cycle cost says pay)."""
        del self.tokens[count:]

    def accepted_of(self, emitted: list[int]) -> int:
        """How many of these tokens the cycle accepted: the ones that lead ``emitted`` (a copied token the target
        rejected is never emitted in its place: greedy emits another token, sampling draws from a residual that
        leaves it out)."""
        accepted = 0
        while accepted < min(len(self.tokens), len(emitted) - 1) and emitted[accepted] == self.tokens[accepted]:
            accepted += 1
        return accepted


def lookup_continuation(
    tokens: Sequence[int], length: int, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = 1
) -> list[int]:
    """Up to ``length`` tokens that followed the latest earlier occurrence of the sequence's last n tokens.

    The longest suffix (up to ``max_ngram`` tokens, at least ``min_ngram``) that occurred earlier wins; among its
    occurrences the latest one with at least one token after it (a longer match is the more specific precedent).
    Returns ``[]`` when no suffix recurs or ``length`` < 1. One pass over the text: each earlier occurrence of the
    last token is extended backwards.
    """
    return lookup_match(tokens, length, max_ngram, min_ngram)[0]


def lookup_match(
    tokens: Sequence[int], length: int, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = 1
) -> tuple[list[int], int]:
    """:func:`lookup_continuation` and the length of the suffix it matched (0 with no continuation): a longer match
    is the likelier to go on (:class:`LookupOdds`)."""
    if length < 1 or len(tokens) < 2:
        return [], 0
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
        return [], 0
    return tokens[best_next : best_next + length], best_size


#: (accepted, stopped) pseudo-counts per matched suffix length (5: five or more) that :class:`LookupOdds` starts
#: from: a per-token chance of 0.25, 0.6, 0.75, 0.75 and 0.9, about what SmolLM2-135M's greedy answers to HumanEval
#: and MT-Bench prompts show when every anchor is looked up (0.22-0.28 after a one-token match, 0.87-0.9 after five
#: or more). A few observations' weight: each generation's own outcomes soon outweigh them.
LOOKUP_PRIOR = {1: (1.0, 3.0), 2: (3.0, 2.0), 3: (3.0, 1.0), 4: (3.0, 1.0), 5: (9.0, 1.0)}


class LookupOdds:
    """How likely each copied token is to be accepted, by the length of the suffix the lookup matched, measured
    while generating.

    A looked-up branch is accepted token by token until the first miss, so each token is modelled as accepted with
    a chance ``c`` once the ones before it were, one ``c`` per matched length (1, 2, 3, 4, 5 or more tokens). Its
    estimate is accepted / (accepted + stops) over the branches verified so far, starting from :data:`LOOKUP_PRIOR`.
    ``gains`` gives what :meth:`~dflash2_hf.cost.cycle_cost.CycleCost.worthwhile_size` sizes a branch by. The odds
    depend on verified outcomes only, so sizing the branch by them keeps decoding exact.
    """

    LONGEST = max(LOOKUP_PRIOR)

    def __init__(self):
        self.counts = {matched: list(prior) for matched, prior in LOOKUP_PRIOR.items()}

    def chance(self, matched: int) -> float:
        """The estimated chance that a token copied after a ``matched``-token match is accepted (given the ones
        before it were); 0 with no match."""
        if matched < 1:
            return 0.0
        accepted, stopped = self.counts[min(matched, self.LONGEST)]
        return accepted / (accepted + stopped)

    def gains(self, matched: int, count: int) -> list[float]:
        """The expected extra accepted tokens of verifying each of ``count`` copied tokens in turn: ``c, c^2, ...``."""
        chance = self.chance(matched)
        return [chance**position for position in range(1, count + 1)]

    def record(self, matched: int, offered: int, accepted: int) -> None:
        """A branch of ``offered`` copied tokens after a ``matched``-token match had its first ``accepted`` accepted."""
        if matched < 1 or offered < 1:
            return
        counts = self.counts[min(matched, self.LONGEST)]
        counts[0] += accepted
        counts[1] += accepted < offered
