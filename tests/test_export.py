"""`dflash2-hf export`: a Hub-ready folder that loads back identically, with or without remote code, a model card
that states only what was recorded, generate defaults that generate honours, and refusals before any write."""

import json
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.dynamic_module_utils import check_python_requirements

import dflash2_hf
from conftest import PUBLISHED, TINY_VOCAB, refusal, tiny_drafter, tiny_target
from dflash2_hf import DFlash2DraftModel, DFlashDraftModel
from dflash2_hf.cli import main
from dflash2_hf.export import NO_MEASUREMENTS, ExportError, export_drafter
from dflash2_hf.generation import exported
from dflash2_hf.measuring.benchmark import Run, summarize
from dflash2_hf.results_table import markdown_table
from dflash2_hf.modeling import configuration_dflash, modeling_dflash, speculators_format
from dflash2_hf.training.trainer import TrainingConfig

BUDGET = {"steps": 7, "sequences": 28, "cpu_seconds": 12.5}


@pytest.fixture
def drafter_folder(tmp_path):
    """A saved tiny DFlash 2 drafter (float32) with the training record `dflash2-hf train` writes next to it."""
    folder = tmp_path / "drafter"
    tiny_drafter("dflash2").save_pretrained(folder)
    record = {"config": asdict(TrainingConfig(output_dir="/home/me/runs/tiny", steps=7)), "budget": BUDGET}
    (folder / "training.json").write_text(json.dumps(record))
    return folder


def sample_inputs(config) -> dict[str, torch.Tensor]:
    """Fixed random context features and block embeddings, and a tiny target's LM head, in bf16."""
    generator = torch.Generator().manual_seed(1)
    inputs = {"context": torch.randn(1, 6, len(config.target_layer_ids) * config.hidden_size, generator=generator),
              "noise": torch.randn(1, config.block_size, config.hidden_size, generator=generator),
              "head": tiny_target().get_output_embeddings().weight.detach()}
    return {name: tensor.to(torch.bfloat16) for name, tensor in inputs.items()}


