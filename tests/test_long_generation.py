"""Long generations: over 4,096 new tokens both KV caches hold exactly the verified tokens after every cycle, and
sliding-window layers no more than their window, so memory grows with the output only in full-attention layers.

The target alternates full and sliding-window attention layers, and so does the drafter. The caches are observed
through PyTorch forward pre-hooks (just before each forward pass, i.e. after the previous cycle's crop) and a
streamer (how many tokens have been emitted by then). The drafter drafts the plain greedy output, wrong at random
positions, so cycles both keep whole blocks and reject drafts.

Also: dropping the states outside a drafter layer's window does not change the drafts, and
``scripts/long_run_memory.py`` (the measurement on a real model) records its marks right.
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import Cache, DynamicCache, PretrainedConfig
from transformers.generation.streamers import BaseStreamer

from conftest import one_torch_thread, tiny_drafter, tiny_target
from dflash2_hf.drafting import block as block_drafting
from scripted import scripted_drafter

NEW_TOKENS = 4096
TARGET_WINDOW, DRAFTER_WINDOW = 64, 32
PROMPT = [[1, 2, 3, 4, 5]]
WRONG_DRAFT_RATE = 0.1


@dataclass(frozen=True)
class Snapshot:
    """A cache just before a forward pass."""

    emitted: int  # tokens in the sequence by then, prompt included
    cached: int  # tokens the cache accounts for
    stored: list[int]  # states each layer actually keeps
    first_new: int | None = None  # drafter: position of the first context token this forward adds
    anchor: int | None = None  # drafter: position of the block's anchor


def stored_states(cache: Cache) -> list[int]:
    return [layer.keys.shape[-2] if layer.is_initialized else 0 for layer in cache.layers]


class CacheWatcher(BaseStreamer):
    """Counts the streamed tokens and snapshots the target's and the drafter's caches before each of their forwards."""

    def __init__(self, target: torch.nn.Module, drafter: torch.nn.Module):
        self.emitted = 0
        self.target: list[Snapshot] = []
        self.drafter: list[Snapshot] = []
        self.hooks = [target.register_forward_pre_hook(self._before_target, with_kwargs=True),
                      drafter.register_forward_pre_hook(self._before_drafter, with_kwargs=True)]

    def put(self, value: torch.Tensor) -> None:
        self.emitted += value.numel()

    def end(self) -> None:
        for hook in self.hooks:
            hook.remove()

    def _before_target(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        cache = kwargs["cache"]
        self.target.append(Snapshot(self.emitted, cache.get_seq_length(), stored_states(cache)))

    def _before_drafter(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        cache, positions = kwargs["cache"], kwargs["position_ids"][0]
        anchor = int(positions[kwargs["context_hidden_states"].shape[1]])
        self.drafter.append(Snapshot(self.emitted, cache.get_seq_length(), stored_states(cache), int(positions[0]), anchor))


def expected_storage(config: PretrainedConfig, cached: int) -> list[int]:
    """Full-attention layers keep every cached token, sliding ones the last ``sliding_window - 1``."""
    return [min(cached, config.sliding_window - 1) if kind == "sliding_attention" else cached
            for kind in config.layer_types]


@dataclass
class LongRun:
    plain: torch.Tensor
    output: torch.Tensor
    watcher: CacheWatcher
    target: torch.nn.Module
    drafter: torch.nn.Module


@pytest.fixture(scope="module")
def run() -> LongRun:
    with one_torch_thread():
        return long_run()


def long_run() -> LongRun:
    target = tiny_target("qwen3", max_position_embeddings=8192, use_sliding_window=True, sliding_window=TARGET_WINDOW,
                         layer_types=["sliding_attention", "full_attention"] * 2)
    prompt = torch.tensor(PROMPT)
    plain = target.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS)
    coin = random.Random(0)
    wrong = [position for position in range(plain.shape[1]) if coin.random() < WRONG_DRAFT_RATE]
    base = tiny_drafter("dflash2", max_position_embeddings=8192, sliding_window=DRAFTER_WINDOW,
                        layer_types=["sliding_attention", "full_attention"])
    drafter = scripted_drafter(base, plain[0].tolist(), wrong_positions=wrong)
    watcher = CacheWatcher(target, drafter)
    output = target.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS, assistant_model=drafter,
                             streamer=watcher)
    return LongRun(plain, output, watcher, target, drafter)


def test_a_long_output_of_a_sliding_window_target_equals_plain_greedy_decoding(run: LongRun):
    """4,096 tokens, token for token, with cycles that keep every drafted token and cycles that reject some."""
    assert run.output.shape[1] == len(PROMPT[0]) + NEW_TOKENS
    assert torch.equal(run.output, run.plain)
    lengths = run.drafter.last_generation_stats.acceptance_lengths
    block = run.drafter.config.block_size
    assert block in lengths and min(lengths) < block


def test_before_every_verification_the_target_cache_holds_exactly_the_verified_tokens(run: LongRun):
    """The rejected drafts of each cycle are cropped: only the anchor (the last emitted token) is left to process."""
    prefill, *cycles = run.watcher.target
    assert prefill.cached == 0
    assert len(cycles) == run.drafter.last_generation_stats.cycles
    assert [s.cached for s in cycles] == [s.emitted - 1 for s in cycles]


def test_target_layers_store_every_verified_token_or_only_their_sliding_window(run: LongRun):
    """Sliding-window layers store at most ``sliding_window - 1`` states however long the output grows."""
    for snapshot in run.watcher.target:
        assert snapshot.stored == expected_storage(run.target.config, snapshot.cached), snapshot
    assert max(s.cached for s in run.watcher.target) > 50 * TARGET_WINDOW


def test_before_every_draft_the_drafter_cache_holds_the_verified_context_and_no_block(run: LongRun):
    """The previous block's states are gone, the cache ends where this call's new context starts, and the block is
    anchored at the last emitted token."""
    snapshots = run.watcher.drafter
    total = len(PROMPT[0]) + NEW_TOKENS
    room_to_draft = [s.emitted for s in run.watcher.target[1:] if s.emitted < total - 1]
    assert [s.emitted for s in snapshots] == room_to_draft, "one draft per cycle, except a last one with no room"
    assert [s.cached for s in snapshots] == [s.first_new for s in snapshots]
    assert [s.anchor for s in snapshots] == [s.emitted - 1 for s in snapshots]


def test_drafter_layers_store_every_context_token_or_only_their_sliding_window(run: LongRun):
    """The drafter's sliding-window layers, too, store at most ``sliding_window - 1`` states."""
    for snapshot in run.watcher.drafter:
        assert snapshot.stored == expected_storage(run.drafter.config, snapshot.cached), snapshot
    assert max(s.cached for s in run.watcher.drafter) > 50 * DRAFTER_WINDOW


