"""The on-disk store of the target's features: computed once per sequence, shared by runs, never mixed across
targets or layouts, and training on it is training without it."""

import pytest
import torch

from conftest import new_drafter, tiny_target
from dflash2_hf.training.features import FeatureStore, layout_key, sequence_key
from dflash2_hf.training.trainer import DrafterTrainer, TrainingConfig


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


@pytest.fixture(scope="module")
def records() -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [{"prompt_ids": torch.randint(0, 90, (6,), generator=generator).tolist(),
             "response_ids": torch.randint(0, 90, (30,), generator=generator).tolist()} for _ in range(6)]


def trainer(target, records, folder, store=None, steps=3) -> DrafterTrainer:
    config = TrainingConfig(output_dir=str(folder), steps=steps, batch_size=2, blocks_per_sequence=3, warmup_steps=1,
                            checkpoint_every=10, feature_store=str(store) if store else None)
    torch.manual_seed(0)
    return DrafterTrainer(new_drafter(), target, records, config)


class ForwardCounter:
    """Counts the target's forward passes (a forward hook on the real model)."""

    def __init__(self, model: torch.nn.Module):
        self.count = 0
        self.handle = model.register_forward_hook(self._seen)

    def _seen(self, *_) -> None:
        self.count += 1


def test_training_on_stored_features_gives_the_losses_of_training_without_a_store(target, records, tmp_path):
    plain = [h["loss"] for h in trainer(target, records, tmp_path / "plain").train()]
    stored = [h["loss"] for h in trainer(target, records, tmp_path / "stored", tmp_path / "features").train()]
    assert stored == plain


def test_a_second_run_on_the_same_store_runs_no_target_forward(target, records, tmp_path):
    trainer(target, records, tmp_path / "first", tmp_path / "features").train()
    counter = ForwardCounter(target)
    second = trainer(target, records, tmp_path / "second", tmp_path / "features")
    second.train()
    counter.handle.remove()
    assert counter.count == 0 and second.feature_cache


def test_a_run_on_more_answers_computes_only_the_new_ones(target, records, tmp_path):
    trainer(target, records[:3], tmp_path / "small", tmp_path / "features", steps=6).train()
    counter = ForwardCounter(target)
    larger = trainer(target, records, tmp_path / "large", tmp_path / "features", steps=6)
    larger.train()
    counter.handle.remove()
    assert counter.count == len(larger.feature_cache) - 3


@pytest.mark.parametrize("other", [
    {"layers": [1, 3]},
    {"dtype": torch.bfloat16},
    {"target": tiny_target("qwen3", num_hidden_layers=5).config},
])
def test_features_of_another_target_layer_or_dtype_are_kept_apart(target, other):
    same = {"target": target.config, "layers": [1, 2], "dtype": torch.float32}
    assert layout_key(*same.values()) == layout_key(*same.values())
    assert layout_key(*(same | other).values()) != layout_key(*same.values())


def test_a_damaged_feature_file_is_computed_again(tmp_path):
    store, ids = FeatureStore(tmp_path, "layout"), torch.arange(5)
    store.save(ids, torch.ones(5, 3))
    path = next(tmp_path.rglob("*.safetensors"))
    path.write_bytes(path.read_bytes()[:20])
    assert store.load(ids) is None
    store.save(ids, torch.full((5, 3), 2.0))
    assert torch.equal(store.load(ids), torch.full((5, 3), 2.0))


def test_features_are_found_by_the_sequences_token_ids(tmp_path):
    store = FeatureStore(tmp_path, "layout")
    store.save(torch.arange(5), torch.ones(5, 3))
    assert torch.equal(store.load(torch.arange(5)), torch.ones(5, 3))
    assert store.load(torch.arange(1, 6)) is None
    assert sequence_key(torch.arange(5)) != sequence_key(torch.arange(1, 6))
    assert not list(tmp_path.rglob("*.tmp")), "written whole, then renamed"
