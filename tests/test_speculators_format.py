"""speculators' DFlash / DFlash 2 format, read and written without speculators installed.

The drafters in tests/fixtures/speculators were built and saved by speculators 0.9.0 itself (see the README there);
tests/test_speculators_peer.py runs speculators alongside for the round trips and the logit parity.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FIXTURES, TINY_TARGET_LAYERS, refusal, tiny_drafter, tiny_target
from dflash2_hf import DFlash2DraftModel, DFlashConfig, DFlashDraftModel
from dflash2_hf.cli import main
from dflash2_hf.export import ExportError, export_drafter
from dflash2_hf.modeling import DrafterLoadError

SPECULATORS = FIXTURES / "speculators"


def speculators_folder(tmp_path, kind: str = "dflash2", **changes) -> str:
    """A copy of speculators' own ``kind`` drafter with ``changes`` made to its config.json (``None`` drops a field)."""
    folder = tmp_path / f"speculators-{kind}"
    shutil.copytree(SPECULATORS / kind, folder)
    config = json.loads((folder / "config.json").read_text())
    for name, value in changes.items():
        if value is None:
            config.pop(name)
        else:
            config[name] = value
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(("kind", "model_class"), [("dflash", DFlashDraftModel), ("dflash2", DFlash2DraftModel)])
def test_a_speculators_drafter_loads_without_remote_code(kind, model_class):
    drafter = DFlashDraftModel.from_pretrained(SPECULATORS / kind)
    assert type(drafter) is model_class
    stored = load_file(SPECULATORS / kind / "model.safetensors")
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, stored[name]), name


def test_speculators_fields_map_by_meaning():
    config = DFlashConfig.from_pretrained(SPECULATORS / "dflash2")
    written = json.loads((SPECULATORS / "dflash2" / "config.json").read_text())
    assert written["aux_hidden_state_layer_ids"] == [1, 3]  # hidden states counted from the embedding output
    assert config.target_layer_ids == [0, 2]  # decoder layers: hidden_states[id + 1]
    assert (config.block_size, config.mask_token_id) == (written["block_size"], written["mask_token_id"])
    assert (config.conv_kernel_size, config.conv_group_size) == (written["conv_kernel_size"], written["conv_group_size"])
    assert (config.selector_rank, config.selector_top_k) == (written["selector_rank"], written["selector_top_k"])
    assert not config.is_causal and not config.selector_factorised
    assert config.hidden_size == written["transformer_layer_config"]["hidden_size"]
    assert config.num_hidden_layers == written["transformer_layer_config"]["num_hidden_layers"]


def test_a_speculators_drafter_decodes_as_plain_generate(one_thread):
    target, drafter = tiny_target("qwen3", seed=1), DFlashDraftModel.from_pretrained(SPECULATORS / "dflash2")
    prompt = torch.randint(0, 90, (1, 9), generator=torch.Generator().manual_seed(5))
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=drafter), plain)


