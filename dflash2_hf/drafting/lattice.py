"""The top-K candidate lattice of a drafted block and the ways to pick one path through it.

Data flow: drafter logits ``[batch, L, vocab]`` -> :func:`build_lattice` keeps the top-K candidates per position ->
the drafter's :class:`~dflash2_hf.modeling.CandidateSelector` scores every (predecessor, candidate) pair at every
position in one op -> a path strategy picks one candidate per position.

Pair scores are turned into the selector's conditional distribution ``q_i(b | a) = softmax_b(score_i(a, b) / T)``
over the K candidates at position ``i``; sampling-time verification uses exactly this ``q``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class PathStrategy(str, Enum):
    """How a path is picked through the lattice."""

    ARGMAX = "argmax"  # DFlash v1: the drafter's top-1 at every position, no selector
    GREEDY = "greedy"  # published DFlash 2 walk: best successor of the chosen predecessor, left to right
    VITERBI = "viterbi"  # the path with the highest total selector log-probability
    EXPECTED = "expected"  # the path maximising the expected number of accepted tokens under the selector


@dataclass
class SparseDistribution:
    """A distribution over the vocabulary supported on a few token ids (the top-K candidates of one position): what a
    sampled draft's token was drawn from, which rejection sampling weighs the target's distribution against."""

    token_ids: torch.Tensor  # [K]
    probs: torch.Tensor  # [K], sums to 1

    def prob_of(self, token_id: int) -> float:
        hits = self.probs[self.token_ids == token_id]
        return float(hits.sum()) if hits.numel() else 0.0

    def dense(self, vocab_size: int) -> torch.Tensor:
        out = torch.zeros(vocab_size, dtype=self.probs.dtype, device=self.probs.device)
        return out.index_add_(0, self.token_ids, self.probs)


@dataclass
class Lattice:
    """Top-K candidates of one drafted block (positions after the anchor).

    Attributes:
        anchor_ids: the last verified token, ``[batch]``.
        candidate_ids: candidates per position, best drafter logit first, ``[batch, L, K]``.
        candidate_logits: the drafter's logits of those candidates, ``[batch, L, K]``.
        pair_scores: ``[batch, L, K, K]``: row ``a`` / column ``b`` scores candidate ``b`` at position ``i`` after
            candidate ``a`` at position ``i - 1``; at position 0 every row scores the anchor as predecessor.
            ``None`` for a drafter without selector.
    """

    anchor_ids: torch.Tensor
    candidate_ids: torch.Tensor
    candidate_logits: torch.Tensor
    pair_scores: torch.Tensor | None = None

    @property
    def top_k(self) -> int:
        return self.candidate_ids.shape[-1]

    def predecessor_ids(self) -> torch.Tensor:
        """``[batch, L, K]`` tokens that can precede each position: the anchor, then the previous candidates."""
        anchor = self.anchor_ids[:, None, None].expand(-1, 1, self.top_k)
        return torch.cat([anchor, self.candidate_ids[:, :-1]], dim=1)

    def tokens(self, path: torch.Tensor) -> torch.Tensor:
        """Token ids ``[batch, L]`` of a path given as candidate indices ``[batch, L]``."""
        return self.candidate_ids.gather(-1, path[..., None])[..., 0]

    def transition_log_probs(self, temperature: float = 1.0) -> torch.Tensor:
        """``log q_i(b | a)`` as ``[batch, L, K, K]``: the selector's conditional distribution over candidates."""
        if self.pair_scores is None:
            raise ValueError("This lattice has no pair scores: the drafter has no candidate selector.")
        return torch.log_softmax(self.pair_scores.float() / temperature, dim=-1)


def build_lattice(logits: torch.Tensor, anchor_ids: torch.Tensor, top_k: int) -> Lattice:
    """Keep the ``top_k`` highest-logit candidates of every drafted position (sorted, best first)."""
    candidate_logits, candidate_ids = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1, sorted=True)
    return Lattice(anchor_ids=anchor_ids, candidate_ids=candidate_ids, candidate_logits=candidate_logits)


def _walk(scores: torch.Tensor) -> torch.Tensor:
    """Left-to-right walk taking the best column of the row chosen at the previous position."""
    row = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
    picks = []
    for position in range(scores.shape[1]):
        row = scores[:, position].gather(1, row[:, None, None].expand(-1, 1, scores.shape[-1]))[:, 0].argmax(-1)
        picks.append(row)
    return torch.stack(picks, dim=1)


