"""What a training step is made of: blocks at anchors in the target's answers, their attention mask and positions,
the drafter loss's position weights and the selector's K-way loss.

Block ``j`` starts at anchor ``a_j``: its queries are ``[token a_j, mask, ...]`` and its labels the target's own next
tokens ``a_j .. a_j + B - 1`` (position 0 holds the anchor itself); it attends to the context features of tokens
``< a_j`` (:func:`block_attention`) and to its own block only, under the drafter's own causal and sliding-window rule
as in decoding (the drafter's packed-block attention never scores one block against another; DFlash 2's convolutions
stay inside each block). Losses:

* drafter: cross-entropy of the target's next tokens at block positions ``k = 1 .. B-1``, weighted by
  ``exp(-(k - 1) / gamma)`` (:func:`position_weights`: early positions matter most, a miss there ends the accepted
  prefix);
* selector (DFlash 2, :func:`selector_loss`): a K-way cross-entropy over the top-K candidates at each position,
  scored against the true predecessor (teacher forcing), with the gold token put into the candidate set when the
  drafter missed it (the published recipe, ``selector_gold="insert"``) or those positions left out
  (``selector_gold="skip"``: decoding can only ever pick among the drafter's own top-K, so a weak drafter's selector
  learns from the choices it will face).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..modeling import DFlashDraftModel
from .labels import block_labels, label_row

IGNORE = -100  # a label with no target token (past the answer's end, or an unused block slot)


@dataclass
class BlockBatch:
    """Padded sequences with their sampled blocks."""

    record_ids: list[int]
    input_ids: torch.Tensor  # [b, T]
    attention_mask: torch.Tensor  # [b, T]
    anchors: torch.Tensor  # [b, n]; -1 marks an unused block slot
    labels: torch.Tensor  # [b, n, B]; position 0 holds the anchor token, IGNORE where there is no target token
    global_labels: torch.Tensor | None = None  # labels of the whole global batch, when this is one process's share

    def rows(self, index: int, count: int) -> BlockBatch:
        """Rows ``index::count`` (one process's share), remembering the global labels for loss normalisation."""
        if count == 1:
            return self
        keep = slice(index, None, count)
        return BlockBatch(self.record_ids[keep], self.input_ids[keep], self.attention_mask[keep], self.anchors[keep],
                          self.labels[keep], self.labels)


def anchor_range(record: dict, max_length: int) -> range:
    """Where a random block of ``record`` may start: from its last prompt token (which anchors the first response
    block) to the one before its last token within ``max_length``; empty when no answer token lies inside (an empty
    response, or one cut off by ``max_length``), so the record has nothing to label."""
    length = min(len(record["prompt_ids"]) + len(record["response_ids"]), max_length)
    return range(max(len(record["prompt_ids"]) - 1, 1), length - 1)


def sample_blocks(
    sequences: list[dict], block_size: int, blocks_per_sequence: int, max_length: int, generator: torch.Generator,
    record_ids: list[int] | None = None, labels: str = "text",
) -> BlockBatch:
    """Pick up to ``blocks_per_sequence`` random anchors in each response and build the block labels (from
    ``labels``, one of :data:`~dflash2_hf.training.labels.LABEL_SOURCES`); the batch holds as many block slots as its
    fullest sequence needs, so a number past an answer's length (every anchor) adds no empty blocks."""
    anchors = []
    for record in sequences:
        allowed = anchor_range(record, max_length)
        if not allowed:  # nothing to label
            anchors.append([])
            continue
        candidates = torch.arange(allowed.start, allowed.stop)
        chosen = candidates[torch.randperm(len(candidates), generator=generator)[:blocks_per_sequence]]
        anchors.append(chosen.sort().values.tolist())
    return blocks_at(sequences, anchors, block_size, max_length, record_ids, labels=labels)


def blocks_at(
    sequences: list[dict], anchors: list[list[int]], block_size: int, max_length: int, record_ids: list[int] | None = None,
    slots: int | None = None, labels: str = "text",
) -> BlockBatch:
    """The blocks starting at the given anchors of each sequence (``slots`` blocks per row, unused ones marked -1), with
    their labels (the record's next tokens, or the target's choices there: ``labels``)."""
    rows = [(r["prompt_ids"] + r["response_ids"])[:max_length] for r in sequences]
    label_rows = [label_row(r, labels)[:max_length] for r in sequences]
    length = max(len(r) for r in rows)
    slots = slots or max(1, max(len(a) for a in anchors))
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), length, dtype=torch.long)
    anchor_ids = torch.full((len(rows), slots), -1, dtype=torch.long)
    block_label_ids = torch.full((len(rows), slots, block_size), IGNORE, dtype=torch.long)
    for row, (ids, chosen) in enumerate(zip(rows, anchors)):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        for slot, anchor in enumerate(chosen):
            anchor_ids[row, slot] = anchor
            span = block_labels(ids, label_rows[row], anchor, block_size, labels)
            block_label_ids[row, slot, : len(span)] = torch.tensor(span)
    return BlockBatch(record_ids or list(range(len(rows))), input_ids, attention_mask, anchor_ids, block_label_ids)