#: Fields of a speculators config this package cannot honour exactly: the change, and the words naming it.
UNHONOURED = {
    "draft vocabulary on DFlash 2": ({"draft_vocab_size": 64}, "draft_vocab_size 64 is below the verifier's"),
    "draft vocabulary of no tokens": ({"draft_vocab_size": 0}, "draft_vocab_size: found the number 0, expected an "
                                      "integer >= 1"),
    "draft vocabulary past the verifier's": ({"draft_vocab_size": 200}, "draft_vocab_size 200 must be an integer"),
    "draft vocabulary not a number": ({"draft_vocab_size": "64"}, "draft_vocab_size: found the string '64', expected"),
    "anchor slot sampled": ({"sample_from_anchor": True}, "sample_from_anchor is true"),
    "embedding output tapped": ({"aux_hidden_state_layer_ids": [0, 3]}, "id 0 is the verifier's embedding output"),
    "no taps": ({"aux_hidden_state_layer_ids": None}, "aux_hidden_state_layer_ids must be a non-empty list"),
    "taps not integers": ({"aux_hidden_state_layer_ids": ["1"]}, "aux_hidden_state_layer_ids: found the array ['1'], "
                          "expected a non-empty list of integers"),
    "another model type": ({"speculators_model_type": "eagle3"}, "speculators_model_type: found the string 'eagle3', "
                           "expected one of 'dflash', 'dflash2'"),
    "a field nobody listed": ({"draft_temperature": 0.5}, "unknown field 'draft_temperature'"),
    "features of another width": ({"target_hidden_size": 128}, "target_hidden_size 128 differs from hidden_size"),
    "no layer config": ({"transformer_layer_config": "qwen3"}, "transformer_layer_config: found the string 'qwen3', "
                        "expected an object"),
}
#: Every field a speculators config is read by, given a value of another JSON type -> what the refusal says was found.
MISTYPED = {
    "model type as a list": ({"speculators_model_type": ["dflash2"]}, "speculators_model_type: found the array"),
    "model type as a number": ({"speculators_model_type": 2}, "speculators_model_type: found the number 2"),
    "block size as a string": ({"block_size": "16"}, "block_size: found the string '16', expected an integer >= 2"),
    "block size as a float": ({"block_size": 16.0}, "block_size: found the number 16.0, expected an integer"),
    "block size as a bool": ({"block_size": True}, "block_size: found the boolean True, expected an integer"),
    "mask token as a string": ({"mask_token_id": "95"}, "mask_token_id: found the string '95'"),
    "target width as a string": ({"target_hidden_size": "64"}, "target_hidden_size: found the string '64', expected "
                                 "an integer >= 1 or null"),
    "anchor flag as a string": ({"sample_from_anchor": "false"}, "sample_from_anchor: found the string 'false', "
                                "expected true or false"),
    "window flag as a number": ({"sliding_window_non_causal": 1}, "sliding_window_non_causal: found the number 1"),
    "tied flag as a string": ({"tie_word_embeddings": "no"}, "tie_word_embeddings: found the string 'no'"),
    "speculators_config as a list": ({"speculators_config": []}, "speculators_config: found the array [], expected an "
                                     "object"),
    "selector rank as a string": ({"selector_rank": "8"}, "selector_rank: found the string '8', expected an integer"),
    "top-k as a float": ({"selector_top_k": 4.5}, "selector_top_k: found the number 4.5"),
    "conv kernel of zero": ({"conv_kernel_size": 0}, "conv_kernel_size: found the number 0, expected an integer >= 1"),
    "taps as a string": ({"aux_hidden_state_layer_ids": "1,2"}, "aux_hidden_state_layer_ids: found the string"),
}


def layer_config_with(**changes) -> dict:
    config = json.loads((SPECULATORS / "dflash2" / "config.json").read_text())
    return {"transformer_layer_config": config["transformer_layer_config"] | changes}


MISTYPED |= {
    "layer vocabulary as a string": (layer_config_with(vocab_size="96"),
                                     "transformer_layer_config.vocab_size: found the string '96'"),
    "layer width as a list": (layer_config_with(hidden_size=[64]), "transformer_layer_config.hidden_size: found the "
                              "array [64]"),
    "layer kinds as a string": (layer_config_with(layer_types="full_attention"),
                                "transformer_layer_config.layer_types: found the string 'full_attention'"),
}


@pytest.mark.parametrize(("changes", "named"), MISTYPED.values(), ids=MISTYPED.keys())
def test_a_field_of_the_wrong_type_is_refused_naming_it_what_was_found_and_what_was_expected(changes, named, tmp_path):
    folder = speculators_folder(tmp_path, **changes)
    with pytest.raises(ValueError, match="cannot be run exactly as it was trained") as error:
        DFlashDraftModel.from_pretrained(folder)
    assert named in str(error.value)


@pytest.mark.parametrize(("changes", "named"), list(MISTYPED.values())[:4], ids=list(MISTYPED)[:4])
def test_info_on_a_mistyped_folder_answers_in_one_line(changes, named, tmp_path):
    message = refusal(["info", speculators_folder(tmp_path, **changes)])
    assert named in message and "\n" not in message


