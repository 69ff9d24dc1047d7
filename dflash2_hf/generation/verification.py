"""ONE exact verifier: a drafted token tree (:class:`~dflash2_hf.drafting.tree.DraftTree`) against the target, greedy or by
rejection sampling. One drafted path is the tree's one-branch case.

Greedy (:func:`verify_greedy`): walk down from the anchor while the target's own choice after the current node is
one of its children, then emit the target's choice: the longest branch the target agrees with, plus its token.

Sampling (:func:`verify_sampled`; speculative sampling, Leviathan et al. 2023, Alg. 1, recursively over the tree):
a drafted token ``x`` drawn from the drafter's ``q`` is kept with probability ``min(1, p(x) / q(x))``, where ``p`` is
the target's processed distribution after the kept prefix; after a rejection the residual ``max(p - q, 0) / Z`` takes
the place of ``p``, for the node's next draw or for the emitted token. Each emitted token then has exactly the
target's distribution (proof in ``docs/concepts.md``), whatever ``q`` is.

The target's distributions are supplied lazily by a callable, so that only the nodes the walk reaches are processed
(logits processors such as repetition penalty depend on the prefix and run once per node).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..drafting.lattice import SparseDistribution


def greedy_choices(logits: torch.Tensor) -> list[int]:
    """The target's greedy token at every row of ``logits`` ``[rows, vocab]``: the first highest logit, as ``argmax``
    picks it (``max`` returns the same index and, on bf16 logits on the CPU, runs several times faster)."""
    return logits.max(dim=-1).indices.tolist()


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``max(p - q, 0)`` normalised; falls back to ``p`` if the residual vanishes numerically (p == q)."""
    residual = (p - q).clamp_min(0)
    total = residual.sum()
    return residual / total if total > 0 else p


def acceptance_probability(p: torch.Tensor, q: SparseDistribution, token: int) -> float:
    """Probability ``min(1, p(token) / q(token))`` of keeping ``token``, drafted from ``q``, under the target ``p``."""
    return min(1.0, float(p[token]) / q.prob_of(token))


def rejection_distribution(p: torch.Tensor, q: SparseDistribution) -> torch.Tensor:
    """Dense distribution the replacement of a rejected token is drawn from: the residual of ``p`` over ``q``."""
    return residual_distribution(p, q.dense(p.shape[-1]).to(p.dtype))


@dataclass
class Verdict:
    """Outcome of verifying a token tree: the accepted ``nodes`` (a branch from the anchor down) and the ``emitted``
    tokens (theirs, then one token of the target's)."""

    nodes: list[int]
    emitted: list[int]


def verify_greedy(tree, target_choice: Callable[[int], int]) -> Verdict:
    """Walk down the tree while the target's choice after the current node (``target_choice(node)``, ``-1`` for the
    anchor) is one of its children; then emit the target's choice."""
    node, nodes, emitted = -1, [], []
    while True:
        choice = target_choice(node)
        emitted.append(choice)
        child = tree.child(node, choice)
        if child is None:
            return Verdict(nodes, emitted)
        nodes.append(child)
        node = child


def point_mass(token: int, device: torch.device | None = None) -> SparseDistribution:
    """The proposal of a fixed guess (a context-lookup token): all its mass on ``token``."""
    return SparseDistribution(torch.tensor([token], device=device), torch.tensor([1.0], device=device))


def verify_sampled(
    tree, target_probs: Callable[[int], torch.Tensor], generator: torch.Generator | None = None
) -> Verdict:
    """Recursive rejection sampling down a tree of independently drawn paths (multi-draft speculative sampling).

    At a node, the children of the paths through it are independent draws ``x_1, x_2, ...`` from its proposal ``q``.
    Draw ``j`` is kept with probability ``min(1, p_j(x_j) / q(x_j))``, with ``p_1`` the target's distribution after
    the node and ``p_{j+1}`` the residual ``max(p_j - q, 0) / Z`` after a rejection; a kept draw moves the walk to
    its child, and when every draw is rejected (or the node has none) the emitted token is drawn from the last
    ``p_j``. Each round is one speculative-sampling step for target ``p_j``, so every emitted token has the target's
    distribution (proof in ``docs/concepts.md``).

    A context-lookup child (``tree.lookup_children``) is a fixed guess ``x``, a draw from the point mass on ``x``,
    and is tested first: kept with probability ``p(x)``; after a rejection the residual is ``p`` without ``x``,
    renormalised, and the drafted children follow against it.
    """
    node, nodes, emitted = -1, [], []
    while True:
        p = target_probs(node)
        guess = tree.lookup_children.get(node)
        trials = [] if guess is None else [(guess, point_mass(tree.tokens[guess], p.device))]  # the guess first
        trials += [(child, tree.proposals[node]) for child in tree.draws.get(node, [])]
        kept = None
        for child, proposal in trials:
            if float(torch.rand((), generator=generator)) < acceptance_probability(p, proposal, tree.tokens[child]):
                kept = child
                break
            p = rejection_distribution(p, proposal)
        if kept is None:
            emitted.append(int(torch.multinomial(p, 1, generator=generator)))
            return Verdict(nodes, emitted)
        nodes.append(kept)
        emitted.append(tree.tokens[kept])
        node = kept
