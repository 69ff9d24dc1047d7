"""Training DFlash / DFlash 2 drafters for any transformers causal LM: the loop.

Each step takes a few target-generated sequences, runs the frozen target once to get the features at
``target_layer_ids``, packs many blocks per sequence at random anchors in the response and trains on the drafter's
and the selector's losses (the blocks, their masks and the losses: :mod:`dflash2_hf.training.blocks`; the drafter's
config, starting weights and LoRA wrapping: :mod:`dflash2_hf.training.setup`).

A selector trained on a frozen drafter can take its blocks where decoding drafts them instead (``anchors="decoding"``):
at the anchors greedy decoding with the drafter's argmax path visits on the target's own answers, which lie mostly
where acceptance is low, while random anchors count every position alike.

The loop uses ``accelerate`` (one process, or ``accelerate launch --num_processes N`` for DDP), AdamW with warmup +
cosine decay, gradient clipping and bf16 autocast where the hardware computes bf16 (a GPU, or a CPU with bf16
instructions: :func:`~dflash2_hf.training.setup.fastest_dtype`), and resumes bit-for-bit from its latest checkpoint.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from safetensors import SafetensorError
from tqdm.auto import tqdm

from ..drafting.lattice import PathStrategy, build_lattice, score_lattice, select_path
from ..modeling import DFlashDraftModel
from .blocks import (
    IGNORE,
    BlockBatch,
    anchor_range,
    block_attention,
    block_positions,
    blocks_at,
    decoding_anchors,
    position_weights,
    sample_blocks,
    selector_loss,
    selector_positions,
)
from .checkpoint import checkpoints, latest_checkpoint, load_checkpoint, save_checkpoint
from .labels import LABEL_SOURCES, missing_choices
from .features import FeatureStore, layout_key
from .setup import fastest_dtype, is_peft_model


class TrainingDiverged(ValueError):
    """The loss or the trained weights went NaN or infinite; the message names the step and the checkpoint kept."""


@dataclass
class TrainingConfig:
    """Settings of one training run (recorded next to its checkpoints)."""

    output_dir: str
    steps: int = 1000
    batch_size: int = 4
    blocks_per_sequence: int = 16
    max_length: int = 512
    learning_rate: float = 6e-4
    warmup_steps: int = 50
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    loss_decay_gamma: float = 7.0
    distill_weight: float = 0.0  # share of the drafter loss taken from the target's whole next-token distribution
    selector_weight: float = 1.0
    selector_gold: str = "insert"  # "insert": gold joins the candidates when missing; "skip": such positions don't count
    train_drafter: bool = True
    anchors: str = "random"  # "decoding": the blocks greedy decoding with the frozen drafter's argmax path drafts
    labels: str = "text"  # where block labels come from: one of LABEL_SOURCES (training/labels.py)
    checkpoint_every: int = 50
    heldout_fraction: float = 0.0
    seed: int = 0
    bf16: bool | None = None  # bf16 autocast; None: where the hardware computes bf16 (fastest_dtype)
    feature_cache_gb: float = 8.0  # target features kept in memory; sequences past it are read from the store
    feature_store: str | None = None  # folder keeping every sequence's target features on disk (None: memory only)

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = fastest_dtype() == torch.bfloat16
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}.")
        for name in ("batch_size", "blocks_per_sequence", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1) (the share of records held out; at least one record "
                             f"must be left to train on), got {self.heldout_fraction}.")
        if self.selector_gold not in ("insert", "skip"):
            raise ValueError(f"selector_gold must be 'insert' or 'skip', got {self.selector_gold!r}.")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(f"distill_weight must be between 0 and 1, got {self.distill_weight}.")
        if self.anchors not in ("random", "decoding"):
            raise ValueError(f"anchors must be 'random' or 'decoding', got {self.anchors!r}.")
        if self.labels not in LABEL_SOURCES:
            raise ValueError(f"labels must be one of {', '.join(LABEL_SOURCES)}, got {self.labels!r}.")
        if self.anchors == "decoding" and self.train_drafter:
            raise ValueError("anchors='decoding' needs a frozen drafter (train_drafter=False): the anchors come from "
                             "the drafter's own decoding and are computed once per sequence.")


def split_heldout(records: list[dict], heldout_fraction: float) -> tuple[list[dict], list[dict]]:
    """``(training, held out)``: the last ``int(len(records) * heldout_fraction)`` records are held out."""
    held = int(len(records) * heldout_fraction)
    return (records[:-held], records[-held:]) if held else (records, [])


def check_trainable(records: list[dict], max_length: int, labels: str = "text") -> None:
    """Refuse training records none of which has an answer token within ``max_length`` to label (every response
    empty, or cut off), with ``ValueError``: a run on them would learn nothing yet report loss 0 and save an untrained
    drafter; and, for labels from the target's choices, records that hold none. Cheap, so a command checks its data
    with it before any model loads."""
    if not any(anchor_range(record, max_length) for record in records):
        raise ValueError(f"none of the {len(records)} training records has an answer token to learn from (every "
                         f"response is empty, or its prompt fills the {max_length} tokens a sequence is cut to); make "
                         "the data again with `dflash2-hf data`.")
    missing = missing_choices(records) if labels != "text" else 0
    if missing:
        raise ValueError(f"labels {labels!r} read the target's choices, which {missing} of the {len(records)} training "
                         "records lack; make the data with `dflash2-hf data --existing-responses` (which records them), "
                         "or train with --labels text.")


@dataclass
class StepMetrics:
    loss: float
    drafter_loss: float
    selector_loss: float
    accuracy_by_position: list[float] = field(default_factory=list)


class DrafterTrainer:
    """Trains a drafter for a frozen target on cached target responses (see the module docstring)."""

    def __init__(self, drafter: DFlashDraftModel, target: torch.nn.Module, records: list[dict], config: TrainingConfig):
        self.config = config
        # bf16 autocast is the trainer's own (:meth:`_autocast`), not accelerate's: a model accelerate prepares for
        # mixed precision autocasts every forward, so the held-out measures could not run it as decoding does.
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no")
        drafter.config.check_fits_target(target.config, target.get_output_embeddings().weight.shape[0])
        self.target = target.eval().requires_grad_(False).to(self.accelerator.device)
        self.records, self.heldout = split_heldout(records, config.heldout_fraction)
        self.output_dir = Path(config.output_dir)
        if not is_peft_model(drafter):  # PEFT decides what trains (adapters, modules_to_save)
            drafter.requires_grad_(config.train_drafter)
            if drafter.candidate_selector is not None:
                drafter.candidate_selector.requires_grad_(True)
            if drafter.draft_head is not None:  # rows of the target's head, frozen as the target's head is
                drafter.draft_head.requires_grad_(False)
        trainable = [p for p in drafter.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)
        self.drafter, self.optimizer = self.accelerator.prepare(drafter, optimizer)
        # Not prepared: accelerate would step a prepared scheduler once per process, and our steps count global
        # batches (each process takes its rows of the same batch).
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.weights = position_weights(drafter.config.block_size, config.loss_decay_gamma)
        self.step = 0
        self.history: list[dict] = []
        self.feature_cache: dict[int, torch.Tensor] = {}
        self.feature_cache_bytes = 0
        self.feature_store = (FeatureStore(config.feature_store, layout_key(target.config, self._feature_layers(),
                                                                            self.target.dtype))
                              if config.feature_store else None)
        self.visited_anchors: dict[int, list[int]] = {}

    def _lr_factor(self, step: int) -> float:
        if step < self.config.warmup_steps:
            return (step + 1) / self.config.warmup_steps
        progress = (step - self.config.warmup_steps) / max(1, self.config.steps - self.config.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def _autocast(self, enabled: bool = True) -> torch.autocast:
        """The run's bf16 autocast (where ``config.bf16``), or none when not ``enabled``."""
        return torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16, enabled=bool(self.config.bf16 and enabled))

    @property
    def unwrapped(self) -> DFlashDraftModel:
        return self.accelerator.unwrap_model(self.drafter)

    def batch_for_step(self, step: int) -> BlockBatch:
        """This process's share of the deterministic global batch of ``step`` (a resumed run sees the same data)."""
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step)
        rows = torch.randint(0, len(self.records), (self.config.batch_size,), generator=generator).tolist()
        drafter, sequences = self.unwrapped, [self.records[i] for i in rows]
        if self.config.anchors == "decoding":
            anchors = []
            for row in rows:
                visited = torch.tensor(self.decoding_anchors_of(row), dtype=torch.long)
                chosen = visited[torch.randperm(len(visited), generator=generator)[: self.config.blocks_per_sequence]]
                anchors.append(chosen.sort().values.tolist())
            batch = blocks_at(sequences, anchors, drafter.block_size, self.config.max_length, record_ids=rows,
                              slots=self.config.blocks_per_sequence, labels=self.config.labels)
        else:
            batch = sample_blocks(sequences, drafter.block_size, self.config.blocks_per_sequence,
                                  self.config.max_length, generator, record_ids=rows, labels=self.config.labels)
        return batch.rows(self.accelerator.process_index, self.accelerator.num_processes)

    def decoding_anchors_of(self, record_id: int) -> list[int]:
        """The anchors greedy decoding of training record ``record_id`` visits with the drafter's argmax path (the
        record being the target's greedy answer), blocks wholly inside the sequence; computed once (the drafter is
        frozen when training uses them). In fp32 with an fp32 target, as decoding runs by default; under the run's
        autocast with a bf16 target (whose LM head then reads bf16)."""
        if record_id not in self.visited_anchors:
            record = self.records[record_id]
            exact = self.target.dtype == torch.float32
            with self._evaluating():
                lengths = self._acceptance_at_every_anchor(record, record_id, mixed_precision=not exact,
                                                           argmax_only=True)
            lengths = lengths.get(PathStrategy.ARGMAX.value, [])  # none: the answer is shorter than a block
            first = len(record["prompt_ids"])
            self.visited_anchors[record_id] = [first + anchor for anchor in decoding_anchors(lengths)]
        return self.visited_anchors[record_id]

    def _feature_layers(self) -> list[int]:
        """The target's hidden states the features hold: the tapped layers' outputs, and the final (normed) one
        when distilling."""
        layers = [i + 1 for i in self.unwrapped.target_layer_ids]
        if self.config.distill_weight > 0:
            layers.append(self.target.config.num_hidden_layers)
        return layers

    @torch.no_grad()
    def _target_states(self, record_id: int, input_ids: torch.Tensor) -> torch.Tensor:
        """Target states of one unpadded sequence, ``[T, taps * hidden]`` (the tapped layers' features), plus the
        final (normed) hidden state as the last ``hidden`` columns when distilling, in the target's dtype: computed
        once per sequence where a ``feature_store`` keeps them on disk, and kept in memory while the cache stays
        under ``feature_cache_gb``."""
        if record_id in self.feature_cache:
            return self.feature_cache[record_id]
        states = self.feature_store.load(input_ids) if self.feature_store else None
        if states is None:
            layers = self._feature_layers()
            output = self.target(input_ids=input_ids[None].to(self.accelerator.device), output_hidden_states=layers,
                                 logits_to_keep=1)
            states = torch.cat([output.hidden_states[i] for i in layers], dim=-1)[0]
            if self.feature_store:
                self.feature_store.save(input_ids, states)
        states = states.to(self.accelerator.device)
        size = states.numel() * states.element_size()
        if self.feature_cache_bytes + size <= self.config.feature_cache_gb * 2**30:
            self.feature_cache[record_id] = states
            self.feature_cache_bytes += size
        return states

    def target_states(self, batch: BlockBatch) -> torch.Tensor:
        """``[b, T, ...]`` target states (see ``_target_states``) of the batch's sequences, zero past each end."""
        rows = [self._target_states(rid, ids[mask.bool()])
                for rid, ids, mask in zip(batch.record_ids, batch.input_ids, batch.attention_mask)]
        states = rows[0].new_zeros(len(rows), batch.input_ids.shape[1], rows[0].shape[-1])
        for row, values in enumerate(rows):
            states[row, : values.shape[0]] = values
        return states

    @torch.no_grad()
    def target_block_logits(self, batch: BlockBatch, states: torch.Tensor | None = None) -> torch.Tensor:
        """The target's next-token logits for every drafted position, ``[N, B-1, vocab]`` in fp32: drafted position
        ``k`` of a block at anchor ``a`` is the target's prediction at ``a + k - 1``. ``states``: the batch's
        ``target_states``, when already at hand."""
        block = self.unwrapped.block_size
        states = self.target_states(batch) if states is None else states
        final = states[..., -self.target.config.hidden_size:]
        positions = (batch.anchors.clamp_min(0)[:, :, None] + torch.arange(block - 1)).clamp_max(final.shape[1] - 1)
        rows = torch.arange(final.shape[0])[:, None, None]
        picked = final[rows, positions].flatten(0, 1).to(self.accelerator.device)
        return self.target.get_output_embeddings()(picked).float()

    def _teacher_logits(self, batch: BlockBatch, states: torch.Tensor) -> torch.Tensor:
        """:meth:`target_block_logits` over the tokens the drafter drafts from (its draft vocabulary, if any)."""
        logits = self.target_block_logits(batch, states)
        vocabulary = self.unwrapped.draft_vocabulary
        return logits if vocabulary is None else logits[..., vocabulary.to(logits.device)]

    def _forward(
        self, batch: BlockBatch, mixed_precision: bool = True, states: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Drafter hidden states and logits of every drafted position, ``[N, B-1, ...]``, with labels ``[N, B]``
        (under the run's autocast unless ``mixed_precision`` is off). ``states``: the batch's ``target_states``, when
        already at hand."""
        drafter, device = self.unwrapped, self.accelerator.device
        block = drafter.block_size
        states = self.target_states(batch) if states is None else states
        taps = len(drafter.target_layer_ids) * self.target.config.hidden_size
        features = states[..., :taps].to(torch.float32)
        batch_size, blocks = batch.anchors.shape
        noise_ids = torch.full((batch_size, blocks, block), drafter.mask_token_id, dtype=torch.long)
        noise_ids[:, :, 0] = batch.labels[:, :, 0].clamp_min(0)
        embeds = self.target.get_input_embeddings()(noise_ids.flatten(1).to(device)).float()
        embeds = embeds * float(drafter.config.input_embedding_scale)
        with self._autocast(mixed_precision):
            hidden = self.drafter(
                embeds,
                context_hidden_states=features,
                position_ids=block_positions(batch.anchors, features.shape[1], block).to(device),
                attention_mask=block_attention(batch.anchors, batch.attention_mask, block).to(device),
                block_length=block,
            ).last_hidden_state
            hidden = hidden.view(batch_size * blocks, block, -1)[:, 1:]
            logits = drafter.compute_logits(hidden, self.target.get_output_embeddings()).float()
        return hidden, logits, batch.labels.reshape(batch_size * blocks, block).to(device)

    def losses(self, batch: BlockBatch) -> tuple[torch.Tensor, StepMetrics]:
        """Forward pass and losses for one batch."""
        drafter, device = self.unwrapped, self.accelerator.device
        states = self.target_states(batch)
        hidden, logits, labels = self._forward(batch, states=states)
        gold = labels[:, 1:]
        valid = gold != IGNORE
        head_gold = drafter.head_token_ids(gold)  # the gold token's logit; none outside a draft vocabulary
        token_losses = F.cross_entropy(logits.flatten(0, 1), head_gold.clamp_min(0).flatten(),
                                       reduction="none").view_as(gold) * (head_gold >= 0)
        if self.config.distill_weight > 0:  # soft labels: cross-entropy against the target's whole distribution
            teacher = self._teacher_logits(batch, states).softmax(-1)
            soft_losses = -(teacher * logits.log_softmax(-1)).sum(-1)
            share = self.config.distill_weight
            token_losses = (1 - share) * token_losses + share * soft_losses
        weights = self.weights.to(device)[None, :] * valid
        # Normalise by the global batch's share per process, so DDP's gradient average is the global-batch mean.
        everything = labels if batch.global_labels is None else batch.global_labels.flatten(0, 1).to(device)
        processes = self.accelerator.num_processes
        weight_total = (self.weights.to(device)[None, :] * (everything[:, 1:] != IGNORE)).sum() / processes
        drafter_loss = (token_losses * weights).sum() / weight_total.clamp_min(1e-6)
        select = torch.zeros((), device=device)
        if drafter.candidate_selector is not None and self.config.selector_weight > 0:
            with self._autocast():
                scored = selector_positions(everything).sum() / processes
                select = selector_loss(drafter, hidden if self.config.train_drafter else hidden.detach(), logits,
                                       labels, normaliser=scored.clamp_min(1),
                                       embedding_table=self.target.get_input_embeddings().weight.detach(),
                                       insert_missing_gold=self.config.selector_gold == "insert")
        loss = (drafter_loss if self.config.train_drafter else 0.0) + self.config.selector_weight * select
        correct = (drafter.target_token_ids(logits.argmax(-1)) == gold) & valid
        accuracy = (correct.sum(0) / valid.sum(0).clamp_min(1)).tolist()
        return loss, StepMetrics(float(loss.detach()), float(drafter_loss.detach()), float(select.detach()), accuracy)

    @torch.no_grad()
    def heldout_acceptance(self) -> dict[str, float]:
        """Mean acceptance length on held-out sequences: 1 + the drafted prefix that matches the target's own
        continuation, for the ``argmax`` path and, with a candidate selector, DFlash 2's ``greedy`` walk over the
        top-K lattice (the same lattice code decoding runs). The data are the target's greedy outputs, so this is
        what greedy decoding with this drafter accepts (counting the target's extra token), measured teacher-forced:
        while a path matches, its predecessors are the gold tokens. Blocks start at random anchors, as in training.
        Sequences go through in training-batch-sized chunks: all at once, the logits alone would take ``sequences x
        blocks x block x vocabulary`` floats (tens of GB for a 150K vocabulary). Empty without held-out sequences."""
        generator = torch.Generator().manual_seed(12345)
        accepted: dict[str, list[torch.Tensor]] = {}
        with self._evaluating():
            for start in range(0, len(self.heldout), self.config.batch_size):
                chunk = self.heldout[start: start + self.config.batch_size]
                batch = sample_blocks(chunk, self.unwrapped.block_size, self.config.blocks_per_sequence,
                                      self.config.max_length, generator, record_ids=self._heldout_ids(start, len(chunk)))
                for path, lengths in self._acceptance_lengths(batch).items():
                    accepted.setdefault(path, []).append(lengths)
        return {path: float(torch.cat(values).float().mean()) for path, values in accepted.items()}  # nan: no block

    @torch.no_grad()
    def heldout_decoding_acceptance(self, tokens: int = 128) -> dict[str, float]:
        """Like :meth:`heldout_acceptance`, but over the blocks greedy decoding of each held-out answer would draft:
        the first after the answer's first token (which the target's pass over the prompt gives), each next one where
        the previous block's accepted tokens end, up to ``tokens`` tokens into the answer (each path follows its own
        anchors; one drafted path, no tree).

        The drafter runs in its own dtype, without the run's autocast, as decoding runs it: with the target's
        greedy answers as data, this is the acceptance greedy decoding of those prompts shows (exactly so in fp32).
        :meth:`heldout_acceptance` counts every position alike and comes out higher: decoding crosses a stretch where
        blocks accept many tokens in few blocks, so most of its blocks lie where acceptance is low."""
        accepted: dict[str, list[int]] = {}
        with self._evaluating():
            answers = tqdm(self.heldout, desc="held-out, decoding anchors", unit="answer",
                           disable=not self.accelerator.is_main_process)
            for index, record in enumerate(answers):
                by_anchor = self._acceptance_at_every_anchor(record, self._heldout_ids(index, 1)[0], tokens)
                for path, lengths in by_anchor.items():
                    accepted.setdefault(path, []).extend(lengths[anchor] for anchor in decoding_anchors(lengths))
        return {path: sum(values) / len(values) for path, values in accepted.items() if values}

    @torch.no_grad()
    def _acceptance_at_every_anchor(
        self, record: dict, record_id: int, tokens: int | None = None, mixed_precision: bool = False,
        argmax_only: bool = False,
    ) -> dict[str, list[int]]:
        """Per path, the teacher-forced acceptance length of the block at every anchor from the answer's first token
        on (index 0: that anchor), up to ``tokens`` tokens into the answer (default: all), blocks wholly inside the
        sequence; the drafter in its own dtype, without autocast (as decoding runs it) unless ``mixed_precision``;
        the argmax path alone when ``argmax_only`` (no selector walk)."""
        block = self.unwrapped.block_size
        first = len(record["prompt_ids"])
        length = min(first + len(record["response_ids"]), self.config.max_length)
        end = length - block + 1 if tokens is None else min(first + tokens, length - block + 1)
        anchors = list(range(first, end))
        chunk = self.config.batch_size * self.config.blocks_per_sequence
        by_anchor: dict[str, list[int]] = {}
        for start in range(0, len(anchors), chunk):
            batch = blocks_at([record], [anchors[start: start + chunk]], block, self.config.max_length,
                              record_ids=[record_id])
            for path, lengths in self._acceptance_lengths(batch, mixed_precision, argmax_only).items():
                by_anchor.setdefault(path, []).extend(lengths.tolist())
        return by_anchor

    @contextmanager
    def _evaluating(self):
        """The drafter in eval mode for the duration, back to its previous mode after."""
        was_training = self.drafter.training
        self.drafter.eval()
        try:
            yield
        finally:
            self.drafter.train(was_training)

    @staticmethod
    def _heldout_ids(start: int, count: int) -> list[int]:
        """Feature-cache keys of held-out records ``start .. start + count - 1`` (negative: apart from training's)."""
        return [-1 - i for i in range(start, start + count)]

    def _acceptance_lengths(
        self, batch: BlockBatch, mixed_precision: bool = True, argmax_only: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Per path, the teacher-forced acceptance length of each of the batch's blocks that lies wholly inside its
        sequence (1 + the drafted prefix matching the labels), in block order; the argmax path alone when
        ``argmax_only``."""
        hidden, logits, labels = self._forward(batch, mixed_precision)
        full = (labels[:, 1:] != IGNORE).all(-1)
        paths = self._heldout_paths(hidden[full], logits[full], labels[full, 0], walk_selector=not argmax_only)
        return {path: 1 + (drafted == labels[full, 1:]).long().cumprod(-1).sum(-1) for path, drafted in paths.items()}

    def _heldout_paths(
        self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor, walk_selector: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Drafted tokens ``[N, B-1]`` of the argmax path and, with a selector (unless ``walk_selector`` is off),
        of the greedy lattice walk."""
        drafter = self.unwrapped
        paths = {PathStrategy.ARGMAX.value: drafter.target_token_ids(logits.argmax(-1))}
        selector = drafter.candidate_selector
        if selector is not None and walk_selector:
            lattice = build_lattice(logits, anchors, selector.top_k)
            lattice.candidate_ids = drafter.target_token_ids(lattice.candidate_ids)
            score_lattice(lattice, selector, hidden.float(), self.target.get_input_embeddings().weight)
            paths[PathStrategy.GREEDY.value] = lattice.tokens(select_path(lattice, PathStrategy.GREEDY))
        return paths

    def resume(self) -> None:
        """Continue from the newest intact checkpoint in ``output_dir``, if there is one. A newer one that cannot be
        read (weights cut short by a full disk, a file edited) is skipped with a warning naming it; when none can be
        read, the run is refused rather than started over on top of them."""
        damaged = []
        for found in reversed(checkpoints(self.output_dir)):
            try:
                state = load_checkpoint(found, self.unwrapped, self.optimizer, self.scheduler)
            except (OSError, ValueError, KeyError, SafetensorError) as error:
                damaged.append(f"{found.name} ({error})")
                continue
            if damaged:
                warnings.warn(f"Resuming from {found}: the newer {'; '.join(damaged)} cannot be read.", stacklevel=2)
            self.step = state["step"]
            self.history = state["extra"].get("history", [])
            return
        if damaged:
            raise ValueError(f"No checkpoint in {self.output_dir} can be read: {'; '.join(damaged)}. Move them away "
                             "to start afresh, or pass a new --out.")

    def save(self) -> None:
        if self.accelerator.is_main_process:
            save_checkpoint(self.output_dir, self.step, self.unwrapped.state_dict(), self.optimizer, self.scheduler,
                            extra={"history": self.history, "config": asdict(self.config)})
        self.accelerator.wait_for_everyone()

    def train(self) -> list[dict]:
        """Run (or finish) the configured number of steps; returns the per-step history. Training records without
        an answer token to learn from are refused first (:func:`check_trainable`)."""
        check_trainable(self.records, self.config.max_length, self.config.labels)
        self.resume()
        self.drafter.train()
        with tqdm(total=self.config.steps, initial=self.step, desc="training", unit="step",
                  disable=not self.accelerator.is_main_process) as progress:
            while self.step < self.config.steps:
                metrics = self.train_step()
                checkpoint_due = self.step % self.config.checkpoint_every == 0 or self.step == self.config.steps
                if self.heldout and checkpoint_due:
                    self.record_heldout_acceptance()
                progress.update(1)
                progress.set_postfix(loss=f"{metrics.loss:.3f}", acc1=f"{metrics.accuracy_by_position[0]:.2f}")
                if checkpoint_due:
                    self.save()
        return self.history

    def train_step(self) -> StepMetrics:
        """One optimizer step on the next batch, recorded in the history; a loss or weights gone non-finite stop
        the run (:class:`TrainingDiverged`) before anything is saved from them."""
        started = time.perf_counter()
        loss, metrics = self.losses(self.batch_for_step(self.step))
        self.accelerator.backward(loss)
        self.accelerator.clip_grad_norm_(self.drafter.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        self.step += 1
        self.check_finite(metrics.loss)
        self.history.append({"step": self.step, "seconds": time.perf_counter() - started,
                             "lr": self.scheduler.get_last_lr()[0], **asdict(metrics)})
        return metrics

    def check_finite(self, loss: float) -> None:
        """Stop at the step whose loss or trained weights are NaN or infinite, naming it and the last checkpoint
        kept (all of them finite: each was checked when its step ran)."""
        trained = [weight for weight in self.unwrapped.parameters() if weight.requires_grad]
        weights_finite = not trained or bool(torch.stack([torch.isfinite(w).all() for w in trained]).all())
        if math.isfinite(loss) and weights_finite:
            return
        what = f"the loss is {loss}" if not math.isfinite(loss) else "the weights hold NaN or Inf"
        kept = latest_checkpoint(self.output_dir)
        raise TrainingDiverged(
            f"Training diverged at step {self.step}: {what} (learning rate {self.config.learning_rate}). Nothing was "
            f"saved from it; {f'the last checkpoint, {kept}, is finite' if kept else 'no checkpoint was saved'}. "
            "Train again with a lower --lr and a new --out.")

    def record_heldout_acceptance(self) -> None:
        """Add the held-out acceptance (argmax path, and the selector's walk when there is one) to the latest step."""
        acceptance = self.heldout_acceptance()
        self.history[-1]["heldout_acceptance"] = acceptance.get(PathStrategy.ARGMAX.value, float("nan"))
        if PathStrategy.GREEDY.value in acceptance:
            self.history[-1]["heldout_selector_acceptance"] = acceptance[PathStrategy.GREEDY.value]

    def finish(self) -> None:
        """Wait for every process, then close the process group: a process leaving with the group still open can
        abort at exit (gloo's threads) while the others are still writing."""
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()

    def export(self, folder: str | Path, provenance: dict | None = None) -> None:
        """Save the trained drafter (bf16 safetensors) with its training record.

        ``provenance`` (e.g. ``{"target": ..., "data": ...}``) is added to ``training.json`` for the model card.
        """
        if not self.accelerator.is_main_process:
            return
        folder = Path(folder)
        drafter = self.unwrapped
        if is_peft_model(drafter):
            drafter.save_pretrained(folder)  # the adapter, the PEFT way
        else:
            drafter.to(torch.bfloat16).save_pretrained(folder)
            drafter.to(torch.float32)
        budget = {"steps": self.step, "sequences": self.step * self.config.batch_size,
                  "cpu_seconds": sum(h["seconds"] for h in self.history),
                  "training_records": len(self.records), "heldout_records": len(self.heldout)}
        (folder / "training.json").write_text(json.dumps(
            {**(provenance or {}), "config": asdict(self.config), "budget": budget}, indent=2))