@pytest.mark.parametrize("missing", ["conv_kernel_size", "selector_rank", "selector_top_k"])
def test_a_declared_dflash2_without_its_selector_fields_is_refused_not_read_as_dflash(missing, tmp_path):
    folder = speculators_folder(tmp_path)
    config = json.loads((Path(folder) / "config.json").read_text())
    del config[missing]
    (Path(folder) / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"speculators_model_type 'dflash2' declares a DFlash 2 drafter but the config "
                                         f"lacks {missing}"):
        DFlashDraftModel.from_pretrained(folder)


@pytest.mark.parametrize(("changes", "named"), UNHONOURED.values(), ids=UNHONOURED.keys())
def test_what_cannot_be_honoured_is_refused_at_load_naming_the_field(changes, named, tmp_path):
    folder = speculators_folder(tmp_path, **changes)
    (tmp_path / "speculators-dflash2" / "model.safetensors").unlink()  # refused from the config, before weights
    with pytest.raises(ValueError, match="cannot be run exactly as it was trained") as error:
        DFlashDraftModel.from_pretrained(folder)
    assert named in str(error.value)


def test_sliding_window_layers_are_refused_naming_the_layer_types(tmp_path):
    config = json.loads((SPECULATORS / "dflash2" / "config.json").read_text())
    layers = config["transformer_layer_config"] | {"layer_types": ["sliding_attention", "full_attention"],
                                                   "sliding_window": 4}
    with pytest.raises(ValueError, match="layer_types .* has sliding-window layers"):
        DFlashDraftModel.from_pretrained(speculators_folder(tmp_path, transformer_layer_config=layers))


def test_verifier_tensors_of_a_speculators_checkpoint_are_left_unloaded(tmp_path):
    folder = speculators_folder(tmp_path)
    weights = load_file(f"{folder}/model.safetensors")
    verifier_owned = {"verifier_norm.weight": torch.ones(64), "embed_tokens.weight": torch.zeros(96, 64),
                      "t2d": torch.ones(96, dtype=torch.bool), "d2t": torch.zeros(96, dtype=torch.int64)}
    save_file(weights | verifier_owned, f"{folder}/model.safetensors")
    drafter = DFlashDraftModel.from_pretrained(folder)
    assert not set(verifier_owned) & set(drafter.state_dict())


def test_the_same_tensors_in_this_package_layout_are_still_refused(tmp_path):
    tiny_drafter(seed=2).save_pretrained(tmp_path / "ours")
    weights = load_file(tmp_path / "ours" / "model.safetensors")
    save_file(weights | {"verifier_norm.weight": torch.ones(64)}, tmp_path / "ours" / "model.safetensors")
    with pytest.raises(DrafterLoadError, match="unexpected keys: verifier_norm.weight"):
        DFlashDraftModel.from_pretrained(tmp_path / "ours")


