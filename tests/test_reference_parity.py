"""Parity with independent implementations on the same weights.

* The authors' reference package ``dflash`` 0.1.0: golden outputs written by ``scripts/make_reference_fixtures.py``
  (it needs transformers 5.15, so it runs in its own venv; the fixtures are committed).
* transformers' own ``MuseGlimmerAssistantModel``, whose checkpoint layout (``encoder.*``) we map on load.

Tolerance: fp32 on CPU; our grouped convolution sums taps in another order than the reference, so DFlash 2 outputs
agree to ~1e-5 rather than bit for bit.
"""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache, MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
from transformers.cache_utils import DFlashCache

from conftest import PARITY_TOLERANCE, REFERENCE, tiny_drafter_config
from dflash2_hf import DFlash2DraftModel, DFlashDraftModel
from dflash2_hf.drafting.lattice import PathStrategy, build_lattice, score_lattice, select_path

ANCHOR = 7
TOLERANCE = PARITY_TOLERANCE


@pytest.fixture(scope="module")
def golden():
    return load_file(REFERENCE / "golden.safetensors")


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(REFERENCE / "target", dtype=torch.float32).eval()


def first_block(drafter, target, context):
    block = torch.tensor([[ANCHOR] + [drafter.mask_token_id] * (drafter.block_size - 1)])
    noise = target.get_input_embeddings()(block) * drafter.config.input_embedding_scale
    positions = torch.arange(context.shape[1] + drafter.block_size)[None]
    with torch.no_grad():
        hidden = drafter(noise, context_hidden_states=context, position_ids=positions, cache=DynamicCache())
        hidden = hidden.last_hidden_state[:, 1:]
        return hidden, drafter.compute_logits(hidden, target.lm_head)


@pytest.mark.parametrize(("name", "cls"), [("dflash_v1", DFlashDraftModel), ("dflash2", DFlash2DraftModel)])
def test_block_hidden_states_and_logits_match_the_reference(name, cls, golden, target):
    drafter = DFlashDraftModel.from_pretrained(REFERENCE / name, dtype=torch.float32).eval()
    assert type(drafter) is cls
    hidden, logits = first_block(drafter, target, golden[f"{name}.context"])
    torch.testing.assert_close(hidden, golden[f"{name}.hidden"], **TOLERANCE)
    torch.testing.assert_close(logits, golden[f"{name}.logits"], **TOLERANCE)


def test_context_features_are_the_target_hidden_states_after_each_tapped_layer(golden, target):
    drafter = DFlashDraftModel.from_pretrained(REFERENCE / "dflash_v1", dtype=torch.float32)
    with torch.no_grad():
        states = target(golden["prompt"], output_hidden_states=True).hidden_states
    ours = torch.cat([states[i + 1] for i in drafter.target_layer_ids], dim=-1)
    # recorded on another CPU: float32 matmuls sum in another order on an AVX2-only EPYC (1.6e-5 apart there)
    torch.testing.assert_close(ours, golden["dflash_v1.context"], **TOLERANCE)


def test_greedy_selector_walk_matches_the_reference(golden, target):
    drafter = DFlashDraftModel.from_pretrained(REFERENCE / "dflash2", dtype=torch.float32).eval()
    hidden, logits = first_block(drafter, target, golden["dflash2.context"])
    lattice = build_lattice(logits, torch.tensor([ANCHOR]), drafter.config.selector_top_k)
    with torch.no_grad():
        score_lattice(lattice, drafter.candidate_selector, hidden)
    assert lattice.tokens(select_path(lattice, PathStrategy.GREEDY)).tolist() == golden["dflash2.path"].tolist()
    assert sorted(lattice.candidate_ids.flatten().tolist()) == sorted(golden["dflash2.candidates"].flatten().tolist())


def test_transformers_assistant_checkpoint_loads_and_matches_transformers(tmp_path):
    config = MuseGlimmerAssistantConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=512, block_size=8, mask_token_id=95, target_layer_ids=[0, 2],
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    theirs = MuseGlimmerAssistantModel(config).eval()
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    theirs.save_pretrained(tmp_path / "assistant")
    ours = DFlashDraftModel.from_pretrained(tmp_path / "assistant", dtype=torch.float32).eval()

    context = torch.randn(1, 10, 2 * 64)
    noise = torch.randn(1, 8, 64)
    positions = torch.arange(18)[None]
    with torch.no_grad():
        expected = theirs(noise_embeds=noise, context_hidden_states=context, position_ids=positions,
                          cache=DFlashCache(config=config)).last_hidden_state
        actual = ours(noise, context_hidden_states=context, position_ids=positions).last_hidden_state
    torch.testing.assert_close(actual, expected, **TOLERANCE)

    ours.save_pretrained(tmp_path / "ours")
    assert "fc.weight" in load_file(tmp_path / "ours" / "model.safetensors")


def test_reference_fixture_config_matches_our_tiny_builder():
    """The fixtures and the in-code tiny drafters describe the same family of shapes."""
    ours = tiny_drafter_config("dflash2")
    reference = DFlash2DraftModel.from_pretrained(REFERENCE / "dflash2").config
    for field in ("hidden_size", "num_hidden_layers", "head_dim", "target_layer_ids", "conv_group_size"):
        assert getattr(ours, field) == getattr(reference, field)