def test_a_drafter_keeping_only_its_window_drafts_the_same_blocks_as_one_keeping_everything(monkeypatch, one_thread):
    """The states a sliding-window layer drops are ones its attention mask hides anyway."""
    target = tiny_target("qwen3")
    drafter = tiny_drafter("dflash2", sliding_window=DRAFTER_WINDOW, layer_types=["sliding_attention", "full_attention"])
    prompt = torch.tensor(PROMPT)

    def drafts() -> list[torch.Tensor]:
        target.generate(prompt, do_sample=False, max_new_tokens=8 * DRAFTER_WINDOW, assistant_model=drafter,
                        dflash_record_drafts=True)
        return [record.candidate_ids for record in drafter.last_generation_stats.drafts]

    windowed = drafts()
    monkeypatch.setattr(block_drafting, "DynamicCache", lambda config: DynamicCache())  # full layers only
    unbounded = drafts()
    assert len(windowed) == len(unbounded) > 4 * DRAFTER_WINDOW
    assert all(torch.equal(a, b) for a, b in zip(windowed, unbounded))


def load_memory_script() -> ModuleType:
    """``scripts/long_run_memory.py`` as a module (scripts are not a package)."""
    path = Path(__file__).resolve().parent.parent / "scripts" / "long_run_memory.py"
    spec = importlib.util.spec_from_file_location("long_run_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_memory_script_reads_the_peak_each_time_the_output_passes_a_mark_and_tabulates_it():
    """The prompt (the streamer's first chunk) starts the clock and counts for no mark."""
    script = load_memory_script()
    readings, ticks = iter([100.0, 120.0]), iter([10.0, 11.0, 12.5])
    marks = script.PeakRssMarks(every=512, read_peak=lambda: next(readings), clock=lambda: next(ticks))
    for chunk in (600, 300, 300, 500):  # the prompt, then new tokens: 300, 600, 1100
        marks.put(torch.zeros(1, chunk, dtype=torch.long))
    assert marks.marks == [{"new_tokens": 512, "peak_rss_mib": 100.0, "seconds": 1.0},
                           {"new_tokens": 1024, "peak_rss_mib": 120.0, "seconds": 2.5}]
    table = script.markdown_table({"peak_rss_mib_before": 90.0, "marks": marks.marks})
    assert table.splitlines()[2:] == ["| 0 (models loaded) | 90 | 0.0 |", "| 512 | 100 | 1.0 |", "| 1024 | 120 | 2.5 |"]