def drafter_outputs(drafter, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Block hidden states and logits (through the given LM head)."""
    head = torch.nn.Linear(*inputs["head"].shape[::-1], bias=False, dtype=inputs["head"].dtype)
    head.weight.data = inputs["head"]
    with torch.no_grad():
        hidden = drafter(inputs["noise"], context_hidden_states=inputs["context"]).last_hidden_state
        return {"hidden": hidden, "logits": drafter.compute_logits(hidden, head)}


REMOTE_CODE_SCRIPT = """
import sys, torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel
folder, inputs, outputs = sys.argv[1:]
model = AutoModel.from_pretrained(folder, trust_remote_code=True)
assert "dflash2_hf" not in sys.modules, "remote code must not need the package"
inputs = load_file(inputs)
head = torch.nn.Linear(*inputs["head"].shape[::-1], bias=False, dtype=inputs["head"].dtype)
head.weight.data = inputs["head"]
with torch.no_grad():
    hidden = model(inputs["noise"], context_hidden_states=inputs["context"]).last_hidden_state
    logits = model.compute_logits(hidden, head)
save_file({"hidden": hidden, "logits": logits}, outputs, metadata={"module": type(model).__module__})
"""


def remote_code_outputs(folder, inputs: dict[str, torch.Tensor], scratch) -> tuple[str, dict[str, torch.Tensor]]:
    """Load ``folder`` with ``AutoModel(trust_remote_code=True)`` in a fresh interpreter without dflash2_hf (in this
    one the package's registration would win over the remote code) and run it on ``inputs``."""
    save_file(inputs, scratch / "inputs.safetensors")
    result = subprocess.run([sys.executable, "-c", REMOTE_CODE_SCRIPT, str(folder), str(scratch / "inputs.safetensors"),
                             str(scratch / "outputs.safetensors")], capture_output=True, text=True, cwd=scratch)
    assert result.returncode == 0, result.stderr[-3000:]
    with safe_open(scratch / "outputs.safetensors", "pt") as outputs:
        return outputs.metadata()["module"], {name: outputs.get_tensor(name) for name in outputs.keys()}


def front_matter(card: str) -> dict:
    match = re.match(r"---\n(.*?)\n---\n", card, re.DOTALL)
    assert match, "the card must start with YAML front matter"
    return yaml.safe_load(match.group(1))


def tensor_layout(path) -> dict[str, str]:
    """Tensor name -> dtype in a safetensors file, layer indices replaced by N."""
    with safe_open(path, "pt") as weights:
        return {re.sub(r"^layers\.\d+\.", "layers.N.", name): str(weights.get_slice(name).get_dtype())
                for name in weights.keys()}


def test_export_loads_back_identically_with_and_without_remote_code(drafter_folder, tmp_path):
    out = export_drafter(drafter_folder, tmp_path / "hub")
    names = {path.name for path in out.iterdir()}
    assert names == {"config.json", "model.safetensors", "configuration_dflash.py", "modeling_dflash.py",
                     "speculators_format.py", "generation_config.json", "README.md", "custom_generate"}
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_dflash.DFlashConfig",
                                  "AutoModel": "modeling_dflash.DFlash2DraftModel"}
    for module in (configuration_dflash, modeling_dflash, speculators_format):
        source = Path(module.__file__)
        assert (out / source.name).read_text() == source.read_text(), "the remote code is the package's own"
    assert set(tensor_layout(out / "model.safetensors").values()) == {"BF16"}

    plain = DFlashDraftModel.from_pretrained(out)
    assert type(plain) is DFlash2DraftModel and plain.dtype == torch.bfloat16
    inputs = sample_inputs(plain.config)
    expected = drafter_outputs(DFlashDraftModel.from_pretrained(drafter_folder, dtype=torch.bfloat16), inputs)
    module, remote = remote_code_outputs(out, inputs, tmp_path)
    assert module.startswith("transformers_modules"), module
    for outputs in (drafter_outputs(plain, inputs), remote):
        torch.testing.assert_close(outputs, expected, atol=0, rtol=0)


def test_card_has_metadata_usage_training_record_and_no_invented_figures(drafter_folder, tmp_path):
    out = export_drafter(drafter_folder, tmp_path / "hub", base_model="org/tiny-target")
    card = (out / "README.md").read_text()
    assert front_matter(card) == {"base_model": "org/tiny-target", "library_name": "transformers",
                                  "license": "apache-2.0", "tags": ["speculative-decoding", "dflash", "dflash2"]}
    first, second = re.findall(r"```python\n(.*?)```", card, re.DOTALL)
    assert first == 'out = target.generate(**inputs, custom_generate="hub", trust_remote_code=True, max_new_tokens=256)\n'
    assert 'DFlashDraftModel.from_pretrained("hub")' in second and "assistant_model=drafter" in second
    assert "* Budget: steps 7, sequences 28, cpu_seconds 12.5" in card
    assert "`learning_rate=0.0006`" in card and "/home/me" not in card
    assert "* Data: not recorded" in card and "* Target: not recorded" in card
    assert NO_MEASUREMENTS in card


def test_card_base_model_comes_from_the_training_record_or_is_left_out(drafter_folder, tmp_path):
    record = json.loads((drafter_folder / "training.json").read_text())
    (drafter_folder / "training.json").write_text(json.dumps({**record, "target": "org/recorded", "data": "runs/data"}))
    card = (export_drafter(drafter_folder, tmp_path / "recorded", license_id="mit") / "README.md").read_text()
    assert front_matter(card)["base_model"] == "org/recorded" and front_matter(card)["license"] == "mit"
    assert "* Data: runs/data" in card

    (drafter_folder / "training.json").unlink()
    card = (export_drafter(drafter_folder, tmp_path / "bare") / "README.md").read_text()
    assert "base_model" not in front_matter(card)
    assert "No training record" in card and NO_MEASUREMENTS in card


def bench_report() -> tuple[dict, str]:
    """A results.json as `dflash2-hf bench` writes it (two methods, one prompt) and the table it summarises to."""
    runs = [Run("plain", 0, "humaneval", 0.0, 32, 2.0),
            Run("dflash2 greedy", 0, "humaneval", 0.0, 32, 1.0, acceptance_lengths=[3, 4, 5],
                draft_seconds=0.2, select_seconds=0.1, verify_seconds=0.6)]
    rows = summarize(runs)
    return {"command": "dflash2-hf bench --drafter hub --per-source 1", "settings": {"threads": 2}, "summary": rows}, \
        markdown_table(rows)


def test_card_carries_the_benchmark_table_and_command(drafter_folder, tmp_path):
    report, table = bench_report()
    (tmp_path / "results.json").write_text(json.dumps(report))
    out = export_drafter(drafter_folder, tmp_path / "hub", results=tmp_path / "results.json")
    card = (out / "README.md").read_text()
    assert table in card and "2.00 [2.00, 2.00]" in table  # the paired speedup, as measured
    assert "Command: `dflash2-hf bench --drafter hub --per-source 1`" in card
    assert NO_MEASUREMENTS not in card

    (tmp_path / "results.md").write_text(f"Command: `{report['command']}`\n\n{table}\n")
    card = (export_drafter(drafter_folder, tmp_path / "md", results=tmp_path / "results.md") / "README.md").read_text()
    assert f"Command: `{report['command']}`\n\n{table}" in card


@pytest.mark.parametrize(("path", "expected"), [(None, "greedy"), ("viterbi", "viterbi")])
def test_generation_config_states_the_defaults_generate_uses(drafter_folder, tmp_path, path, expected):
    out = export_drafter(drafter_folder, tmp_path / "hub", path=path)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["dflash_path"], generation["dflash_block_size"]) == (expected, 8)
    assert f"picks the `{expected}` path" in (out / "README.md").read_text()
    drafter = DFlashDraftModel.from_pretrained(out)
    inputs = torch.randint(0, 90, (1, 10), generator=torch.Generator().manual_seed(3))
    tiny_target().generate(inputs, do_sample=False, max_new_tokens=6, assistant_model=drafter)
    stats = drafter.last_generation_stats
    assert (stats.path, stats.block_size) == (generation["dflash_path"], generation["dflash_block_size"])


