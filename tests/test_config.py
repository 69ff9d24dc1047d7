"""DFlashConfig reads every published layout, refuses bad configs, and checks drafter/target fit."""

import json

import pytest
from conftest import PUBLISHED, tiny_drafter_config, tiny_target

from dflash2_hf import DFlashConfig


def test_dflash_v1_reads_top_level_block_size_and_nested_dflash_config():
    config = DFlashConfig.from_pretrained(PUBLISHED / "qwen3-8b-dflash-b16.config.json")
    assert (config.block_size, config.mask_token_id) == (16, 151669)
    assert config.target_layer_ids == [1, 9, 17, 25, 33]
    assert config.rope_parameters["rope_theta"] == 1000000
    assert not config.is_dflash2


def test_dflash2_reads_convolution_and_selector_fields():
    config = DFlashConfig.from_pretrained(PUBLISHED / "muse-glimmer-30b-dflash2.config.json")
    assert config.is_dflash2
    assert (config.conv_kernel_size, config.conv_group_size) == (2, 16)
    assert (config.selector_rank, config.selector_top_k) == (256, 16)
    assert config.final_logit_softcapping == 20.0
    assert config.output_multiplier == pytest.approx(0.19611613513818404)
    assert config.layer_types == ["sliding_attention"] * 5 and config.sliding_window == 2048


def test_transformers_assistant_layout_reads_flat_fields():
    config = DFlashConfig.from_pretrained(PUBLISHED / "muse-glimmer-30b-assistant.config.json")
    assert (config.block_size, config.mask_token_id) == (16, 201818)
    assert config.target_layer_ids == [1, 13, 25, 37, 49]
    assert config.architectures == ["MuseGlimmerAssistantModel"]


def test_unknown_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="not a DFlash drafter config.*LlamaForCausalLM"):
        DFlashConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"block_size": 1}, "block_size must be >= 2"),
        ({"target_layer_ids": None, "num_target_layers": None}, "target_layer_ids is missing"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_window is not set"),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for 2 layers"),
        ({"conv_group_size": None}, "must be set together"),
        ({"conv_group_size": 24}, "not a multiple of conv_group_size"),
        ({"vocab_size": None}, "needs vocab_size"),
        ({"selector_factorised": "yes"}, "selector_factorised must be true or false, got 'yes'"),
        ({"selector_rank": None, "selector_factorised": True}, "selector_factorised needs a candidate selector"),
    ],
)
def test_inconsistent_config_names_the_problem(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_drafter_config("dflash2", **overrides)


def test_unknown_dflash_config_field_is_refused():
    with pytest.raises(ValueError, match="Unknown field 'blok_size'"):
        DFlashConfig(dflash_config={"blok_size": 8}, target_layer_ids=[0])


def test_target_layer_ids_are_spread_over_the_target_when_absent():
    config = tiny_drafter_config("dflash", target_layer_ids=None, num_target_layers=36, num_hidden_layers=5)
    assert config.target_layer_ids == [1, 9, 17, 25, 33]


def test_serialised_config_nests_drafting_fields_and_round_trips(tmp_path):
    config = tiny_drafter_config("dflash2", final_logit_softcapping=6.0)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "dflash"
    assert saved["dflash_config"]["selector_rank"] == 8 and "selector_rank" not in saved
    reloaded = DFlashConfig.from_pretrained(tmp_path)
    assert reloaded.to_dict() == config.to_dict()


def test_factorised_selector_setting_is_nested_and_round_trips(tmp_path):
    tiny_drafter_config("dflash2", selector_factorised=True).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["dflash_config"]["selector_factorised"] is True and "selector_factorised" not in saved
    assert DFlashConfig.from_pretrained(tmp_path).selector_factorised is True


def test_a_config_without_the_setting_keeps_the_published_codebooks():
    config = DFlashConfig.from_pretrained(PUBLISHED / "muse-glimmer-30b-dflash2.config.json")
    assert config.selector_factorised is False


def test_fitting_target_passes():
    tiny_drafter_config("dflash2").check_fits_target(tiny_target("qwen3").config)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 128, "conv_group_size": 16}, "hidden size: drafter 128, target 64"),
        ({"target_layer_ids": [0, 4]}, r"target_layer_ids \[0, 4\] need more than the target's 4 layers"),
        ({"num_target_layers": 36}, "built for a 36-layer target"),
        ({"vocab_size": 1000}, "vocabulary: drafter 1000, target 96"),
        ({"mask_token_id": 96}, "mask_token_id 96 is outside the target vocabulary"),
        ({"mask_token_id": None}, "has no mask_token_id"),
    ],
)
def test_mismatched_target_is_named(overrides, message):
    config = tiny_drafter_config("dflash2", **overrides)
    with pytest.raises(ValueError, match=message):
        config.check_fits_target(tiny_target("qwen3").config)
