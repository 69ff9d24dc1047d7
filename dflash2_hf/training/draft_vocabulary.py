"""A draft vocabulary: the target tokens a drafter drafts from, chosen by how often the target's own answers use them.

On a small target the LM head is most of a draft's arithmetic (SmolLM2: 49,152 rows of 576 against a few million
multiply-adds in the drafter's layers). A drafter with a draft vocabulary reads its logits from a head of its own over
the ``size`` most used tokens (rows of the target's head, copied) and maps its candidates back to target ids, so a
draft costs less. Verification is untouched: the target still verifies against its whole vocabulary, so greedy output
stays the target's and sampled output its distribution; a token outside the draft vocabulary is simply never drafted.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..modeling import DFlashDraftModel
from .data import check_token_ids, end_token_ids, read_responses


@dataclass
class DraftVocabulary:
    """The token ids a drafter drafts from, and how much of the answers they were chosen on they cover."""

    token_ids: torch.Tensor  # [size], sorted
    coverage: float  # share of the answers' tokens in the vocabulary
    answer_tokens: int  # tokens in the answers counted

    def describe(self) -> str:
        return (f"draft vocabulary of {self.token_ids.numel():,} tokens: {self.coverage:.1%} of the "
                f"{self.answer_tokens:,} answer tokens it was chosen on")


def draft_vocabulary_from_answers(target: torch.nn.Module, folders: list[str | os.PathLike], size: int) -> DraftVocabulary:
    """The ``size`` tokens the target's answers in ``folders`` (made by ``dflash2-hf data``) use most, its
    end-of-answer ids always among them."""
    records = read_responses(*folders)
    check_token_ids(records, target.get_output_embeddings().weight.shape[0], folders)
    return draft_vocabulary_of(target, records, size)


def draft_vocabulary_of(target: torch.nn.Module, records: list[dict], size: int) -> DraftVocabulary:
    """The ``size`` tokens the target's answers in ``records`` use most, its end-of-answer ids always among them."""
    counts = answer_token_counts(records, target.get_output_embeddings().weight.shape[0])
    token_ids = most_used_tokens(counts, size, always=sorted(end_token_ids(target)))
    return DraftVocabulary(token_ids, answer_coverage(counts, token_ids), int(counts.sum()))


def answer_token_counts(records: Iterable[dict], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the answers (``response_ids``) of ``dflash2-hf data`` records, ``[vocab]``."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for record in records:
        counts += torch.bincount(torch.tensor(record["response_ids"], dtype=torch.long), minlength=vocab_size)
    return counts


def most_used_tokens(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The ``size`` most used token ids, ``always`` among them (the target's end-of-answer ids: a draft that cannot
    end an answer loses the blocks where it ends), ties by lower id; sorted by id."""
    if not 0 < size <= counts.numel():
        raise ValueError(f"a draft vocabulary holds 1 to {counts.numel()} tokens (the target's vocabulary), got {size}")
    priority = counts.double()
    priority[list(always)] = float("inf")
    order = torch.sort(-priority, stable=True).indices
    return order[:size].sort().values


def answer_coverage(counts: torch.Tensor, token_ids: torch.Tensor) -> float:
    """The share of answer tokens that are in the vocabulary ``token_ids``: an upper bound on how often the drafter
    can still draft the target's next token."""
    total = int(counts.sum())
    return int(counts[token_ids].sum()) / total if total else 0.0


def with_draft_vocabulary(drafter: DFlashDraftModel, target_head: torch.Tensor, token_ids: torch.Tensor) -> DFlashDraftModel:
    """A copy of ``drafter`` that drafts from ``token_ids`` only: its own head holds those rows of ``target_head`` (the
    target's LM-head weight), so before any training it ranks those tokens exactly as the target's head does."""
    if drafter.draft_vocabulary is not None:
        raise ValueError(f"the drafter already has a draft vocabulary of {drafter.config.draft_vocab_size} tokens; "
                         "start from the drafter with the target's whole head")
    if target_head.shape != (drafter.config.vocab_size, drafter.config.hidden_size):
        raise ValueError(f"the target's head is {list(target_head.shape)}, the drafter drafts for "
                         f"[{drafter.config.vocab_size}, {drafter.config.hidden_size}]")
    config = copy.deepcopy(drafter.config)
    config.draft_vocab_size = int(token_ids.numel())
    config._check_consistency()
    cut = type(drafter)(config).to(device=drafter.device, dtype=drafter.dtype)
    missing, unexpected = cut.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and set(missing) == {"draft_head.weight", "draft_vocabulary"}, (missing, unexpected)
    with torch.no_grad():
        cut.draft_head.weight.copy_(target_head[token_ids.to(target_head.device)])
        cut.draft_vocabulary.copy_(token_ids)
    return cut.train(drafter.training)


def with_the_target_head(drafter: DFlashDraftModel) -> DFlashDraftModel:
    """A copy of ``drafter`` that reads the target's whole LM head again, without its draft vocabulary and head: the
    drafter it was cut from (up to its head rows' rounding), for a layout or a peer that has no draft vocabulary.
    A drafter without one is returned as it is."""
    if drafter.draft_vocabulary is None:
        return drafter
    config = copy.deepcopy(drafter.config)
    config.draft_vocab_size = None
    whole = type(drafter)(config).to(device=drafter.device, dtype=drafter.dtype)
    own = ("draft_head.weight", "draft_vocabulary")
    whole.load_state_dict({name: tensor for name, tensor in drafter.state_dict().items() if name not in own})
    return whole.train(drafter.training)