def test_published_layout_matches_the_published_dflash2_checkpoint(drafter_folder, tmp_path):
    out = export_drafter(drafter_folder, tmp_path / "hub", published_layout=True)
    assert not list(out.glob("*.py"))
    config = json.loads((out / "config.json").read_text())
    published = json.loads((PUBLISHED / "muse-glimmer-30b-dflash2.config.json").read_text())
    assert "auto_map" not in config
    assert (config["model_type"], config["architectures"]) == (published["model_type"], published["architectures"])
    assert set(config["dflash_config"]) <= set(published["dflash_config"])
    header = json.loads((PUBLISHED / "muse-glimmer-30b-dflash2.safetensors-header.json").read_text())
    header.pop("__metadata__", None)
    published_names = {re.sub(r"^layers\.\d+\.", "layers.N.", name): entry["dtype"] for name, entry in header.items()}
    assert tensor_layout(out / "model.safetensors") == published_names
    exported = DFlashDraftModel.from_pretrained(out)
    inputs = sample_inputs(exported.config)
    expected = drafter_outputs(DFlashDraftModel.from_pretrained(drafter_folder, dtype=torch.bfloat16), inputs)
    torch.testing.assert_close(drafter_outputs(exported, inputs), expected, atol=0, rtol=0)


def test_the_format_flag_writes_the_published_layout(drafter_folder, tmp_path):
    main(["export", str(drafter_folder), str(tmp_path / "hub"), "--format", "published"])
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and "auto_map" not in config


def published_tensor_names() -> set[str]:
    """Tensor names of the published DFlash 2 checkpoint, layer indices replaced by N."""
    header = json.loads((PUBLISHED / "muse-glimmer-30b-dflash2.safetensors-header.json").read_text())
    return {re.sub(r"^layers\.\d+\.", "layers.N.", name) for name in header if name != "__metadata__"}


@pytest.fixture
def factorised_folder(tmp_path):
    """A saved tiny DFlash 2 drafter (float32) whose selector is factorised over the target's input embeddings."""
    folder = tmp_path / "factorised"
    tiny_drafter("dflash2", selector_factorised=True).save_pretrained(folder)
    return folder


