"""A drafter `train` or `export` writes decodes with the measured plan (a cost-sized tree with a copied branch), not
the library's bare one path, unless its config sets a plan of its own."""

import json

import pytest

from conftest import tiny_drafter, tiny_target
from dflash2_hf.drafting.options import BARE_PLAN, RECOMMENDED_PLAN, DraftOptions, with_recommended_plan
from dflash2_hf.export import export_drafter
from dflash2_hf.training.setup import drafter_config_for, drafter_to_continue


def plan(config) -> dict:
    return {name: getattr(config, name) for name in RECOMMENDED_PLAN}


def test_a_new_training_config_carries_the_recommended_plan():
    config = drafter_config_for(tiny_target().config, mask_token_id=95, num_layers=1, num_taps=1, block_size=8)
    assert plan(config) == RECOMMENDED_PLAN


def test_a_drafter_continued_from_a_bare_plan_gets_the_recommended_one(tmp_path):
    tiny_drafter(**BARE_PLAN).save_pretrained(tmp_path / "bare")
    assert plan(drafter_to_continue(tmp_path / "bare").config) == RECOMMENDED_PLAN


def test_an_exported_bare_drafter_decodes_with_the_recommended_plan(tmp_path):
    tiny_drafter(**BARE_PLAN).save_pretrained(tmp_path / "bare")
    out = export_drafter(tmp_path / "bare", tmp_path / "hub")
    written = json.loads((out / "config.json").read_text())
    assert {name: written[name] for name in RECOMMENDED_PLAN} == RECOMMENDED_PLAN


OWN_PLANS = {
    "one path, cost-cut": dict(default_adaptive_block=True),
    "a fixed tree": dict(default_tree_nodes=3),
    "a tree with its own branch": dict(default_tree_nodes=4, default_lookup_tokens=2),
}


@pytest.mark.parametrize("own", OWN_PLANS.values(), ids=OWN_PLANS.keys())
def test_a_config_with_a_plan_of_its_own_keeps_it(own):
    drafter = tiny_drafter(**own)
    before = plan(drafter.config)
    assert not with_recommended_plan(drafter.config) and plan(drafter.config) == before


def test_the_recommended_tree_is_cut_to_what_a_small_lattice_holds():
    drafter = tiny_drafter(block_size=2, selector_top_k=4, **BARE_PLAN)
    assert with_recommended_plan(drafter.config) and drafter.config.default_tree_nodes == 4
    DraftOptions.for_drafter(drafter)  # resolves: the plan fits the drafter
