"""What one ``generate`` call with a drafter did: its statistics, returned on the output like transformers' scores."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput


@dataclass
class DraftRecord:
    """One cycle's lattice, kept when ``dflash_record_drafts=True`` (for benchmarks: recall, oracle acceptance), and
    its ``path``: the drafted path the target verified (a one-branch tree's tokens), or for a branched tree the branch
    the target accepted."""

    anchor_position: int
    candidate_ids: torch.Tensor  # [L, K], best drafter logit first
    path: list[int]


@dataclass
class DFlashStats:
    """What one ``generate`` call did.

    ``acceptance_lengths[c]`` counts the tokens cycle ``c`` emitted: the accepted drafted tokens plus the target's own
    token (correction or bonus), as the published DFlash figures count them; the first token, which comes from the
    prefill, is not part of any cycle. ``verified_lengths[c]`` counts the drafted tokens cycle ``c`` sent to the
    target (fewer than ``block_size - 1`` when the adaptive block length cut the path, or near ``max_new_tokens``).
    ``plain_steps`` counts the one-token steps taken where drafting did not pay (``dflash_plain_fallback``); they are
    not cycles. ``lookup_cycles`` counts the cycles that verified tokens copied from the context alone, with no draft
    (taken instead of a plain step where the copy is priced to pay); they are in the per-cycle lists, not in
    ``plain_steps``. ``exact_width`` is the widest target forward (anchor included) this machine measured to compute
    as one-token steps, which greedy float32 decoding verified within (:mod:`~dflash2_hf.generation.exact_widths`;
    1: none, the call decoded plainly); ``None`` where the rule did not apply (sampling, bf16, ``exactness="rounding"``).
    """

    path: str
    block_size: int
    acceptance_lengths: list[int] = field(default_factory=list)
    verified_lengths: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    select_seconds: float = 0.0
    verify_seconds: float = 0.0
    plain_steps: int = 0
    lookup_cycles: int = 0
    drafts: list[DraftRecord] | None = None
    exact_width: int | None = None

    @property
    def cycles(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / self.cycles if self.cycles else 0.0

    @property
    def new_tokens(self) -> int:
        return sum(self.acceptance_lengths) + self.plain_steps + 1


@dataclass
class DFlashGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` with the call's :class:`DFlashStats` (``return_dict_in_generate=True``)."""

    dflash_stats: DFlashStats | None = None