def test_published_layout_materialises_a_factorised_selector_that_drafts_the_same_paths(factorised_folder, tmp_path):
    target = tiny_target()
    out = export_drafter(factorised_folder, tmp_path / "hub", published_layout=True, target=target,
                         dtype=torch.float32)
    assert set(tensor_layout(out / "model.safetensors")) == published_tensor_names()
    published = DFlashDraftModel.from_pretrained(out)
    assert not published.config.selector_factorised
    assert published.candidate_selector.successor_codebook.shape == (96, 8)
    factorised = DFlashDraftModel.from_pretrained(factorised_folder)
    inputs = torch.randint(0, 90, (1, 10), generator=torch.Generator().manual_seed(3))
    runs = []
    for drafter in (factorised, published):
        output = target.generate(inputs, do_sample=False, max_new_tokens=24, assistant_model=drafter,
                                 dflash_record_drafts=True, dflash_tree_nodes=0)  # one selector path each cycle
        runs.append((output, drafter.last_generation_stats.drafts))
    (output, drafts), (published_output, published_drafts) = runs
    assert torch.equal(output, published_output)
    assert [d.path for d in drafts] == [d.path for d in published_drafts]
    assert any(any(d.path) for d in drafts), "the selector, not the drafter's top-1, picked some tokens"
    assert all(torch.equal(d.candidate_ids, p.candidate_ids) for d, p in zip(drafts, published_drafts))


def test_published_layout_of_a_factorised_selector_needs_its_target(factorised_folder, tmp_path):
    with pytest.raises(ExportError, match=r"selector is factorised.*pass the target \(--target\)"):
        export_drafter(factorised_folder, tmp_path / "hub", published_layout=True)
    with pytest.raises(ExportError, match="vocabulary: drafter 96, target 128"):
        export_drafter(factorised_folder, tmp_path / "hub", published_layout=True, target=tiny_target(vocab_size=128))
    assert not (tmp_path / "hub").exists()


def test_default_layout_keeps_a_factorised_selector_and_says_so(factorised_folder, tmp_path):
    out = export_drafter(factorised_folder, tmp_path / "hub")
    assert DFlashDraftModel.from_pretrained(out).config.selector_factorised
    card = (out / "README.md").read_text()
    assert "(1,536 in the\ncandidate selector, factorised over the target's input embeddings)" in card


def test_published_layout_refuses_what_it_cannot_describe(drafter_folder, tmp_path):
    with pytest.raises(ExportError, match="no field for default_path_strategy='viterbi'"):
        export_drafter(drafter_folder, tmp_path / "hub", published_layout=True, path="viterbi")
    tiny_drafter("dflash").save_pretrained(tmp_path / "v1")
    with pytest.raises(ExportError, match="needs a DFlash 2 drafter"):
        export_drafter(tmp_path / "v1", tmp_path / "hub", published_layout=True)
    assert not (tmp_path / "hub").exists()


def test_non_empty_output_is_refused_unless_overwrite(drafter_folder, tmp_path):
    out = tmp_path / "hub"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export_drafter(drafter_folder, out)
    assert [path.name for path in out.iterdir()] == ["notes.txt"]
    export_drafter(drafter_folder, out, overwrite=True)
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["drafter", "hub"], "no staging folder left behind"
    with pytest.raises(ExportError, match="holds the drafter being exported"):
        export_drafter(drafter_folder, tmp_path, overwrite=True)


UNSWAPPABLE = {  # where the command runs -> the destination it is given, relative to there
    "the current folder": ("hub", "."),
    "the current folder by its path": ("hub", None),
    "a folder above the current one": ("hub/sub", ".."),
}


@pytest.mark.parametrize(("inside", "destination"), UNSWAPPABLE.values(), ids=UNSWAPPABLE.keys())
def test_a_destination_the_process_stands_in_is_refused_before_any_work_leaving_nothing(
        drafter_folder, tmp_path, monkeypatch, inside, destination):
    here = tmp_path / inside
    here.mkdir(parents=True)
    (here / "notes.txt").write_text("mine")
    monkeypatch.chdir(here)
    out = Path(destination) if destination else here
    before = sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*"))
    with pytest.raises(ExportError, match="is the current folder or holds it, which the finished export cannot replace"):
        export_drafter(drafter_folder, out, overwrite=True)
    assert sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*")) == before, "nothing made, nothing lost"


