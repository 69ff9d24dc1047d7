"""Verification keeps the target's distribution exactly, and never accepts more than the drafted block.

Exactness is proven in closed form, not by sampling: for random target distributions ``p`` and drafter distributions
``q`` over vocabularies of 2 to 6 tokens (``p`` may rule tokens out; ``q`` may cover only K top candidates, as
:class:`SparseDistribution` does), every outcome of a verification is enumerated with its probability, built from the
pieces :func:`verify_sampled` itself draws with (:func:`acceptance_probability`, :func:`rejection_distribution`):

- one step: ``P(emit y) = sum_x q(x) [a(x) [y == x] + (1 - a(x)) r(y)] = p(y)``, for dense and for sparse ``q``;
- a block of L = 1..3 drafted tokens with per-position conditionals ``p_k(. | prefix)`` and ``q_k(. | prefix)``: the
  emitted tokens (kept drafts, then the replacement or bonus token), continued by the target up to L + 1 tokens, have
  the probability ``prod_k p_k`` of every sequence, i.e. the distribution of sampling L + 1 tokens from the target.

Greedy and sampled verification of one drafted path (a one-branch tree: the verifier is the tree verifier), on random
blocks, emit the accepted prefix of the path plus one token, and accept at most the path's length; greedy keeps
exactly the longest prefix matching the target's choices.

Negative control: a verifier that keeps tokens with the same probability but resamples from ``p`` instead of the
residual fails the exactness check on a fixed example, and hypothesis finds such a failure with the same strategies,
so the checks have teeth. All arithmetic is float64; the tolerance is 1e-9.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable

import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

from dflash2_hf.drafting.tree import DraftTree
from dflash2_hf.generation.verification import (
    SparseDistribution,
    acceptance_probability,
    greedy_choices,
    rejection_distribution,
    verify_greedy,
    verify_sampled,
)

TOLERANCE = 1e-9
MAX_VOCAB = 6
VOCAB_BY_BLOCK_LENGTH = {1: MAX_VOCAB, 2: 4, 3: 2}  # at most 16 drafted paths, so enumeration stays fast

Prefix = tuple[int, ...]
Resample = Callable[[torch.Tensor, SparseDistribution], torch.Tensor]
TargetConditionals = dict[Prefix, torch.Tensor]
DraftConditionals = dict[Prefix, SparseDistribution]


# --- strategies ------------------------------------------------------------------------------------------------------


@st.composite
def target_distributions(draw: st.DrawFn, vocab_size: int) -> torch.Tensor:
    """A dense ``p`` over ``vocab_size`` tokens; up to all but one may have probability 0 (as after top-k / top-p)."""
    weights = draw(st.lists(st.floats(min_value=1e-6, max_value=1.0), min_size=vocab_size, max_size=vocab_size))
    ruled_out = draw(st.sets(st.integers(0, vocab_size - 1), max_size=vocab_size - 1))
    p = torch.tensor([0.0 if token in ruled_out else w for token, w in enumerate(weights)], dtype=torch.float64)
    return p / p.sum()


@st.composite
def draft_distributions(draw: st.DrawFn, vocab_size: int, dense: bool = False) -> SparseDistribution:
    """A drafter ``q``: positive probabilities on K distinct candidate ids (K = ``vocab_size`` if ``dense``)."""
    candidates = vocab_size if dense else draw(st.integers(1, vocab_size))
    token_ids = draw(st.permutations(range(vocab_size)))[:candidates]
    weights = draw(st.lists(st.floats(min_value=1e-6, max_value=1.0), min_size=candidates, max_size=candidates))
    probs = torch.tensor(weights, dtype=torch.float64)
    return SparseDistribution(torch.tensor(token_ids), probs / probs.sum())


def single_steps(dense: bool) -> st.SearchStrategy[tuple[torch.Tensor, SparseDistribution]]:
    """``(p, q)`` for one drafted position."""
    return st.integers(2, MAX_VOCAB).flatmap(
        lambda vocab: st.tuples(target_distributions(vocab), draft_distributions(vocab, dense=dense))
    )


@st.composite
def blocks(draw: st.DrawFn) -> tuple[TargetConditionals, DraftConditionals, int, int]:
    """Target and drafter conditionals for every prefix of a block: ``(target, draft, vocab_size, length)``."""
    length = draw(st.integers(1, 3))
    vocab_size = draw(st.integers(2, VOCAB_BY_BLOCK_LENGTH[length]))
    prefixes = [prefix for n in range(length + 1) for prefix in itertools.product(range(vocab_size), repeat=n)]
    target = {prefix: draw(target_distributions(vocab_size)) for prefix in prefixes}
    draft = {prefix: draw(draft_distributions(vocab_size)) for prefix in prefixes if len(prefix) < length}
    return target, draft, vocab_size, length


@st.composite
def sampled_verifications(
    draw: st.DrawFn,
) -> tuple[list[int], list[SparseDistribution], list[torch.Tensor], torch.Generator]:
    """A drafted path of 0..8 tokens, each drawn from its ``q``, the target's ``p`` per position, a seeded generator.

    A position's ``p`` is either random or equal to its ``q`` (always accepted), so full acceptance is reached often.
    """
    vocab_size = draw(st.integers(2, MAX_VOCAB))
    drafts = draw(st.lists(draft_distributions(vocab_size), max_size=8))
    path = [draw(st.sampled_from(q.token_ids.tolist())) for q in drafts]
    target = [
        q.dense(vocab_size) if draw(st.booleans()) else draw(target_distributions(vocab_size)) for q in drafts
    ] + [draw(target_distributions(vocab_size))]
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    return path, drafts, target, generator


# --- closed forms ----------------------------------------------------------------------------------------------------


def resample_from_target(p: torch.Tensor, q: SparseDistribution) -> torch.Tensor:
    """The negative control's mistake: a rejected token is replaced by a draw from ``p``, not from the residual."""
    return p