def test_a_loaded_speculators_drafter_saves_in_this_package_layout(tmp_path):
    DFlashDraftModel.from_pretrained(SPECULATORS / "dflash2").save_pretrained(tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert "checkpoint_format" not in written and written["dflash_config"]["target_layer_ids"] == [0, 2]


#: The draft vocabulary of the tests below: every third token id of the tiny vocabulary of 96.
DRAFT_IDS = torch.arange(1, 96, 3)


def with_speculators_vocabulary(folder: str, token_ids: torch.Tensor = DRAFT_IDS) -> dict[str, torch.Tensor]:
    """Make a speculators ``dflash`` folder draft from ``token_ids`` as speculators stores it: ``draft_vocab_size``,
    a head of one random row per token (``lm_head.weight``), ``d2t`` offsets and the ``t2d`` mask; its tensors."""
    config = json.loads(Path(folder, "config.json").read_text())
    Path(folder, "config.json").write_text(json.dumps(config | {"draft_vocab_size": token_ids.numel()}))
    in_draft = torch.zeros(96, dtype=torch.bool)
    in_draft[token_ids] = True
    weights = load_file(f"{folder}/model.safetensors") | {
        "lm_head.weight": torch.randn(token_ids.numel(), 64, generator=torch.Generator().manual_seed(4)),
        "d2t": token_ids - torch.arange(token_ids.numel()), "t2d": in_draft}
    save_file(weights, f"{folder}/model.safetensors")
    return weights


def test_a_speculators_draft_vocabulary_loads_as_the_head_and_target_ids(tmp_path):
    folder = speculators_folder(tmp_path, kind="dflash")
    stored = with_speculators_vocabulary(folder)
    drafter = DFlashDraftModel.from_pretrained(folder)
    assert drafter.config.draft_vocab_size == DRAFT_IDS.numel()
    assert torch.equal(drafter.draft_vocabulary, DRAFT_IDS)
    assert torch.equal(drafter.draft_head.weight, stored["lm_head.weight"])


def test_loading_a_speculators_draft_vocabulary_reports_nothing_of_the_deliberately_unread_t2d(tmp_path, capfd):
    folder = speculators_folder(tmp_path, kind="dflash")
    with_speculators_vocabulary(folder)
    capfd.readouterr()
    DFlashDraftModel.from_pretrained(folder)
    printed = "".join(capfd.readouterr())
    assert "t2d" not in printed and "LOAD REPORT" not in printed


def test_greedy_decoding_with_a_speculators_draft_vocabulary_is_plain_generate(tmp_path, one_thread):
    folder = speculators_folder(tmp_path, kind="dflash")
    with_speculators_vocabulary(folder)
    target, drafter = tiny_target("qwen3", seed=1), DFlashDraftModel.from_pretrained(folder)
    prompt = torch.randint(0, 90, (1, 9), generator=torch.Generator().manual_seed(5))
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=drafter), plain)


def cut_drafter(kind: str = "dflash", token_ids: torch.Tensor = DRAFT_IDS) -> DFlashDraftModel:
    """A tiny drafter of ``kind`` drafting from ``token_ids`` through a random head of its own."""
    drafter = tiny_drafter(kind, seed=3, draft_vocab_size=token_ids.numel())
    drafter.draft_vocabulary.copy_(token_ids)
    return drafter


def test_a_cut_drafter_exports_its_vocabulary_as_speculators_stores_one(tmp_path):
    drafter = cut_drafter()
    drafter.save_pretrained(tmp_path / "drafter")
    out = export_drafter(tmp_path / "drafter", tmp_path / "spec", layout="speculators", dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == DRAFT_IDS.numel()
    stored = load_file(out / "model.safetensors")
    assert torch.equal(stored["lm_head.weight"], drafter.draft_head.weight)
    assert torch.equal(stored["d2t"] + torch.arange(DRAFT_IDS.numel()), DRAFT_IDS)
    assert torch.equal(stored["t2d"].nonzero().flatten(), DRAFT_IDS)
    assert not {"draft_head.weight", "draft_vocabulary"} & set(stored)


def test_a_cut_drafter_exported_to_speculators_loads_back_as_it_was(tmp_path):
    drafter = cut_drafter()
    drafter.save_pretrained(tmp_path / "drafter")
    out = export_drafter(tmp_path / "drafter", tmp_path / "spec", layout="speculators", dtype=torch.float32)
    loaded = DFlashDraftModel.from_pretrained(out)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_the_whole_head_flag_exports_a_cut_dflash2_drafter_to_speculators(tmp_path):
    cut_drafter("dflash2").save_pretrained(tmp_path / "drafter")
    main(["export", str(tmp_path / "drafter"), str(tmp_path / "spec"), "--format", "speculators", "--whole-head"])
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "spec")
    assert loaded.config.draft_vocab_size is None and loaded.draft_head is None


def test_the_whole_head_flag_beside_a_draft_vocabulary_is_refused(tmp_path):
    cut_drafter().save_pretrained(tmp_path / "drafter")
    message = refusal(["export", str(tmp_path / "drafter"), str(tmp_path / "out"), "--whole-head",
                       "--draft-vocab-size", "8"])
    assert "--whole-head exports the target's whole head, --draft-vocab-size a draft vocabulary: give one" in message


@pytest.fixture(scope="module")
def drafter_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("drafter") / "drafter"
    tiny_drafter(seed=3).save_pretrained(folder)
    return folder