def test_overwrite_keeps_the_old_folder_until_the_new_one_is_in_place(drafter_folder, tmp_path, monkeypatch):
    out = tmp_path / "hub"
    export_drafter(drafter_folder, out)
    before = {path.relative_to(out): path.read_bytes() for path in out.rglob("*") if path.is_file()}
    rename = Path.rename

    def stopped_moving_the_new_folder_in(self, target):
        if Path(target) == out and self.name.startswith(".hub-") and "replaced" not in str(self):
            raise OSError("stopped")  # as a stop between moving the old folder aside and the new one in
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", stopped_moving_the_new_folder_in)
    with pytest.raises(OSError, match="stopped"):
        export_drafter(drafter_folder, out, overwrite=True, path="expected")
    after = {path.relative_to(out): path.read_bytes() for path in out.rglob("*") if path.is_file()}
    assert after == before, "the old folder is back, whole"
    monkeypatch.undo()
    export_drafter(drafter_folder, out, overwrite=True, path="expected")
    assert json.loads((out / "generation_config.json").read_text())["dflash_path"] == "expected"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["drafter", "hub"], "nothing left aside"


# Files given to export that are not what it reads -> what the refusal says.
UNREADABLE_INPUTS = {
    "results.md that is not text": ("results.md", b"\xff\xfe\x00binary", "is not text; pass the results.md"),
    "results.json that is not JSON": ("results.json", b"{cut", "is not the JSON a results.json of"),
    "results.json that is not UTF-8": ("results.json", b"\xff\xfe", "is not the JSON a results.json of"),
    "results.json of another shape": ("results.json", b"[1, 2]", "has no `summary`"),
    "training.json that is not JSON": ("training.json", b"{cut", "is not the JSON training.json should be"),
    "training.json that is not an object": ("training.json", b"[]", "is not a training record"),
}


@pytest.mark.parametrize("case", UNREADABLE_INPUTS)
def test_an_input_export_cannot_read_is_refused_in_one_line_before_writing(drafter_folder, tmp_path, case):
    name, content, says = UNREADABLE_INPUTS[case]
    given = drafter_folder / name if name == "training.json" else tmp_path / name
    given.write_bytes(content)
    argv = ["export", str(drafter_folder), str(tmp_path / "hub")]
    message = refusal(argv + (["--results", str(given)] if name != "training.json" else []))
    assert says in message and str(given) in message
    assert not (tmp_path / "hub").exists()


def test_a_folder_without_a_drafter_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="not a drafter folder: it has no config.json"):
        export_drafter(tmp_path / "empty", tmp_path / "hub")
    tiny_target().save_pretrained(tmp_path / "target")
    with pytest.raises(ExportError, match="not a drafter folder.*not a DFlash drafter config"):
        export_drafter(tmp_path / "target", tmp_path / "hub")
    assert not (tmp_path / "hub").exists()


def test_cli_exports_and_refuses(drafter_folder, tmp_path, capsys):
    out = tmp_path / "hub"
    argv = ["export", str(drafter_folder), str(out), "--base-model", "org/tiny-target", "--path", "expected",
            "--dtype", "float32"]
    assert main(argv) == 0
    assert f"written to {out}" in capsys.readouterr().out
    assert set(tensor_layout(out / "model.safetensors").values()) == {"F32"}
    assert json.loads((out / "generation_config.json").read_text())["dflash_path"] == "expected"
    assert front_matter((out / "README.md").read_text())["base_model"] == "org/tiny-target"
    message = refusal(["export", str(drafter_folder), str(out)])
    assert re.search("dflash2-hf export: .*exists and is not empty; .*--overwrite", message)