def first_token_distribution(
    p: torch.Tensor, q: SparseDistribution, resample: Resample = rejection_distribution
) -> torch.Tensor:
    """``P(emit y)`` at one drafted position: ``x ~ q`` is kept with ``acceptance_probability``, else resampled."""
    emitted = torch.zeros_like(p)
    for token, q_token in zip(q.token_ids.tolist(), q.probs.tolist()):
        accept = acceptance_probability(p, q, token)
        emitted[token] += q_token * accept
        emitted += q_token * (1 - accept) * resample(p, q)
    return emitted


def emitted_block_distribution(
    target: TargetConditionals, draft: DraftConditionals, length: int
) -> dict[Prefix, float]:
    """``P(one verification of a drafted block emits exactly this sequence)``, by enumerating every outcome."""
    emitted: dict[Prefix, float] = defaultdict(float)

    def verify_from(kept: Prefix, weight: float) -> None:
        p = target[kept]
        if len(kept) == length:  # every drafted token kept: the bonus token is drawn from p
            for token, p_token in enumerate(p.tolist()):
                emitted[kept + (token,)] += weight * p_token
            return
        q = draft[kept]
        residual = rejection_distribution(p, q).tolist()
        for token, q_token in zip(q.token_ids.tolist(), q.probs.tolist()):
            accept = acceptance_probability(p, q, token)
            verify_from(kept + (token,), weight * q_token * accept)
            for replacement, r_token in enumerate(residual):
                emitted[kept + (replacement,)] += weight * q_token * (1 - accept) * r_token

    verify_from((), 1.0)
    return emitted


def target_probability(target: TargetConditionals, sequence: Prefix, start: int = 0) -> float:
    """``prod_{j >= start} p(sequence[j] | sequence[:j])``: the target sampling ``sequence[start:]`` after the rest."""
    probability = 1.0
    for j in range(start, len(sequence)):
        probability *= float(target[sequence[:j]][sequence[j]])
    return probability


def deviation(emitted: torch.Tensor, p: torch.Tensor) -> float:
    return float((emitted - p).abs().max())


# --- exactness -------------------------------------------------------------------------------------------------------


@settings(deadline=None, max_examples=300)
@given(single_steps(dense=True))
def test_one_step_emits_exactly_p_for_a_dense_draft(case: tuple[torch.Tensor, SparseDistribution]) -> None:
    p, q = case
    assert deviation(first_token_distribution(p, q), p) < TOLERANCE


@settings(deadline=None, max_examples=300)
@given(single_steps(dense=False))
def test_one_step_emits_exactly_p_for_a_draft_on_top_k_candidates(
    case: tuple[torch.Tensor, SparseDistribution],
) -> None:
    p, q = case
    assert deviation(first_token_distribution(p, q), p) < TOLERANCE