def _best_by_backward_recursion(step_values: torch.Tensor, combine) -> torch.Tensor:
    """Dynamic programming over ``[batch, L, K, K]`` edge values, from the last position back to the anchor.

    ``combine(edge, future)`` gives the value of taking an edge followed by the best continuation ``future`` (the
    best value from the edge's end node). Returns the best path as candidate indices ``[batch, L]``.
    """
    batch, length, k, _ = step_values.shape
    future = torch.zeros(batch, k, dtype=step_values.dtype, device=step_values.device)
    choices = []
    for position in reversed(range(length)):
        totals = combine(step_values[:, position], future[:, None, :])
        future, best = totals.max(dim=-1)
        choices.append(best)
    choices.reverse()
    row = torch.zeros(batch, dtype=torch.long, device=step_values.device)
    path = []
    for best in choices:
        row = best.gather(1, row[:, None])[:, 0]
        path.append(row)
    return torch.stack(path, dim=1)


def select_path(lattice: Lattice, strategy: PathStrategy | str) -> torch.Tensor:
    """Pick one candidate index per position, ``[batch, L]``, by ``strategy``."""
    strategy = PathStrategy(strategy)
    if strategy is PathStrategy.ARGMAX:
        return torch.zeros(lattice.candidate_ids.shape[:2], dtype=torch.long, device=lattice.candidate_ids.device)
    if lattice.pair_scores is None:
        raise ValueError(f"Path strategy {strategy.value!r} needs a DFlash 2 drafter with a candidate selector.")
    if strategy is PathStrategy.GREEDY:
        return _walk(lattice.pair_scores)
    log_q = lattice.transition_log_probs()
    if strategy is PathStrategy.VITERBI:
        return _best_by_backward_recursion(log_q, lambda edge, future: edge + future)
    # E[accepted] = q1 (1 + q2 (1 + q3 (...))): the value of an edge is q * (1 + best value after it).
    return _best_by_backward_recursion(log_q.exp(), lambda edge, future: edge * (1 + future))


def path_confidences(lattice: Lattice, path: torch.Tensor, sampled: bool, temperature: float = 1.0) -> torch.Tensor:
    """The drafter's estimate, per position, that the token on ``path`` (candidate indices ``[batch, L]``) is accepted
    once the ones before it were, ``[batch, L]``.

    The proposal at position ``i`` is the selector's ``q_i(. | path[i - 1])`` when the lattice is pair-scored, else the
    drafter's own top-K distribution there. A picked path scores the probability ``q_i`` gives its token. A sampled
    path scores ``sum_b q_i(b)^2``, the chance a second draw agrees: it does not look at the sampled token itself, so
    a block cut on it stays exact (see :mod:`dflash2_hf.cost.cycle_cost`).
    """
    if lattice.pair_scores is None:
        q = torch.softmax(lattice.candidate_logits.float() / temperature, dim=-1)
    else:
        previous = torch.cat([torch.zeros_like(path[:, :1]), path[:, :-1]], dim=1)  # position 0: rows score the anchor
        log_q = lattice.transition_log_probs(temperature)
        q = log_q.gather(2, previous[:, :, None, None].expand(-1, -1, 1, lattice.top_k))[:, :, 0].exp()
    if sampled:
        return (q * q).sum(-1)
    return q.gather(-1, path[..., None])[..., 0]


def score_lattice(
    lattice: Lattice, selector: torch.nn.Module, hidden: torch.Tensor, embedding_table: torch.Tensor | None = None
) -> Lattice:
    """Fill ``lattice.pair_scores`` with the drafter's selector head, all positions in one batched op.

    ``embedding_table`` is the target's input embedding matrix (``target.get_input_embeddings().weight``), which a
    factorised selector derives its token codes from.
    """
    lattice.pair_scores = selector.pair_scores(
        hidden, lattice.predecessor_ids(), lattice.candidate_ids, lattice.candidate_logits, embedding_table
    )
    return lattice


def sample_path(lattice: Lattice, temperature: float) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Sample a path position by position from ``q_i(. | previous pick) = softmax(score / temperature)``.

    Without a selector, ``q_i`` is the drafter's own top-K distribution, independent of the predecessor.
    Returns the candidate indices ``[batch, L]`` and, per batch row, the ``K`` probabilities each pick was drawn from
    (what exact rejection sampling needs). Uses torch's global generator.
    """
    if lattice.pair_scores is None:
        scores = lattice.candidate_logits[:, :, None, :]
        row_of = lambda previous: torch.zeros_like(previous)  # noqa: E731 - one row: no predecessor dependence
    else:
        scores = lattice.pair_scores
        row_of = lambda previous: previous  # noqa: E731
    batch, length = lattice.candidate_ids.shape[:2]
    previous = torch.zeros(batch, dtype=torch.long, device=scores.device)
    picks, distributions = [], [[] for _ in range(batch)]
    for position in range(length):
        rows = scores[:, position].gather(1, row_of(previous)[:, None, None].expand(-1, 1, scores.shape[-1]))[:, 0]
        q = torch.softmax(rows.float() / temperature, dim=-1)
        previous = torch.multinomial(q, 1)[:, 0]
        picks.append(previous)
        for row in range(batch):
            distributions[row].append(q[row])
    return torch.stack(picks, dim=1), distributions
