"""Saving and loading drafters: round trips, Auto classes, remote code, and loud failures on bad checkpoints."""

import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import tiny_drafter
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from dflash2_hf import DFlash2DraftModel, DFlashDraftModel, DrafterLoadError


def sample_output(drafter: DFlashDraftModel) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    context = torch.randn(1, 6, len(drafter.target_layer_ids) * drafter.config.hidden_size, generator=generator)
    noise = torch.randn(1, drafter.block_size, drafter.config.hidden_size, generator=generator)
    with torch.no_grad():
        return drafter(noise, context_hidden_states=context).last_hidden_state


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_save_then_load_gives_the_same_drafter(kind, tmp_path):
    drafter = tiny_drafter(kind)
    drafter.save_pretrained(tmp_path)
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert type(loaded) is type(drafter)
    torch.testing.assert_close(sample_output(loaded), sample_output(drafter), atol=0, rtol=0)


def test_saved_folder_is_safetensors_with_remote_code(tmp_path):
    tiny_drafter("dflash2").save_pretrained(tmp_path)
    names = {path.name for path in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_dflash.py", "configuration_dflash.py"} <= names
    assert not any(name.endswith((".bin", ".pt", ".pth")) for name in names)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dflash.DFlashConfig",
        "AutoModel": "modeling_dflash.DFlash2DraftModel",
    }
    assert "candidate_selector.predecessor_codebook" in load_file(tmp_path / "model.safetensors")


def test_factorised_selector_checkpoint_holds_only_its_projections(tmp_path):
    tiny_drafter("dflash2", selector_factorised=True).save_pretrained(tmp_path)
    selector = {name: tuple(tensor.shape) for name, tensor in load_file(tmp_path / "model.safetensors").items()
                if name.startswith("candidate_selector.")}
    assert selector == {f"candidate_selector.{name}.weight": (8, 64)
                        for name in ("hidden_projection", "predecessor_projection", "successor_projection")}


@pytest.mark.parametrize(("saved", "declared", "missing", "unexpected"), [
    (False, True, "predecessor_projection", "predecessor_codebook"),
    (True, False, "predecessor_codebook", "predecessor_projection"),
])
def test_selector_kind_must_match_the_checkpoint(tmp_path, saved, declared, missing, unexpected):
    tiny_drafter("dflash2", selector_factorised=saved).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["dflash_config"]["selector_factorised"] = declared
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterLoadError, match=f"missing keys:.*{missing}.*unexpected keys:.*{unexpected}"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_auto_model_loads_a_saved_folder_without_remote_code(tmp_path):
    tiny_drafter("dflash2").save_pretrained(tmp_path)
    assert type(AutoModel.from_pretrained(tmp_path)) is DFlash2DraftModel