@settings(deadline=None, max_examples=100)
@given(blocks())
def test_a_verified_block_continued_by_the_target_is_distributed_as_the_target(
    case: tuple[TargetConditionals, DraftConditionals, int, int],
) -> None:
    target, draft, vocab_size, length = case
    emitted = emitted_block_distribution(target, draft, length)
    assert abs(sum(emitted.values()) - 1) < TOLERANCE
    for sequence in itertools.product(range(vocab_size), repeat=length + 1):
        continued = sum(
            emitted.get(sequence[:emitted_length], 0.0) * target_probability(target, sequence, start=emitted_length)
            for emitted_length in range(1, length + 2)
        )
        assert abs(continued - target_probability(target, sequence)) < TOLERANCE


# --- block bounds ----------------------------------------------------------------------------------------------------


def path_tree(path: list[int], drafts: list[SparseDistribution] | None = None) -> DraftTree:
    """One drafted path as the verifier receives it: a one-branch tree (node ``i`` at depth ``i + 1``)."""
    tree = DraftTree()
    tree.add_path(path, drafts)
    return tree


@settings(deadline=None, max_examples=200)
@given(
    path=st.lists(st.integers(0, 1), max_size=8),
    choices=st.lists(st.integers(0, 1), min_size=9, max_size=9),
)
def test_greedy_verification_emits_the_accepted_prefix_plus_one_token(path: list[int], choices: list[int]) -> None:
    verdict = verify_greedy(path_tree(path), lambda node: choices[node + 1])
    accepted = len(verdict.nodes)
    assert 0 <= accepted <= len(path) and verdict.nodes == list(range(accepted))
    assert verdict.emitted == path[:accepted] + [choices[accepted]]


@settings(deadline=None, max_examples=200)
@given(
    path=st.lists(st.integers(0, 1), max_size=8),
    choices=st.lists(st.integers(0, 1), min_size=9, max_size=9),
)
def test_greedy_verification_keeps_the_longest_prefix_matching_the_target(path: list[int], choices: list[int]) -> None:
    matching = next((i for i, token in enumerate(path) if token != choices[i]), len(path))
    assert len(verify_greedy(path_tree(path), lambda node: choices[node + 1]).nodes) == matching


@settings(deadline=None, max_examples=200)
@given(sampled_verifications())
def test_sampled_verification_emits_the_accepted_prefix_plus_one_token(
    case: tuple[list[int], list[SparseDistribution], list[torch.Tensor], torch.Generator],
) -> None:
    path, drafts, target, generator = case
    verdict = verify_sampled(path_tree(path, drafts), lambda node: target[node + 1], generator)
    accepted = len(verdict.nodes)
    assert 0 <= accepted <= len(path) and verdict.nodes == list(range(accepted))
    assert len(verdict.emitted) == accepted + 1
    assert verdict.emitted[:-1] == path[:accepted]


# --- negative control ------------------------------------------------------------------------------------------------


def test_resampling_from_p_instead_of_the_residual_fails_the_exactness_check() -> None:
    p = torch.tensor([0.2, 0.8], dtype=torch.float64)
    q = SparseDistribution(torch.tensor([0, 1]), torch.tensor([0.8, 0.2], dtype=torch.float64))
    assert deviation(first_token_distribution(p, q), p) < TOLERANCE
    wrong = first_token_distribution(p, q, resample=resample_from_target)
    # kept 0: 0.8 * 0.25 = 0.2; rejected: 0.8 * 0.75 = 0.6, of which 0.2 resamples 0: P(emit 0) = 0.32, not 0.2
    assert torch.allclose(wrong, torch.tensor([0.32, 0.68], dtype=torch.float64), atol=TOLERANCE)
    assert deviation(wrong, p) > 0.1


def test_the_exactness_search_finds_a_counterexample_to_resampling_from_p() -> None:
    p, q = find(
        single_steps(dense=False),
        lambda case: deviation(first_token_distribution(*case, resample=resample_from_target), case[0]) > TOLERANCE,
        settings=settings(database=None, max_examples=300),
    )
    assert deviation(first_token_distribution(p, q), p) < TOLERANCE


def test_greedy_choices_pick_the_first_highest_logit_as_argmax_does() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(25, 4096, generator=generator)).round().to(torch.bfloat16)  # many tied maxima
    logits[0, [7, 4000]] = 100.0
    choices = greedy_choices(logits)
    assert choices == logits.float().argmax(dim=-1).tolist()
    assert choices[0] == 7
