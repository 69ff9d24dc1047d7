"""The decoding loop with token trees (``dflash_tree_nodes`` > 0): :class:`TreeDecoder` is :class:`DFlashDecoder`
with a cycle that verifies a :class:`~dflash2_hf.tree.DraftTree` instead of one path.

One cycle: draft a block -> pair-score the lattice -> (with ``adaptive_block``: the tree's size from the cycle
cost) -> several paths merged into a tree (with ``lookup_tokens``: plus a branch copied from the context) -> ONE
target forward over the anchor and every node (tree attention mask, tree positions) -> exact walk down the tree ->
the target's cache compacted to the accepted branch -> the branch's hidden states feed the next draft.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import record_function

from .context_lookup import DEFAULT_MAX_NGRAM, lookup_continuation
from .decoding import DFlashDecoder, DraftRecord
from .lattice import PathStrategy
from .tree import (ROOT, DraftTree, check_tree_cache, keep_branch, likeliest_tree, sampled_tree,
                   worthwhile_tree_size)
from .verification import TreeVerdict, greedy_choices, verify_tree_greedy, verify_tree_sampled


FORESIGHT_NGRAM = 3  # the shortest suffix match whose guess may end a plain-decoding pause


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
        anchor = int(sequence[0, -1])
        tree = DraftTree()
        lattice, hidden = self._draft(sequence, context)
        tick = time.perf_counter()
        if lattice is not None:
            with record_function("dflash2.select"):
                if self.options.path is not PathStrategy.ARGMAX:
                    lattice = self.block.score(lattice, hidden)
                tree = self._grow_tree(lattice, sequence)
            self.stats.select_seconds += time.perf_counter() - tick
            tick = time.perf_counter()

        with record_function("dflash2.verify_forward"):
            output = self._forward(
                sequence.new_tensor([[anchor] + tree.tokens]),
                attention_mask=tree.attention_mask(anchor_position, self.target.dtype),
                position_ids=tree.position_ids(anchor_position).to(sequence.device),
            )
        with record_function("dflash2.verify_decide"):
            verdict = self._verify_tree(sequence, tree, output.logits[0])
        with record_function("dflash2.cache_crop"):
            keep_branch(self.cache, anchor_position, verdict.nodes)
        self.stats.verify_seconds += time.perf_counter() - tick

        with record_function("dflash2.emit"):
            sequence, stopped = self._emit(sequence, verdict.emitted)
        self.stats.acceptance_lengths.append(len(verdict.emitted))
        self.stats.verified_lengths.append(len(tree))
        if self.stats.drafts is not None and lattice is not None:
            self.stats.drafts.append(DraftRecord(anchor_position, lattice.candidate_ids[0].cpu(), verdict.emitted[:-1]))
        with record_function("dflash2.context"):
            context = self.block.context_features(output.hidden_states, [0] + [node + 1 for node in verdict.nodes])
        return sequence, stopped, context

    def _grow_tree(self, lattice, sequence: torch.Tensor) -> DraftTree:
        """The cycle's tree: drafted paths through the (pair-scored) lattice, sized by the cycle cost when asked, plus
        the context-lookup branch when asked."""
        lookup = []
        if self.options.lookup_tokens:
            room = self.max_length - sequence.shape[1] - 1
            lookup = lookup_continuation(sequence[0].tolist(), min(self.options.lookup_tokens, room), self.lookup_ngram)
        nodes = self.options.tree_nodes
        if self.block_cutter is not None:  # priced with the lookup branch's tokens, verified in the same forward
            nodes = worthwhile_tree_size(lattice, nodes, self.block_cutter, lookup_tokens=len(lookup))
        tree = sampled_tree(lattice, nodes, self.temperature) if self.do_sample else likeliest_tree(lattice, nodes)
        tree.add_lookup_path(lookup)
        return tree

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