def test_export_writes_speculators_format(drafter_folder, tmp_path):
    out = export_drafter(drafter_folder, tmp_path / "spec", layout="speculators", base_model="org/tiny-qwen3",
                         target=tiny_target("qwen3", seed=1), dtype=torch.float32)
    written = json.loads((out / "config.json").read_text())
    assert written["speculators_model_type"] == "dflash2" and written["architectures"] == ["DFlash2DraftModel"]
    assert written["aux_hidden_state_layer_ids"] == [1, 3] and written["sample_from_anchor"] is False
    assert written["speculators_config"]["verifier"] == {"name_or_path": "org/tiny-qwen3",
                                                         "architectures": ["Qwen3ForCausalLM"]}
    assert written["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == written["block_size"] - 1
    assert not list(out.glob("*.py")), "speculators' format carries no remote code of ours"
    assert "vllm serve spec" in (out / "README.md").read_text()


def test_a_speculators_export_loads_back_tensor_for_tensor(drafter_folder, tmp_path):
    out = export_drafter(drafter_folder, tmp_path / "spec", layout="speculators", dtype=torch.float32)
    original, loaded = DFlashDraftModel.from_pretrained(drafter_folder), DFlashDraftModel.from_pretrained(out)
    assert loaded.config.target_layer_ids == original.config.target_layer_ids
    for name, tensor in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


#: Drafters speculators' format cannot describe: the setting, and the words naming it.
UNEXPRESSIBLE = {
    "causal block": ({"is_causal": True}, "is_causal"),
    "sliding window": ({"sliding_window": 4}, "sliding-window layers"),
    "scaled logits": ({"output_multiplier": 0.5}, "output_multiplier 0.5"),
    "capped logits": ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0"),
    "scaled embeddings": ({"input_embedding_scale": 2.0}, "input_embedding_scale 2.0"),
    "last layer tapped": ({"target_layer_ids": [0, TINY_TARGET_LAYERS - 1]}, "taps the target's last layer"),
    "a default path": ({"default_path_strategy": "viterbi"}, "no field for default_path_strategy='viterbi'"),
    "a cut DFlash 2 drafter": ({"draft_vocab_size": 40}, "drafts over the whole vocabulary (export it with the "
                                                         "target's whole head: --whole-head)"),
}


@pytest.mark.parametrize(("settings", "named"), UNEXPRESSIBLE.values(), ids=UNEXPRESSIBLE.keys())
def test_export_refuses_what_speculators_format_cannot_describe(settings, named, tmp_path):
    tiny_drafter(seed=3, **settings).save_pretrained(tmp_path / "drafter")
    with pytest.raises(ExportError, match="speculators' format cannot describe this drafter") as error:
        export_drafter(tmp_path / "drafter", tmp_path / "spec", layout="speculators")
    assert named in str(error.value)
    assert not (tmp_path / "spec").exists()


def test_a_factorised_selector_is_exported_as_codebooks_from_the_target(tmp_path):
    tiny_drafter(seed=3, selector_factorised=True).save_pretrained(tmp_path / "drafter")
    with pytest.raises(ExportError, match="the speculators layout stores full codebooks"):
        export_drafter(tmp_path / "drafter", tmp_path / "spec", layout="speculators")
    target = tiny_target("qwen3", seed=1)
    out = export_drafter(tmp_path / "drafter", tmp_path / "spec", layout="speculators", target=target)
    assert not DFlashDraftModel.from_pretrained(out).candidate_selector.factorised


def test_the_command_line_writes_speculators_format(drafter_folder, tmp_path):
    main(["export", str(drafter_folder), str(tmp_path / "spec"), "--format", "speculators",
          "--base-model", "org/tiny-qwen3"])
    written = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert written["speculators_model_type"] == "dflash2"
    assert written["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-qwen3"


def test_the_published_flag_beside_another_format_is_refused(drafter_folder, tmp_path):
    message = refusal(["export", str(drafter_folder), str(tmp_path / "out"), "--published-layout",
                       "--format", "speculators"])
    assert "--published-layout asks for the published layout; --format speculators for another" in message
