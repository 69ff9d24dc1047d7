"""DFlashConfig reads every published layout, refuses bad configs, and checks drafter/target fit."""

import json
import math

import pytest
from conftest import PUBLISHED, tiny_drafter_config, tiny_target

from dflash2_hf import DFlashConfig
from dflash2_hf.modeling import DFLASH_FIELDS
from dflash2_hf.presets import default_drafter_folder

SHIPPED_CONFIG = default_drafter_folder("smollm2-135m") / "config.json"


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
        ({"block_size": 1}, r"block_size must be an integer >= 2 and <= 256 \(.*\), got 1"),
        ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1, got 0"),
        ({"hidden_size": 2, "head_dim": None}, "head_dim .* must be an even integer >= 2"),
        ({"mask_token_id": 96}, "mask_token_id must be < vocab_size 96, got 96"),
        ({"default_tree_nodes": 10**9}, "default_tree_nodes must be at most 21844"),
        ({"selector_rank": None, "default_path_strategy": "greedy"}, "'greedy' needs a DFlash 2 drafter"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "rope_parameters .*factor"),
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
        ({"mask_token_id": 96, "vocab_size": 97}, "mask_token_id 96 is outside the target vocabulary"),
        ({"mask_token_id": None}, "has no mask_token_id"),
    ],
)
def test_mismatched_target_is_named(overrides, message):
    config = tiny_drafter_config("dflash2", **overrides)
    with pytest.raises(ValueError, match=message):
        config.check_fits_target(tiny_target("qwen3").config)


COUNTS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
          "selector_top_k"]
OPTIONAL_COUNTS = ["num_key_value_heads", "head_dim", "vocab_size", "num_target_layers", "sliding_window",
                   "conv_kernel_size", "conv_group_size", "selector_rank"]
NON_NEGATIVE = ["mask_token_id", "default_tree_nodes", "default_lookup_tokens"]
NUMBERS = ["output_multiplier", "input_embedding_scale", "rms_norm_eps", "attention_dropout", "initializer_range",
           "final_logit_softcapping"]
FLAGS = ["selector_factorised", "default_adaptive_block", "default_plain_fallback", "is_causal", "attention_bias",
         "tie_word_embeddings"]
NOT_AN_INT = ["16", 1.5, True, [16]]
MALFORMED = [
    *((name, value) for name in COUNTS for value in [0, -1, None, *NOT_AN_INT]),
    *((name, value) for name in OPTIONAL_COUNTS for value in [0, -1, *NOT_AN_INT]),
    *((name, value) for name in NON_NEGATIVE for value in [-1, *NOT_AN_INT]),
    *(("block_size", value) for value in [0, 1, 257, 1000000, None, *NOT_AN_INT]),
    ("mask_token_id", 49152), ("selector_top_k", 49153), ("default_tree_nodes", 10**30),
    *((name, value) for name in NUMBERS for value in ["x", math.nan, math.inf, -math.inf, True, [1.0]]),
    *((name, value) for name in ["rms_norm_eps", "final_logit_softcapping"] for value in [0, -1e-6]),
    ("num_hidden_layers", 10**9), ("attention_dropout", 1), ("attention_dropout", -0.1), ("initializer_range", -0.02), ("rms_norm_eps", None),
    *((name, value) for name in FLAGS for value in ["yes", 1, 0, None]),
    *(("target_layer_ids", value) for value in [["1", "27"], "1,2", [], [-1], [1.5], [True], 14]),
    *(("layer_types", value) for value in [["no_such", "full_attention"], "full_attention", [3, 3], 3, []]),
    *(("hidden_act", value) for value in ["no_such", 3, None, ["silu"]]),
    *(("default_path_strategy", value) for value in ["no_such", 3, ["greedy"], "GREEDY"]),
    *(("architectures", value) for value in ["DFlash2DraftModel", 5, [5]]),
    *(("dtype", value) for value in ["no_such", 5]),
    *(("eos_token_id", value) for value in ["2", ["2"], 1.5]),
    *(("pad_token_id", value) for value in ["2", True]),
    *(("rope_parameters", value) for value in ["x", [1], 5, {"rope_type": "no_such", "rope_theta": 1e5},
                                               {"rope_type": "default", "rope_theta": "x"},
                                               {"rope_type": "default", "rope_theta": -1.0}]),
    *(("dflash_config", value) for value in [5, "block_size", [1]]),
    *(("id2label", value) for value in [[1], "64", 5, True, {"a": "LABEL_0"}, {"0": 1}]),
    *(("label2id", value) for value in [[1], "64", 5]),
    *(("num_labels", value) for value in ["2", 2.5, None, -1, 10**9, [1]]),
    *((name, value) for name in ("attn_implementation", "_attn_implementation")
      for value in ["", "64", 5, ["sdpa"], "flash_attention_2"]),
    *(("quantization_config", value) for value in ["int8", [1], 5, {"bits": 8}]),
]


def write_config(folder, name, value):
    """The shipped drafter's config.json with one field set to ``value`` where the file keeps that field."""
    config = json.loads(SHIPPED_CONFIG.read_text())
    (config["dflash_config"] if name in DFLASH_FIELDS else config)[name] = value
    (folder / "config.json").write_text(json.dumps(config))


def test_the_shipped_config_that_the_malformed_ones_start_from_loads(tmp_path):
    write_config(tmp_path, "block_size", 16)
    assert DFlashConfig.from_pretrained(tmp_path).block_size == 16


@pytest.mark.parametrize(("name", "value"), MALFORMED, ids=[f"{name}={value!r}" for name, value in MALFORMED])
def test_a_malformed_field_is_refused_at_load_naming_the_field_and_the_value(tmp_path, name, value):
    write_config(tmp_path, name, value)
    with pytest.raises(ValueError) as refused:
        DFlashConfig.from_pretrained(tmp_path)
    assert name in str(refused.value)
    if not isinstance(value, dict):
        assert repr(value) in str(refused.value)


def test_every_bad_field_is_named_in_one_error(tmp_path):
    config = json.loads(SHIPPED_CONFIG.read_text())
    config["dflash_config"] |= {"mask_token_id": "16", "target_layer_ids": ["1", "27"]}
    config["num_attention_heads"] = 0
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^Invalid DFlash drafter config at .*: ") as refused:
        DFlashConfig.from_pretrained(tmp_path)
    for fragment in ("mask_token_id must be", "'16'", "target_layer_ids must be", "['1', '27']",
                     "num_attention_heads must be an integer >= 1, got 0"):
        assert fragment in str(refused.value)


def test_a_huge_block_size_is_refused_at_load(tmp_path):
    write_config(tmp_path, "block_size", 1000000)
    with pytest.raises(ValueError, match=r"block_size must be an integer >= 2 and <= 256 .*got 1000000"):
        DFlashConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(("document", "kind"), [([1, 2], "array"), ("config", "string"), (5, "number"),
                                                (None, "null")])
def test_a_config_json_that_is_not_an_object_is_refused_naming_the_file(tmp_path, document, kind):
    (tmp_path / "config.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match=rf"config\.json holds a JSON {kind}, not an object"):
        DFlashConfig.from_pretrained(tmp_path)
