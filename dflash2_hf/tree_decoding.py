"""The decoding loop with token trees (``dflash_tree_nodes`` > 0): :class:`TreeDecoder` is :class:`DFlashDecoder`
with a cycle that verifies a :class:`~dflash2_hf.tree.DraftTree` instead of one path.

One cycle: draft a block -> pair-score the lattice -> (with ``adaptive_block``: the tree's size from the cycle
cost) -> several paths merged into a tree (with ``lookup_tokens``: plus a branch copied from the context) -> ONE
target forward over the anchor and every node (tree attention mask, tree positions) -> exact walk down the tree ->
the target's cache compacted to the accepted branch -> the branch's hidden states feed the next draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from .block_length import CycleCost
from .context_lookup import DEFAULT_MAX_NGRAM, LookupOdds, lookup_continuation, lookup_match
from .decoding import DFlashDecoder, DraftRecord
from .lattice import PathStrategy
from .tree import (ROOT, DraftTree, check_tree_cache, keep_branch, likeliest_tree, sampled_tree,
                   worthwhile_tree_size)
from .verification import TreeVerdict, greedy_choices, verify_tree_greedy, verify_tree_sampled


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


class TreeDecoder(DFlashDecoder):
    """Runs one generation whose cycles verify token trees (full-attention targets only)."""

    def __init__(self, target, drafter, options, generation_config, logits_processor, stopping_criteria, streamer, cache):
        check_tree_cache(cache)
        super().__init__(target, drafter, options, generation_config, logits_processor, stopping_criteria, streamer, cache)
        # A tree of n nodes is at most n deep, so the LM head reads out no more drafted positions than that (the
        # same tree, for less of the drafter's largest matmul).
        self.draft_depth = min(options.block_size - 1, options.tree_nodes)
        # the longest suffix the context lookup matches: transformers' prompt-lookup setting, when given
        self.lookup_ngram = generation_config.max_matching_ngram_size or DEFAULT_MAX_NGRAM
        self.lookup_odds = LookupOdds()
        # Steps without drafting may verify a copied branch alone, priced at the forward's cost with no draft.
        self.lookup_cost = None
        if self.guard is not None and options.lookup_tokens and isinstance(self.block_cutter, CycleCost):
            self.lookup_cost = CycleCost(0.0, self.block_cutter.verify_seconds)

    def _foreseen_token(self, sequence: torch.Tensor) -> int | None:
        """With a lookup branch: the token after the latest earlier occurrence of the text's last
        ``FORESIGHT_NGRAM`` or more tokens (shorter matches foresee too little)."""
        if not self.options.lookup_tokens:
            return None
        guess = lookup_continuation(sequence[0].tolist(), 1, self.lookup_ngram, min_ngram=FORESIGHT_NGRAM)
        return guess[0] if guess else None

    def _cycle(self, sequence: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, bool, torch.Tensor]:
        """One cycle with a token tree: draft, grow a tree over the lattice, verify every node in one target forward
        (tree attention mask and positions), keep the accepted branch in the cache."""
        anchor_position = sequence.shape[1] - 1
        tree, lookup = DraftTree(), CopiedBranch()
        lattice, hidden = self._draft(sequence, context)
        tick = time.perf_counter()
        if lattice is not None:
            with record_function("dflash2.select"):
                if self.options.path is not PathStrategy.ARGMAX:
                    lattice = self.block.score(lattice, hidden)
                tree, lookup = self._grow_tree(lattice, sequence)
            self.stats.select_seconds += time.perf_counter() - tick
        sequence, stopped, context, verdict = self._check(sequence, tree, lookup)
        if self.stats.drafts is not None and lattice is not None:
            self.stats.drafts.append(DraftRecord(anchor_position, lattice.candidate_ids[0].cpu(), verdict.emitted[:-1]))
        return sequence, stopped, context

    def _plain_step(self, sequence: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, bool, torch.Tensor]:
        """A step without drafting: the tokens copied from the context alone, verified with the anchor where the cycle
        cost and the lookup's odds say they pay for their rows (a lookup cycle), else a plain one-token step."""
        lookup = self._copied_branch(sequence) if self.lookup_cost is not None else CopiedBranch()
        if lookup.matched >= LOOKUP_CYCLE_NGRAM:
            lookup.keep(self.lookup_cost.worthwhile_size(self.lookup_odds.gains(lookup.matched, len(lookup.tokens))))
            if lookup.tokens:
                tree = DraftTree()
                tree.add_lookup_path(lookup.tokens)
                self.stats.lookup_cycles += 1
                return self._check(sequence, tree, lookup)[:3]
        return super()._plain_step(sequence, context)

    def _check(self, sequence: torch.Tensor, tree: DraftTree, lookup: CopiedBranch):
        """Verify ``tree`` (its lookup branch ``lookup``) after the sequence's last token in one target forward, keep
        the accepted branch in the cache, emit its tokens and record the cycle. Returns the new sequence, whether a
        stopping criterion fired, the accepted tokens' context features and the verdict."""
        tick = time.perf_counter()
        anchor_position = sequence.shape[1] - 1
        with record_function("dflash2.verify_forward"):
            output = self._forward(
                sequence.new_tensor([[int(sequence[0, -1])] + tree.tokens]),
                attention_mask=tree.attention_mask(anchor_position, self.target.dtype),
                position_ids=tree.position_ids(anchor_position).to(sequence.device),
            )
        with record_function("dflash2.verify_decide"):
            verdict = self._verify_tree(sequence, tree, output.logits[0])
        with record_function("dflash2.cache_crop"):
            keep_branch(self.cache, anchor_position, verdict.nodes)
        self.stats.verify_seconds += time.perf_counter() - tick
        self.lookup_odds.record(lookup.matched, len(lookup.tokens), lookup.accepted_of(verdict.emitted))

        with record_function("dflash2.emit"):
            sequence, stopped = self._emit(sequence, verdict.emitted)
        self.stats.acceptance_lengths.append(len(verdict.emitted))
        self.stats.verified_lengths.append(len(tree))
        with record_function("dflash2.context"):
            context = self.block.context_features(output.hidden_states, [0] + [node + 1 for node in verdict.nodes])
        return sequence, stopped, context, verdict

    def _copied_branch(self, sequence: torch.Tensor) -> CopiedBranch:
        """The context lookup's continuation of the sequence (up to ``lookup_tokens``, and no further than
        ``max_length``), with the length of the suffix it matched."""
        if not self.options.lookup_tokens:
            return CopiedBranch()
        room = self.max_length - sequence.shape[1] - 1
        tokens, matched = lookup_match(sequence[0].tolist(), min(self.options.lookup_tokens, room), self.lookup_ngram)
        return CopiedBranch(tokens, matched)

    def _grow_tree(self, lattice, sequence: torch.Tensor) -> tuple[DraftTree, CopiedBranch]:
        """The cycle's tree: drafted paths through the (pair-scored) lattice plus the context-lookup branch when asked,
        both sized together by the cycle cost and the lookup's odds when the block is adaptive."""
        lookup = self._copied_branch(sequence)
        nodes = self.options.tree_nodes
        if self.block_cutter is not None:
            gains = self.lookup_odds.gains(lookup.matched, len(lookup.tokens))
            nodes, copied = worthwhile_tree_size(lattice, nodes, self.block_cutter, lookup_gains=gains)
            lookup.keep(copied)
        tree = sampled_tree(lattice, nodes, self.temperature) if self.do_sample else likeliest_tree(lattice, nodes)
        tree.add_lookup_path(lookup.tokens)
        return tree, lookup

    def _verify_tree(self, sequence: torch.Tensor, tree: DraftTree, logits: torch.Tensor) -> TreeVerdict:
        """Verify a tree whose forward gave ``logits`` (row 0: after the anchor; row ``1 + n``: after node ``n``)."""

        def row(node: int) -> int:
            return 0 if node == ROOT else node + 1

        def processed(node: int) -> torch.Tensor:
            prefix = torch.cat([sequence, sequence.new_tensor([[tree.tokens[n] for n in tree.branch(node)]])], dim=1)
            return self._processed(prefix, prefix.shape[1], logits[row(node)])

        if not self.do_sample:
            if len(self.logits_processor) == 0 and not (self.keep_scores or self.keep_logits):
                choices = greedy_choices(logits)
                return verify_tree_greedy(tree, lambda node: choices[row(node)])
            return verify_tree_greedy(tree, lambda node: int(processed(node).argmax()))
        return verify_tree_sampled(tree, lambda node: torch.softmax(processed(node), dim=-1))