def greedy_prompt(seed: int = 3) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, TINY_VOCAB - 1, (1, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": 24, "do_sample": False}


@pytest.mark.parametrize("route", ["assistant route installed", "public seam only"])
def test_an_exported_folder_decodes_through_transformers_custom_generate(drafter_folder, tmp_path, route, request):
    """`generate(custom_generate=EXPORT, trust_remote_code=True)` with no drafter argument: transformers loads the
    export's custom_generate/generate.py, which drafts with that folder's drafter, token-identical to plain greedy."""
    if route == "public seam only":
        request.getfixturevalue("public_seam_only")
    out = export_drafter(drafter_folder, tmp_path / "hub")
    target, prompt = tiny_target("qwen3", seed=1), greedy_prompt()
    plain = target.generate(**prompt)
    exported.LOADED_DRAFTERS.clear()
    ours = target.generate(**prompt, custom_generate=str(out), trust_remote_code=True, return_dict_in_generate=True)
    assert torch.equal(ours.sequences, plain)
    assert ours.dflash_stats.cycles > 0 and ours.dflash_stats.verified_lengths[0] > 1, "the drafter drafted"
    (drafter,) = exported.LOADED_DRAFTERS.values()
    assert drafter.dtype == target.dtype and drafter.config.block_size == 8


def test_an_exported_drafter_is_loaded_once_and_again_after_a_new_export(drafter_folder, tmp_path):
    out, target, prompt = export_drafter(drafter_folder, tmp_path / "hub"), tiny_target("qwen3", seed=1), greedy_prompt()
    exported.LOADED_DRAFTERS.clear()
    for _ in range(2):
        target.generate(**prompt, custom_generate=str(out), trust_remote_code=True)
    assert len(exported.LOADED_DRAFTERS) == 1
    export_drafter(drafter_folder, out, overwrite=True, dtype=torch.float32)
    target.generate(**prompt, custom_generate=str(out), trust_remote_code=True)
    assert [d.dtype for d in exported.LOADED_DRAFTERS.values()] == [torch.float32] * 2, "the new weights were loaded"


def test_the_exported_generate_takes_another_drafter_by_folder(drafter_folder, tmp_path):
    out, target, prompt = export_drafter(drafter_folder, tmp_path / "hub"), tiny_target("qwen3", seed=1), greedy_prompt()
    other = tmp_path / "other"
    tiny_drafter("dflash2", seed=9).save_pretrained(other)
    exported.LOADED_DRAFTERS.clear()
    ours = target.generate(**prompt, custom_generate=str(out), trust_remote_code=True, drafter=str(other))
    assert torch.equal(ours, target.generate(**prompt))
    assert [key[0] for key in exported.LOADED_DRAFTERS] == [str(other)]


@pytest.mark.parametrize(("call", "message"), [
    ({"assistant_model": "a drafter"}, "brings its own drafter; pass drafter="),
    ({"drafter": 3}, "drafter= takes a DFlash drafter, a folder or a Hub repo id; got int"),
])
def test_the_exported_generate_refuses_a_second_drafter_or_a_bad_one(drafter_folder, tmp_path, call, message):
    out, target = export_drafter(drafter_folder, tmp_path / "hub"), tiny_target("qwen3", seed=1)
    with pytest.raises(ValueError, match=re.escape(message)):
        target.generate(**greedy_prompt(), custom_generate=str(out), trust_remote_code=True, **call)


def test_the_exported_generate_called_outside_generate_asks_for_the_drafter():
    with pytest.raises(ValueError, match="Could not tell which folder or Hub repo custom_generate named"):
        exported.generate(tiny_target("qwen3"), **greedy_prompt())


def test_the_export_names_this_package_as_its_requirement(drafter_folder, tmp_path):
    out = export_drafter(drafter_folder, tmp_path / "hub")
    assert (out / "custom_generate" / "requirements.txt").read_text() == f"dflash2-hf>={dflash2_hf.__version__}\n"
    check_python_requirements(out, requirements_file="custom_generate/requirements.txt")
    (out / "custom_generate" / "requirements.txt").write_text("dflash2-hf>=999\n")
    with pytest.raises(ImportError, match="dflash2-hf>=999"):
        check_python_requirements(out, requirements_file="custom_generate/requirements.txt")


def test_card_of_a_continued_drafter_lists_the_earlier_runs():
    from dflash2_hf.export import training_section

    first = {"data": "100 responses", "budget": {"steps": 5}}
    second = {"data": "200 responses", "budget": {"steps": 7}, "started_from": first}
    card = training_section({"target": "t", "data": "300 responses", "budget": {"steps": 9}, "started_from": second})
    assert card.index("* Budget: steps 9") < card.index("  * 200 responses; budget: steps 7") < card.index(
        "  * 100 responses; budget: steps 5")
