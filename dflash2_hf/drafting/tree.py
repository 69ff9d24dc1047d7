"""Tree drafting: several paths through the lattice, merged into one token tree that the target verifies in ONE
forward pass.

Data flow (one cycle): lattice -> a :class:`DraftTree` (greedy decoding: the likeliest tokens under the selector's
conditional distributions, grown best-first, :func:`likeliest_tree`; sampling: paths drawn independently from those
distributions, merged where they share a prefix, :func:`sampled_tree`) -> one target forward over the anchor and
every node, each attending to the verified context and its own ancestors only (:meth:`DraftTree.attention_mask`,
:meth:`DraftTree.position_ids`) -> exact verification walks down the tree
(:func:`~dflash2_hf.generation.verification.verify_greedy`, :func:`~dflash2_hf.generation.verification.verify_sampled`) ->
:func:`commit_branch` leaves the accepted branch in the target's KV cache. One drafted path is a tree with one branch
(:meth:`DraftTree.is_chain`).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch

from .lattice import Lattice, SparseDistribution, sample_path

ROOT = -1  # the anchor: the last verified token, parent of the first drafted tokens


@dataclass
class DraftTree:
    """Drafted tokens as a tree below the anchor, nodes in insertion order (every parent before its children).

    Attributes:
        tokens: token id of each node.
        parents: parent node of each node (:data:`ROOT` for the anchor).
        draws: per parent, the child node of every path that passed through it, in path order; when sampling these
            are independent draws from ``proposals[parent]`` (a token drawn twice appears twice).
        proposals: per parent, the distribution its children were drawn from (sampling only).
        branch_probabilities: per node, the product of its branch's conditional probabilities under the selector
            (:func:`likeliest_tree` only): the expected number of accepted tokens the node adds.
        lookup_children: per parent, the child that the context-lookup branch (:meth:`add_lookup_path`) passes
            through; a fixed guess, not a draw from ``proposals``, so verification tests it on its own terms.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    draws: dict[int, list[int]] = field(default_factory=dict)
    proposals: dict[int, SparseDistribution] = field(default_factory=dict)
    branch_probabilities: list[float] = field(default_factory=list)
    lookup_children: dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def add_path(self, tokens: list[int], proposals: list[SparseDistribution] | None = None) -> None:
        """Insert a path below the anchor, reusing the nodes of a shared prefix."""
        parent = ROOT
        for depth, token in enumerate(tokens):
            child = next((c for c in self.draws.get(parent, []) if self.tokens[c] == token), None)
            if child is None:
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(parent)
            self.draws.setdefault(parent, []).append(child)
            if proposals is not None:
                self.proposals.setdefault(parent, proposals[depth])
            parent = child

    def add_lookup_path(self, tokens: list[int]) -> None:
        """Insert the context-lookup guess (:mod:`dflash2_hf.drafting.lookup`) as a branch below the anchor, reusing
        the nodes of a drafted prefix it shares; recorded in ``lookup_children``, not in ``draws``."""
        parent = ROOT
        for token in tokens:
            child = self.child(parent, token)
            if child is None:
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(parent)
            self.lookup_children[parent] = child
            parent = child

    def child(self, parent: int, token: int) -> int | None:
        """The child of ``parent`` holding ``token``, if any (drafted or looked up)."""
        drafted = next((c for c in self.draws.get(parent, []) if self.tokens[c] == token), None)
        guess = self.lookup_children.get(parent)
        return guess if drafted is None and guess is not None and self.tokens[guess] == token else drafted

    def branch(self, node: int) -> list[int]:
        """The nodes from the anchor's child down to ``node`` (empty for :data:`ROOT`)."""
        nodes = []
        while node != ROOT:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def is_chain(self) -> bool:
        """One branch, nodes in order (one drafted path, or a copied branch alone): the target verifies it with its
        plain causal mask, and a rejection rolls the cache back with a crop."""
        return all(parent == node - 1 for node, parent in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of every node (1 for the anchor's children)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        return depths

    def position_ids(self, anchor_position: int) -> torch.Tensor:
        """``[1, 1 + len]`` positions of the anchor and every node (a node sits at its depth after the anchor)."""
        return torch.tensor([[anchor_position] + [anchor_position + d for d in self.depths()]])

    def attention_mask(self, past_length: int, dtype: torch.dtype) -> torch.Tensor:
        """``[1, 1, 1 + len, past_length + 1 + len]`` additive mask: the anchor and every node see the whole verified
        context (``past_length`` cached tokens), the anchor and their own ancestors, and themselves."""
        size = 1 + len(self)
        allowed = torch.zeros(size, past_length + size, dtype=torch.bool)
        allowed[:, : past_length + 1] = True  # the context and the anchor
        for node in range(len(self)):
            for ancestor in self.branch(node):
                allowed[1 + node, past_length + 1 + ancestor] = True
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None]


def likeliest_tree(lattice: Lattice, nodes: int) -> DraftTree:
    """The ``nodes`` drafted tokens whose whole branch is likeliest under the selector's conditional distributions
    (the drafter's own without pair scores), grown best-first from the anchor (greedy decoding): every node's branch
    probability ``q_1 q_2 ... q_d`` is at least that of any token left out, so the tree maximises the expected number
    of accepted tokens those probabilities predict for its size."""
    if lattice.pair_scores is not None:
        log_q = lattice.transition_log_probs()[0]
    else:
        log_q = torch.log_softmax(lattice.candidate_logits[0].float(), dim=-1)[:, None, :].expand(-1, lattice.top_k, -1)
    log_q = log_q.tolist()
    candidates = lattice.candidate_ids[0].tolist()
    tree = DraftTree()
    frontier = [(-score, 0, ROOT, index) for index, score in enumerate(log_q[0][0])]  # row 0: after the anchor
    heapq.heapify(frontier)
    while frontier and len(tree) < nodes:
        negative, depth, parent, index = heapq.heappop(frontier)
        node = len(tree)
        tree.tokens.append(candidates[depth][index])
        tree.parents.append(parent)
        tree.branch_probabilities.append(math.exp(-negative))
        tree.draws.setdefault(parent, []).append(node)
        if depth + 1 < len(log_q):
            for child, score in enumerate(log_q[depth + 1][index]):
                heapq.heappush(frontier, (negative - score, depth + 1, node, child))
    return tree


def worthwhile_tree_size(lattice: Lattice, nodes: int, cost, lookup_gains: list[float] = ()) -> tuple[int, int]:
    """How many drafted tokens (0 .. ``nodes``) a tree should hold, and how many of the copied tokens whose expected
    gains are ``lookup_gains`` (:class:`~dflash2_hf.drafting.lookup.LookupOdds`) its lookup branch, under a cycle
    ``cost`` (:meth:`~dflash2_hf.cost.cycle_cost.CycleCost.worthwhile_size`). The likeliest tree's branch probabilities
    and the lookup gains both come best-first, so their merged order is the best-first order of every token the
    forward could hold; the most profitable prefix of it is split back into the two.

    It reads the lattice and the past outcomes only, never a drawn token, so sizing keeps sampling exact."""
    tree_gains = likeliest_tree(lattice, nodes).branch_probabilities
    merged = sorted([(gain, True) for gain in tree_gains] + [(gain, False) for gain in lookup_gains],
                    key=lambda item: -item[0])
    size = cost.worthwhile_size([gain for gain, _ in merged])
    drafted = sum(from_tree for _, from_tree in merged[:size])
    return drafted, size - drafted


def sampled_tree(lattice: Lattice, nodes: int, temperature: float) -> DraftTree:
    """A tree of at most ``nodes`` tokens from independently drawn paths (sampling): ``floor(sqrt(nodes))`` paths of
    ``nodes // paths`` tokens (at most the lattice's length), merged where they share a prefix; every node remembers
    the distribution its children were drawn from (no nodes: an empty tree)."""
    if nodes < 1:
        return DraftTree()
    paths = math.isqrt(nodes)
    depth = min(nodes // paths, lattice.candidate_ids.shape[1])
    shallow = Lattice(
        anchor_ids=lattice.anchor_ids.expand(paths),
        candidate_ids=lattice.candidate_ids[:, :depth].expand(paths, -1, -1),
        candidate_logits=lattice.candidate_logits[:, :depth].expand(paths, -1, -1),
        pair_scores=None if lattice.pair_scores is None else lattice.pair_scores[:, :depth].expand(paths, -1, -1, -1),
    )
    picks, distributions = sample_path(shallow, temperature)
    tree = DraftTree()
    for row in range(paths):
        tokens = shallow.tokens(picks[row : row + 1])[0]
        proposals = [SparseDistribution(lattice.candidate_ids[0, i], q) for i, q in enumerate(distributions[row])]
        tree.add_path(tokens.tolist(), proposals)
    return tree


def commit_branch(cache, past_length: int, nodes: list[int], forwarded: int) -> None:
    """Leave in the target's cache the verified context, the anchor and the accepted ``nodes`` of a forward over the
    anchor and ``forwarded`` nodes: a crop when the accepted nodes are the forward's first rows (always so for a path;
    it also shrinks sliding-window layers back to their window), else :func:`keep_branch`."""
    if nodes == list(range(len(nodes))):
        cache.crop(len(nodes) - forwarded)
    else:
        keep_branch(cache, past_length, nodes)


def keep_branch(cache, past_length: int, nodes: list[int]) -> None:
    """Compact every layer of the target's cache to the verified context, the anchor and the accepted ``nodes``
    (the tree forward appended the anchor and all nodes after ``past_length`` cached tokens)."""
    keep = torch.tensor([past_length] + [past_length + 1 + n for n in nodes])
    for layer in cache.layers:
        if layer.get_seq_length() == 0:
            continue
        index = keep.to(layer.keys.device)
        layer.keys = torch.cat([layer.keys[..., :past_length, :], layer.keys.index_select(-2, index)], dim=-2)
        layer.values = torch.cat([layer.values[..., :past_length, :], layer.values.index_select(-2, index)], dim=-2)


def check_tree_cache(cache) -> None:
    """Tree verification compacts full-attention caches; a sliding-window layer keeps a rolling window it cannot
    compact, so such targets are refused."""
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise ValueError("Tree verification (dflash_tree_nodes) needs a target whose layers all use full "
                         "attention; this target has sliding-window layers. Use dflash_tree_nodes=0.")
