"""Whether greedy output with a drafter parts from plain decoding's only where the target's choice was a near-tie.

A verification forward computes many rows at once; plain decoding computes one. The kernels round the two
differently (:mod:`~dflash2_hf.generation.exact_widths` measures by how much), so where the target's two best
logits lie within that rounding of each other, a verified draft may take the other one, and the outputs part ways
there. Anywhere else the target's choice is clear, and a difference is a bug.

:func:`compare_greedy` tells the three apart. It finds the first new token where the two outputs differ, decodes
plainly once more up to it to read plain decoding's logits there, and compares the gap between plain decoding's
choice and the drafted run's choice with a bound: ``2 * ROUNDING_MARGIN`` times the largest logit rounding measured
on this machine for this target (unpacked and on packed linears, the larger), since each of the two logits can move
by up to that rounding. The outcome is ``identical``, ``near-tie`` or ``clear`` (a bug).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

from ..cpu.kernels import PackedLinears, linears_packed
from ..generation.exact_widths import logit_rounding

#: How much larger than the rounding measured on random tokens a near-tie's gap may be: real prompts and longer
#: drafted caches round somewhat more than the probe's two blocks.
ROUNDING_MARGIN = 4.0
#: The widest verification forward the default plan runs (anchor, a tree of 8 and a copied branch of 8).
DEFAULT_WIDEST = 17
OUTCOMES = ("identical", "near-tie", "clear")


@dataclass(frozen=True)
class GreedyDifference:
    """How a greedy output compares with plain decoding's: ``outcome`` (one of :data:`OUTCOMES`) and, where they
    differ, the first differing new token's ``position``, ``gap`` (plain decoding's logit of its own choice minus
    its logit of the drafted run's choice there; its top-2 gap when the drafted run took the runner-up), ``top2_gap``
    and the near-tie ``bound`` it was judged against. A difference where one output had already ended is ``clear``
    with no gap."""

    outcome: str
    position: int | None = None
    gap: float | None = None
    top2_gap: float | None = None
    bound: float | None = None

    @property
    def explained(self) -> bool:
        """Identical, or parted at a near-tie: what the default promises."""
        return self.outcome != "clear"

    def describe(self) -> str:
        """One line for a person: identical, or where and why the outputs part."""
        if self.outcome == "identical":
            return "identical"
        if self.gap is None:
            return (f"DIFFERS at new token {self.position}, where one output had ended and the other went on: a bug "
                    "(please report it)")
        figures = f"gap {self.gap:.3g} between the two choices, top-2 gap {self.top2_gap:.3g}, bound {self.bound:.3g}"
        if self.outcome == "near-tie":
            return f"differs from new token {self.position} on, at a near-tie of plain decoding's logits ({figures})"
        return f"DIFFERS at new token {self.position}, where the target's choice was clear ({figures}): a bug"

    def to_json(self) -> dict:
        return asdict(self)


def near_tie_bound(target: torch.nn.Module, widest: int = DEFAULT_WIDEST) -> float:
    """The largest gap between two logits that rounding can close here: ``2 * ROUNDING_MARGIN`` times the logit
    rounding measured up to ``widest`` rows, as the target's linears are and, where they are not packed already and
    this CPU packs them, on packed linears (a ``generate`` call with a drafter packs them by default)."""
    roundings = [logit_rounding(target, widest)]
    if not linears_packed(target):
        try:
            packed = PackedLinears(target)
        except ValueError:  # this CPU or dtype does not pack: calls run unpacked
            packed = None
        if packed is not None:
            with packed:
                roundings.append(logit_rounding(target, widest))
    return 2 * ROUNDING_MARGIN * max(roundings)


def first_difference(ours: list[int], plain: list[int]) -> int | None:
    """The first new-token position where the two outputs differ (one ending before the other included); ``None``
    where they are the same."""
    for position, (mine, theirs) in enumerate(zip(ours, plain)):
        if mine != theirs:
            return position
    return None if len(ours) == len(plain) else min(len(ours), len(plain))


def compare_greedy(target: torch.nn.Module, inputs: Mapping | torch.Tensor, ours: list[int], plain: list[int],
                   widest: int = DEFAULT_WIDEST) -> GreedyDifference:
    """How greedy output ``ours`` (new tokens) compares with plain decoding's ``plain`` (new tokens) for ``inputs``
    (``input_ids``, or the keyword arguments of ``generate``): see the module docstring. Decodes plainly once more
    only where the outputs differ."""
    position = first_difference(ours, plain)
    if position is None:
        return GreedyDifference("identical")
    bound = near_tie_bound(target, widest)
    if position >= min(len(ours), len(plain)):
        return GreedyDifference("clear", position, bound=bound)
    scores = plain_scores_at(target, inputs, position)
    top2 = scores.topk(2).values
    gap = float(scores[plain[position]] - scores[ours[position]])
    outcome = "near-tie" if gap <= bound else "clear"
    return GreedyDifference(outcome, position, gap, float(top2[0] - top2[1]), bound)


def plain_scores_at(target: torch.nn.Module, inputs: Mapping | torch.Tensor, position: int) -> torch.Tensor:
    """Plain greedy decoding's scores (the logits it chose from) at new token ``position``, as one float64 row."""
    kwargs = {"input_ids": inputs} if isinstance(inputs, torch.Tensor) else dict(inputs)  # a BatchEncoding too
    with torch.no_grad():
        output = target.generate(**kwargs, max_new_tokens=position + 1, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
    return output.scores[position][0].double()


__all__ = ["DEFAULT_WIDEST", "OUTCOMES", "ROUNDING_MARGIN", "GreedyDifference", "compare_greedy", "first_difference",
           "near_tie_bound", "plain_scores_at"]