def decoding_anchors(acceptance_lengths: list[int]) -> list[int]:
    """The anchors greedy decoding visits, given the acceptance length of a block at every anchor ``0, 1, ...``: it
    starts at 0 and each verification moves the anchor on by the accepted length (drafted tokens + the target's own)."""
    visited, anchor = [], 0
    while anchor < len(acceptance_lengths):
        visited.append(anchor)
        anchor += acceptance_lengths[anchor]
    return visited


def block_attention(anchors: torch.Tensor, context_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[b, 1, n*B, T]`` boolean mask of the context each packed block sees: the tokens before its anchor (each block
    also sees itself and no other block: the drafter's packed-block attention, given ``block_length``)."""
    length = context_mask.shape[1]
    sees_context = torch.arange(length)[None, None, :] < anchors[:, :, None]
    sees_context = sees_context & context_mask.bool()[:, None, :]
    return sees_context.repeat_interleave(block_size, dim=1)[:, None]


def block_positions(anchors: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """Positions of the context tokens followed by every block's tokens (``a_j .. a_j + B - 1``)."""
    batch = anchors.shape[0]
    context = torch.arange(context_length).expand(batch, -1)
    blocks = (anchors.clamp_min(0)[:, :, None] + torch.arange(block_size)).reshape(batch, -1)
    return torch.cat([context, blocks], dim=1)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Loss weight of drafted positions ``k = 1 .. B-1``: ``exp(-(k - 1) / gamma)``."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def selector_positions(labels: torch.Tensor) -> torch.Tensor:
    """Drafted positions with a gold token and a gold predecessor, ``[N, B-1]``."""
    return (labels[..., 1:] != IGNORE) & (labels[..., :-1] != IGNORE)


def selector_loss(
    drafter: DFlashDraftModel, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
    normaliser: float | None = None, embedding_table: torch.Tensor | None = None, insert_missing_gold: bool = True,
) -> torch.Tensor:
    """K-way cross-entropy of the gold token among the top-K candidates, given the gold predecessor.

    ``hidden`` / ``logits``: drafted positions ``[N, B-1, ...]``; ``labels``: ``[N, B]`` with the anchor at 0.
    Where the gold token is not among the top-K, ``insert_missing_gold`` puts it in place of the last candidate;
    otherwise (or where a draft vocabulary has no row for it) that position adds nothing to the loss. The sum is divided by ``normaliser`` (default: the number of
    positions with a gold token and a gold predecessor). ``embedding_table``: the target's input embedding matrix,
    which a factorised selector needs.
    """
    selector = drafter.candidate_selector
    gold, predecessors = labels[:, 1:], labels[:, :-1]
    scored = valid = selector_positions(labels)
    candidates = torch.topk(logits.detach().float(), selector.top_k, dim=-1).indices  # rows of the drafter's head
    head_gold = drafter.head_token_ids(gold)  # negative: no gold, or none the head can draft
    missing = ~(candidates == head_gold[..., None]).any(-1)
    if insert_missing_gold:
        insertable = missing & (head_gold >= 0)
        candidates[..., -1] = torch.where(insertable, head_gold, candidates[..., -1])
        valid = valid & (~missing | insertable)
    else:
        valid = valid & ~missing
    candidate_logits = logits.detach().float().gather(-1, candidates)
    scores = selector.pair_scores(hidden, predecessors.clamp_min(0)[..., None], drafter.target_token_ids(candidates),
                                  candidate_logits, embedding_table)[..., 0, :]
    target_index = (candidates == head_gold[..., None]).float().argmax(-1)
    losses = F.cross_entropy(scores.float().flatten(0, 1), target_index.flatten(), reduction="none")
    return (losses * valid.flatten()).sum() / (normaliser or scored.sum().clamp_min(1))
