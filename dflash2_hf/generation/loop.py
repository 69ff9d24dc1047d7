"""The one DFlash decoding loop, which both ``generate`` entries run (:mod:`dflash2_hf.generation.integration`).

It reads top to bottom: prefill the target, then per step either a plain one-token step or a drafted cycle (the
:class:`~dflash2_hf.cost.guard.DraftingGuard` decides, by what each has cost here; only plain steps where no
verification width is exact on this machine, :mod:`~dflash2_hf.generation.exact_widths`). One cycle: the drafter drafts a
block from the target's hidden states -> top-K lattice -> pair scores -> a token tree (one path is its one-branch case;
with ``tree_nodes`` several paths merged, plus a branch copied from the context) -> ONE target forward over the anchor
and every node -> ONE verifier (:mod:`dflash2_hf.generation.verification`, greedy or rejection sampling) -> the accepted branch
committed to the target's cache (:func:`~dflash2_hf.drafting.tree.commit_branch`) -> its tokens emitted, each checked against
the stopping criteria, so EOS, stop strings and ``max_new_tokens`` end the output exactly where plain ``generate``
would -> the accepted tokens' hidden states feed the next draft.

Everything ``generate`` prepared is reused: the target's cache, logits processors (temperature, top-k, top-p,
repetition penalty, min length, ...), stopping criteria and streamer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.profiler import record_function
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..cost.cycle_cost import CycleCost, cycle_cost_for
from ..cost.guard import DraftingGuard
from ..cost.timing import device_seconds
from ..drafting.block import BlockDrafter
from ..drafting.lattice import PathStrategy, SparseDistribution, path_confidences, sample_path, select_path
from ..drafting.lookup import (
    DEFAULT_MAX_NGRAM,
    FORESIGHT_NGRAM,
    LOOKUP_CYCLE_NGRAM,
    CopiedBranch,
    LookupOdds,
    lookup_continuation,
    lookup_match,
)
from ..drafting.tree import (
    ROOT,
    DraftTree,
    check_tree_cache,
    commit_branch,
    likeliest_tree,
    sampled_tree,
    worthwhile_tree_size,
)
from ..modeling import DFlashDraftModel
from ..drafting.options import DraftOptions
from .stats import DFlashGenerateOutput, DFlashStats, DraftRecord
from .verification import Verdict, greedy_choices, verify_greedy, verify_sampled


@dataclass
class Step:
    """What one step (a cycle, a lookup cycle or a plain step) left: the sequence, whether a stopping criterion fired,
    the features of the tokens the drafter has not seen yet, and the tokens the step emitted and verified."""

    sequence: torch.Tensor
    stopped: bool
    context: torch.Tensor
    emitted: int
    verified: int


def widest_forward(options: DraftOptions) -> int:
    """The most tokens one target forward of this generation verifies: a whole block, or a tree and its copied
    branch after the anchor."""
    return max(options.block_size, options.tree_nodes + options.lookup_tokens + 1)


class DFlashDecoder:
    """Runs one generation: prefill, then plain steps or drafted cycles until a stopping criterion fires."""

    def __init__(
        self,
        target: torch.nn.Module,
        drafter: DFlashDraftModel,
        options: DraftOptions,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        streamer: BaseStreamer | None,
        cache,
        drafts: bool = True,
    ):
        if options.tree_nodes:
            check_tree_cache(cache)  # branched trees are compacted out of the cache, which sliding windows cannot do
        self.target = target
        self.drafts = drafts  # False: no verification width is exact here, every step is a plain one
        self.device = target.device  # the guard's timings wait for the device's queued work
        self.drafter = drafter
        self.block = BlockDrafter(drafter, target, options)
        self.options = options
        self.do_sample = bool(generation_config.do_sample)
        self.temperature = float(generation_config.temperature or 1.0)
        self.max_length = generation_config.max_length
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        self.streamer = streamer
        self.cache = cache
        self.keep_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        self.keep_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
        self.scores: list[torch.Tensor] = []
        self.raw_logits: list[torch.Tensor] = []
        self.stats = DFlashStats(path=options.path.value, block_size=options.block_size,
                                 drafts=[] if options.record_drafts else None)
        self.block_cutter = self._block_cutter(options) if drafts else None
        # drafted positions read out through the LM head: a tree of n nodes is at most n deep
        self.draft_depth = min(options.block_size - 1, options.tree_nodes or options.block_size)
        # the longest suffix the context lookup matches: transformers' prompt-lookup setting, when given
        self.lookup_ngram = generation_config.max_matching_ngram_size or DEFAULT_MAX_NGRAM
        self.lookup_odds = LookupOdds()
        self.guard = None
        if drafts and options.plain_fallback is not False:
            self.guard = DraftingGuard(prices=self._guard_prices(options))
        # Steps without drafting may verify a copied branch alone, priced at the forward's cost with no draft.
        self.lookup_cost = None
        if self.guard is not None and options.lookup_tokens and isinstance(self.block_cutter, CycleCost):
            self.lookup_cost = CycleCost(0.0, self.block_cutter.verify_seconds)

    def _block_cutter(self, options: DraftOptions):
        """What decides how much of each drafted path (or tree) to verify: ``None`` verifies it whole."""
        if options.adaptive_block is False:
            return None
        longest = widest_forward(options)
        if options.adaptive_block is True:
            return cycle_cost_for(self.target, self.drafter, options.block_size, longest_forward=longest)
        cost = options.adaptive_block
        if isinstance(cost, CycleCost) and len(cost.verify_seconds) < longest:
            raise ValueError(f"The cycle cost covers verifying {len(cost.verify_seconds)} tokens; this generation "
                             f"verifies up to {longest}.")
        return cost

    def _guard_prices(self, options: DraftOptions) -> CycleCost | None:
        """What the guard prices steps by: the cost model given, else the wall clock when decoding greedily (the
        output is the same whichever steps are taken), else this machine's measured, cached cycle cost. A sampled
        step draws as many random numbers as its kind needs, so choosing steps by the clock would make the same seed
        give other text from run to run; by the cached cost, it gives the same text."""
        if options.plain_fallback is not True:
            return options.plain_fallback
        if not self.do_sample:
            return None
        if isinstance(self.block_cutter, CycleCost):
            return self.block_cutter
        return cycle_cost_for(self.target, self.drafter, options.block_size, longest_forward=widest_forward(options))

    def _forward(self, input_ids: torch.Tensor, **kwargs):
        return self.target(
            input_ids=input_ids,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=self.block.hidden_state_indices,
            **kwargs,
        )

    def _processed(self, sequence: torch.Tensor, prefix_length: int, logits: torch.Tensor) -> torch.Tensor:
        """The target's processed scores for the token after ``sequence[:, :prefix_length]``, as plain decoding does."""
        raw = logits.to(dtype=torch.float32, copy=True)[None]
        scores = self.logits_processor(sequence[:, :prefix_length], raw)[0]
        if self.keep_scores:
            self.scores.append(scores[None])
        if self.keep_logits:
            self.raw_logits.append(raw)
        return scores

    def _choose(self, scores: torch.Tensor) -> int:
        if self.do_sample:
            return int(torch.multinomial(torch.softmax(scores, dim=-1), 1))
        return int(scores.argmax())

    def _emit(self, sequence: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, bool]:
        """Append tokens one at a time, stopping right after the first one a stopping criterion flags."""
        stopped = False
        for count, token in enumerate(tokens, start=1):
            sequence = torch.cat([sequence, sequence.new_tensor([[token]])], dim=1)
            if bool(self.stopping_criteria(sequence, None).any()):
                tokens, stopped = tokens[:count], True
                break
        if self.streamer is not None:
            self.streamer.put(sequence.new_tensor([tokens]).cpu())
        return sequence, stopped

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Prefill, then per step a plain step or a drafted cycle (the guard decides, by what each cost here)."""
        step = self._prefill(input_ids)
        while not step.stopped:
            tick = device_seconds(self.device)
            if not self.drafts:
                step = self._plain_decoding_step(step.sequence)
            elif self.guard is None or self.guard.drafts_next():
                step = self._cycle(step.sequence, step.context)
                if self.guard is not None:
                    self.guard.record_cycle(step.emitted, step.verified, device_seconds(self.device) - tick)
            else:
                guess, length = self._foreseen_token(step.sequence), step.sequence.shape[1]
                step = self._plain_step(step.sequence, step.context)
                self.guard.record_plain(device_seconds(self.device) - tick,
                                        foreseen=guess == int(step.sequence[0, length]), tokens=step.emitted,
                                        verified=step.verified)
        if self.streamer is not None:
            self.streamer.end()
        return step.sequence

    def _prefill(self, input_ids: torch.Tensor) -> Step:
        """The target's forward over the prompt, and the first new token chosen as plain decoding chooses it."""
        started = time.perf_counter()
        output = self._forward(input_ids, logits_to_keep=1)
        # Every later target forward may be partly rolled back. Layers that keep only a window of states (sliding
        # attention) must hold on to what a crop may need until that crop; turned on after the prefill, so a long
        # prompt is not kept whole in those layers.
        self.cache.activate_past_recording()
        first = self._choose(self._processed(input_ids, input_ids.shape[1], output.logits[0, -1]))
        self.stats.prefill_seconds = time.perf_counter() - started
        context = self.block.context_features(output.hidden_states, input_ids.shape[1])
        sequence, stopped = self._emit(input_ids, [first])
        return Step(sequence, stopped, context, emitted=1, verified=0)

    def _foreseen_token(self, sequence: torch.Tensor) -> int | None:
        """With a lookup branch: a free guess at the next token (the one after the latest earlier occurrence of the
        text's last ``FORESIGHT_NGRAM`` or more tokens), which ends a plain-decoding pause early when it keeps coming
        true; none without one."""
        if not self.options.lookup_tokens:
            return None
        guess = lookup_continuation(sequence[0].tolist(), 1, self.lookup_ngram, min_ngram=FORESIGHT_NGRAM)
        return guess[0] if guess else None

    def _plain_step(self, sequence: torch.Tensor, context: torch.Tensor) -> Step:
        """A step without drafting: the tokens copied from the context alone, verified with the anchor where the cycle
        cost and the lookup's odds say they pay for their rows (a lookup cycle), else one plain step."""
        lookup = self._copied_branch(sequence) if self.lookup_cost is not None else CopiedBranch()
        if lookup.matched >= LOOKUP_CYCLE_NGRAM:
            lookup.keep(self.lookup_cost.worthwhile_size(self.lookup_odds.gains(lookup.matched, len(lookup.tokens))))
            if lookup.tokens:
                tree = DraftTree()
                tree.add_lookup_path(lookup.tokens)
                self.stats.lookup_cycles += 1
                return self._check(sequence, tree, lookup)[0]
        return self._one_token_step(sequence, context)

    def _one_token_step(self, sequence: torch.Tensor, context: torch.Tensor) -> Step:
        """One step of plain decoding: the target's forward over the last token alone, its next token chosen as plain
        decoding chooses it; that token's hidden states join the context the drafter has not seen yet."""
        with record_function("dflash2.plain_step"):
            output = self._forward(sequence[:, -1:])
            token = self._choose(self._processed(sequence, sequence.shape[1], output.logits[0, -1]))
            self.cache.crop(0)  # sliding-window layers back to their window, as after a cycle
        sequence, stopped = self._emit(sequence, [token])
        self.stats.plain_steps += 1
        context = torch.cat([context, self.block.context_features(output.hidden_states, 1)], dim=1)
        return Step(sequence, stopped, context, emitted=1, verified=0)

    def _plain_decoding_step(self, sequence: torch.Tensor) -> Step:
        """A step of a call that drafts nothing (no verification width is exact here): plain decoding's step, without
        the hidden states a draft would read."""
        output = self.target(input_ids=sequence[:, -1:], cache=self.cache, use_cache=True)
        token = self._choose(self._processed(sequence, sequence.shape[1], output.logits[0, -1]))
        self.cache.crop(0)  # sliding-window layers back to their window
        sequence, stopped = self._emit(sequence, [token])
        self.stats.plain_steps += 1
        return Step(sequence, stopped, sequence[:, :0], emitted=1, verified=0)

    def _draft(self, sequence: torch.Tensor, context: torch.Tensor):
        """The timed draft of the block after the sequence's last token: its lattice and the drafter's hidden states,
        or ``(None, None)`` when no drafted token fits before ``max_length``."""
        length = min(self.draft_depth, self.max_length - sequence.shape[1] - 1)
        if length <= 0:
            return None, None
        tick = time.perf_counter()
        with record_function("dflash2.draft"):
            drafted = self.block.draft(context, int(sequence[0, -1]), sequence.shape[1] - 1, length)
        self.stats.draft_seconds += time.perf_counter() - tick
        return drafted

    def _cycle(self, sequence: torch.Tensor, context: torch.Tensor) -> Step:
        """One drafted cycle: draft, grow the token tree over the (pair-scored) lattice, verify it in one target
        forward, commit the accepted branch, emit."""
        anchor_position = sequence.shape[1] - 1
        tree, lookup = DraftTree(), CopiedBranch()
        lattice, hidden = self._draft(sequence, context)
        if lattice is not None:
            tick = time.perf_counter()
            with record_function("dflash2.select"):
                if self.options.path is not PathStrategy.ARGMAX:
                    lattice = self.block.score(lattice, hidden)
                tree, lookup = self._grow(lattice, sequence)
            self.stats.select_seconds += time.perf_counter() - tick
        step, verdict = self._check(sequence, tree, lookup)
        if self.stats.drafts is not None and lattice is not None:
            drafted = tree.tokens if tree.is_chain() else verdict.emitted[:-1]
            self.stats.drafts.append(DraftRecord(anchor_position, lattice.candidate_ids[0].cpu(), drafted))
        return step

    def _grow(self, lattice, sequence: torch.Tensor) -> tuple[DraftTree, CopiedBranch]:
        """The cycle's token tree: one path (``tree_nodes`` 0), or several paths merged plus the context lookup's
        branch, both sized together by the cycle cost and the lookup's odds when the block is adaptive."""
        if not self.options.tree_nodes:
            return self._path(lattice), CopiedBranch()
        lookup = self._copied_branch(sequence)
        nodes = self.options.tree_nodes
        if self.block_cutter is not None:
            gains = self.lookup_odds.gains(lookup.matched, len(lookup.tokens))
            nodes, copied = worthwhile_tree_size(lattice, nodes, self.block_cutter, lookup_gains=gains)
            lookup.keep(copied)
        tree = sampled_tree(lattice, nodes, self.temperature) if self.do_sample else likeliest_tree(lattice, nodes)
        tree.add_lookup_path(lookup.tokens)
        return tree, lookup

    def _path(self, lattice) -> DraftTree:
        """One path through the lattice as a one-branch tree: picked by the path strategy (greedy decoding) or drawn
        from the selector's conditional distributions (sampling, each node keeping the distribution its child was
        drawn from); cut to its most profitable prefix when the block length is adaptive."""
        proposals = None
        if self.do_sample:
            picks, q = sample_path(lattice, self.temperature)
            proposals = [SparseDistribution(lattice.candidate_ids[0, i], q[0][i]) for i in range(picks.shape[1])]
        else:
            picks = select_path(lattice, self.options.path)
        if self.block_cutter is not None:
            confidences = path_confidences(lattice, picks, self.do_sample, self.temperature if self.do_sample else 1.0)
            keep = self.block_cutter.verified_length(confidences[0].tolist())
            picks, proposals = picks[:, :keep], None if proposals is None else proposals[:keep]
        tree = DraftTree()
        tree.add_path(lattice.tokens(picks)[0].tolist(), proposals)
        return tree

    def _copied_branch(self, sequence: torch.Tensor) -> CopiedBranch:
        """The context lookup's continuation of the sequence (up to ``lookup_tokens``, and no further than
        ``max_length``), with the length of the suffix it matched."""
        if not self.options.lookup_tokens:
            return CopiedBranch()
        room = self.max_length - sequence.shape[1] - 1
        tokens, matched = lookup_match(sequence[0].tolist(), min(self.options.lookup_tokens, room), self.lookup_ngram)
        return CopiedBranch(tokens, matched)

    def _check(self, sequence: torch.Tensor, tree: DraftTree, lookup: CopiedBranch) -> tuple[Step, Verdict]:
        """Verify ``tree`` (its lookup branch ``lookup``) after the sequence's last token in one target forward, commit
        the accepted branch to the cache, emit its tokens and record the cycle."""
        tick = time.perf_counter()
        anchor_position = sequence.shape[1] - 1
        with record_function("dflash2.verify_forward"):
            output = self._verify_forward(sequence, tree, anchor_position)
        with record_function("dflash2.verify_decide"):
            verdict = self._verify(sequence, tree, output.logits[0])
        with record_function("dflash2.cache_commit"):
            commit_branch(self.cache, anchor_position, verdict.nodes, len(tree))
        self.stats.verify_seconds += time.perf_counter() - tick
        self.lookup_odds.record(lookup.matched, len(lookup.tokens), lookup.accepted_of(verdict.emitted))

        with record_function("dflash2.emit"):
            sequence, stopped = self._emit(sequence, verdict.emitted)
        self.stats.acceptance_lengths.append(len(verdict.emitted))
        self.stats.verified_lengths.append(len(tree))
        with record_function("dflash2.context"):
            context = self.block.context_features(output.hidden_states, [0] + [node + 1 for node in verdict.nodes])
        return Step(sequence, stopped, context, len(verdict.emitted), len(tree)), verdict

    def _verify_forward(self, sequence: torch.Tensor, tree: DraftTree, anchor_position: int):
        """The target's forward over the anchor and every node: a one-branch tree with the plain causal mask, a
        branched one with the tree's attention mask and positions."""
        tokens = sequence.new_tensor([[int(sequence[0, -1])] + tree.tokens])
        if tree.is_chain():
            return self._forward(tokens)
        return self._forward(tokens, attention_mask=tree.attention_mask(anchor_position, self.target.dtype),
                             position_ids=tree.position_ids(anchor_position).to(sequence.device))

    def _verify(self, sequence: torch.Tensor, tree: DraftTree, logits: torch.Tensor) -> Verdict:
        """Verify a tree whose forward gave ``logits`` (row 0: after the anchor; row ``1 + n``: after node ``n``)."""

        def row(node: int) -> int:
            return 0 if node == ROOT else node + 1

        def processed(node: int) -> torch.Tensor:
            prefix = torch.cat([sequence, sequence.new_tensor([[tree.tokens[n] for n in tree.branch(node)]])], dim=1)
            return self._processed(prefix, prefix.shape[1], logits[row(node)])

        if not self.do_sample:
            if len(self.logits_processor) == 0 and not (self.keep_scores or self.keep_logits):
                choices = greedy_choices(logits)
                return verify_greedy(tree, lambda node: choices[row(node)])
            return verify_greedy(tree, lambda node: int(processed(node).argmax()))
        return verify_sampled(tree, lambda node: torch.softmax(processed(node), dim=-1))

    def output(self, sequence: torch.Tensor, prompt_length: int, return_dict: bool):
        """What ``generate`` returns: the sequences, or a dict output with scores/logits of the emitted tokens."""
        if not return_dict:
            return sequence
        emitted = sequence.shape[1] - prompt_length  # tokens processed past a stop are dropped
        return DFlashGenerateOutput(
            sequences=sequence,
            scores=tuple(self.scores[:emitted]) if self.keep_scores else None,
            logits=tuple(self.raw_logits[:emitted]) if self.keep_logits else None,
            cache=self.cache,
            dflash_stats=self.stats,
        )