def test_remote_code_loads_a_saved_folder_in_a_fresh_interpreter(tmp_path):
    drafter = tiny_drafter("dflash2")
    drafter.save_pretrained(tmp_path)
    torch.save(sample_output(drafter), tmp_path.parent / "expected.pt")  # test-side data only; loaded with weights_only
    script = f"""
import sys, torch
from transformers import AutoModel
model = AutoModel.from_pretrained({str(tmp_path)!r}, trust_remote_code=True)
assert "dflash2_hf" not in sys.modules, "remote code must not need the package"
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
generator = torch.Generator().manual_seed(1)
context = torch.randn(1, 6, len(model.config.target_layer_ids) * model.config.hidden_size, generator=generator)
noise = torch.randn(1, model.config.block_size, model.config.hidden_size, generator=generator)
with torch.no_grad():
    output = model(noise, context_hidden_states=context).last_hidden_state
torch.testing.assert_close(output, torch.load({str(tmp_path.parent / "expected.pt")!r}, weights_only=True))
print(type(model).__name__)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("DFlash2DraftModel")


def rewrite_weights(folder, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    tiny_drafter("dflash2").save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda t: t.pop("candidate_selector.successor_codebook"))
    with pytest.raises(DrafterLoadError, match="missing keys.*candidate_selector.successor_codebook"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    tiny_drafter("dflash").save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda t: t.update({"lm_head.weight": torch.zeros(96, 64)}))
    with pytest.raises(DrafterLoadError, match="unexpected keys.*lm_head.weight"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_misshaped_tensor_is_named(tmp_path):
    tiny_drafter("dflash").save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda t: t.update({"fc.weight": torch.zeros(64, 64)}))
    with pytest.raises(DrafterLoadError, match=r"mismatched keys: fc.weight \(checkpoint \[64, 64\] vs model \[64, 128\]\)"):
        DFlashDraftModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_named(tmp_path, value):
    tiny_drafter("dflash").save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda t: t["hidden_norm.weight"].__setitem__(0, value))
    with pytest.raises(DrafterLoadError, match="NaN or Inf values in: hidden_norm.weight"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_truncated_safetensors_file_is_reported(tmp_path):
    tiny_drafter("dflash").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(DrafterLoadError, match="truncated or corrupt"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_corrupt_safetensors_header_is_reported(tmp_path):
    tiny_drafter("dflash").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"garbage!"  # the JSON header starts after its 8-byte length
    weights.write_bytes(bytes(data))
    with pytest.raises(DrafterLoadError, match="truncated or corrupt"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_pickle_checkpoint_is_refused(tmp_path):
    drafter = tiny_drafter("dflash")
    drafter.config.save_pretrained(tmp_path)
    torch.save(drafter.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(OSError, match="safetensors"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_v1_checkpoint_cannot_be_loaded_as_dflash2(tmp_path):
    tiny_drafter("dflash").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="needs a DFlash 2 config"):
        DFlash2DraftModel.from_pretrained(tmp_path)


def edit_config(folder, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def test_config_without_dflash_config_names_what_is_missing(tmp_path):
    tiny_drafter("dflash2").save_pretrained(tmp_path)
    edit_config(tmp_path, lambda config: config.pop("dflash_config"))
    with pytest.raises(ValueError, match=f"The config.json at {tmp_path} has no `dflash_config`: the drafting fields"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_config_without_target_layer_ids_names_what_is_missing(tmp_path):
    tiny_drafter("dflash2").save_pretrained(tmp_path)
    edit_config(tmp_path, lambda config: config["dflash_config"].pop("target_layer_ids"))
    with pytest.raises(ValueError, match=f"The config.json at {tmp_path} has no target_layer_ids"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_folder_without_config_json_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"There is no config.json in {tmp_path}"):
        DFlashDraftModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("where", ["absolute", "./missing", "runs/missing"])
def test_folder_that_does_not_exist_is_named(tmp_path, monkeypatch, where):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    path = str(tmp_path / "missing") if where == "absolute" else where
    with pytest.raises(FileNotFoundError, match=f"^{path} does not exist"):
        DFlashDraftModel.from_pretrained(path)


def test_hub_repo_id_still_loads_from_the_hub_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local folder named like the repo's namespace
    commit = "0" * 40
    snapshot = tmp_path / "cache" / "models--org--drafter" / "snapshots" / commit
    drafter = tiny_drafter("dflash2")
    drafter.save_pretrained(snapshot)
    (tmp_path / "cache" / "models--org--drafter" / "refs").mkdir()
    (tmp_path / "cache" / "models--org--drafter" / "refs" / "main").write_text(commit)
    loaded = DFlashDraftModel.from_pretrained("org/drafter", cache_dir=tmp_path / "cache", local_files_only=True)
    torch.testing.assert_close(sample_output(loaded), sample_output(drafter), atol=0, rtol=0)


@pytest.mark.parametrize("name", ["fc.weight", "hidden_norm.weight"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool])
def test_a_weight_stored_as_anything_but_floating_point_is_named(tmp_path, name, dtype):
    tiny_drafter("dflash").save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda t: t.update({name: t[name].to(dtype)}))
    with pytest.raises(DrafterLoadError, match=rf"stores {re.escape(name)} as \w+, where floating point \(a weight\) "
                                               "belongs"):
        DFlashDraftModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_draft_vocabulary_stored_as_floats_is_refused_saying_ids_are_integers(tmp_path, dtype):
    drafter = tiny_drafter("dflash", draft_vocab_size=16)
    drafter.save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda t: t.update({"draft_vocabulary": t["draft_vocabulary"].to(dtype)}))
    with pytest.raises(DrafterLoadError, match=r"stores draft_vocabulary as \w+, where an integer tensor \(I32 or I64: "
                                               r"token ids or offsets\) belongs"):
        DFlashDraftModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("device_map", ["meta", torch.device("meta"), {"": "meta"}, {"fc": "meta", "layers": "cpu"}])
def test_loading_onto_the_meta_device_is_refused(tmp_path, device_map):
    tiny_drafter("dflash").save_pretrained(tmp_path)
    with pytest.raises(DrafterLoadError, match="device_map='meta' has no weights to draft with"):
        DFlashDraftModel.from_pretrained(tmp_path, device_map=device_map)
