"""The hook into transformers' `generate`: it must route DFlash drafters to our decoder, leave everything else alone,
and fail loudly if a transformers upgrade changes what it relies on."""

import inspect
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.streamers import BaseStreamer
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator
from transformers.generation.utils import GENERATION_MODES_MAPPING, GenerationMixin, GenerationMode

import dflash2_hf
from conftest import REFERENCE, tiny_drafter, tiny_target
from dflash2_hf import DFlashDraftModel
from dflash2_hf.drafting.block import BlockDrafter
from dflash2_hf.generation import integration, loop


def test_transformers_still_routes_assisted_generation_through_the_wrapped_method():
    assert GENERATION_MODES_MAPPING[GenerationMode.ASSISTED_GENERATION] == "_assisted_decoding"
    for name in integration.PATCHED_METHODS:
        assert getattr(getattr(GenerationMixin, name), "__dflash2_hf__", False), name


def test_wrapped_methods_keep_the_signatures_transformers_calls_them_with():
    expected = {
        "_extract_generation_mode_kwargs": ["self", "custom_generate", "kwargs", "synced_gpus", "assistant_model", "streamer"],
        "_validate_generation_mode": ["self", "generation_mode", "generation_config", "generation_mode_kwargs"],
    }
    for name, parameters in expected.items():
        original = inspect.unwrap(getattr(GenerationMixin, name))
        assert list(inspect.signature(original).parameters) == parameters, name
    decoding = inspect.signature(inspect.unwrap(GenerationMixin._assisted_decoding)).parameters
    assert list(decoding)[:5] == ["self", "input_ids", "logits_processor", "stopping_criteria", "generation_config"]
    assert {"assistant_model", "streamer"} <= set(decoding)


def test_generate_with_a_drafter_runs_the_dflash_decoder():
    target, drafter = tiny_target("qwen3"), tiny_drafter("dflash2")
    drafter.last_generation_stats = None
    target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False, assistant_model=drafter)
    assert drafter.last_generation_stats is not None and drafter.last_generation_stats.new_tokens == 6


def test_classic_assisted_generation_is_untouched():
    target, assistant = tiny_target("qwen3"), tiny_target("qwen3", seed=1)
    inputs = torch.tensor([[5, 6, 7, 8]])
    expected = target.generate(inputs, max_new_tokens=10, do_sample=False)
    assert torch.equal(target.generate(inputs, max_new_tokens=10, do_sample=False, assistant_model=assistant), expected)


def test_dflash_options_without_a_drafter_are_refused():
    target = tiny_target("qwen3")
    with pytest.raises(ValueError, match="need a DFlash drafter"):
        target.generate(torch.tensor([[5, 6]]), max_new_tokens=3, dflash_path="greedy")


def record_calls(monkeypatch, owner, name, extract):
    records, original = [], getattr(owner, name)

    def spy(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        records.append(extract(self, result, *args, **kwargs))
        return result

    monkeypatch.setattr(owner, name, spy)
    return records


def our_drafts(monkeypatch):
    return record_calls(monkeypatch, BlockDrafter, "draft", lambda self, result, *a, **k: result[0].candidate_ids[0, :, 0].tolist())


def test_argmax_drafts_equal_transformers_builtin_dflash_every_cycle(monkeypatch):
    target, drafter = tiny_target("qwen3"), tiny_drafter("dflash")
    inputs = torch.randint(0, 90, (1, 10), generator=torch.Generator().manual_seed(5))
    builtin = record_calls(
        monkeypatch, DFlashTokenCandidateGenerator, "get_candidates",
        lambda self, result, input_ids, *a, **k: result[0][0, input_ids.shape[1]:].tolist(),
    )
    expected = target.generate(inputs, max_new_tokens=30, do_sample=False, assistant_model=drafter, speculation_type="dflash")
    ours = our_drafts(monkeypatch)
    actual = target.generate(inputs, max_new_tokens=30, do_sample=False, assistant_model=drafter)
    assert torch.equal(actual, expected)
    builtin = [draft for draft in builtin if draft]
    full = [(b, o) for b, o in zip(builtin, ours) if len(o) == len(b)]
    assert len(full) >= 5
    assert all(b == o for b, o in full)


def record_paths(monkeypatch):
    """Record the drafted path of every cycle by spying on the path selection the decoder calls."""
    paths, original = [], loop.select_path

    def spy(lattice, strategy):
        picks = original(lattice, strategy)
        paths.append(lattice.tokens(picks)[0].tolist())
        return picks

    monkeypatch.setattr(loop, "select_path", spy)
    return paths


@pytest.mark.parametrize(("name", "path"), [("dflash_v1", "argmax"), ("dflash2", "greedy")])
def test_drafts_and_output_equal_the_reference_package_every_cycle(monkeypatch, name, path):
    golden = load_file(REFERENCE / "golden.safetensors")
    target = AutoModelForCausalLM.from_pretrained(REFERENCE / "target", dtype=torch.float32).eval()
    drafter = DFlashDraftModel.from_pretrained(REFERENCE / name, dtype=torch.float32).eval()
    paths = record_paths(monkeypatch)
    # the reference drafts every cycle; so does ours here (no fallback to plain steps, which would skip drafts)
    output = target.generate(golden["prompt"], max_new_tokens=24, do_sample=False, assistant_model=drafter,
                             dflash_path=path, dflash_plain_fallback=False)
    assert torch.equal(output, golden[f"{name}.greedy_output"])
    full = [draft for draft in paths if len(draft) == drafter.block_size - 1]
    reference = golden[f"{name}.greedy_drafts"].tolist()
    assert len(full) >= 10
    assert full == reference[: len(full)]


@pytest.mark.parametrize(("arch", "kind", "options"), [
    ("qwen3", "dflash2", {}),
    ("llama", "dflash", {}),
    ("qwen2", "dflash2", {"dflash_tree_nodes": 6, "dflash_lookup_tokens": 3}),
    ("qwen3", "dflash2", {"dflash_path": "viterbi", "dflash_block_size": 4}),
])
def test_the_public_seam_is_token_identical_to_plain_greedy_with_nothing_private_rewritten(
        public_seam_only, arch, kind, options):
    target, drafter = tiny_target(arch), tiny_drafter(kind)
    inputs = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(3))
    expected = target.generate(inputs, max_new_tokens=40, do_sample=False)
    output = target.generate(inputs, max_new_tokens=40, do_sample=False, return_dict_in_generate=True,
                             custom_generate=dflash2_hf.custom_generate, drafter=drafter, **options)
    assert torch.equal(output.sequences, expected)
    assert output.dflash_stats.new_tokens == 40 and output.dflash_stats.cycles > 0


def test_the_public_seam_without_a_drafter_says_what_to_pass(public_seam_only):
    with pytest.raises(ValueError, match="needs the drafter: pass drafter="):
        tiny_target("qwen3").generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3,
                                      custom_generate=dflash2_hf.custom_generate)


def test_the_public_seam_refuses_a_misspelt_option_as_generate_does(public_seam_only):
    with pytest.raises(ValueError, match="dflash_tree_node"):
        tiny_target("qwen3").generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, drafter=tiny_drafter("dflash2"),
                                      custom_generate=dflash2_hf.custom_generate, dflash_tree_node=4)


def test_an_unknown_transformers_release_refuses_the_assistant_route_and_names_the_public_seam():
    target, drafter = tiny_target("qwen3"), tiny_drafter("dflash2")
    inputs = torch.tensor([[5, 6, 7, 8]])
    integration.uninstall()
    integration.install(release=(5, 99))
    try:
        assert not any(getattr(GenerationMixin.__dict__.get(name), "__dflash2_hf__", False)
                       for name in integration.PATCHED_METHODS), "nothing private is touched on an unknown release"
        refusal = r"5\.24, 5\.25; this is 5\.99.*custom_generate=dflash2_hf\.custom_generate"
        with pytest.raises(ValueError, match=refusal):
            target.generate(inputs, max_new_tokens=5, do_sample=False, assistant_model=drafter)
        expected = target.generate(inputs, max_new_tokens=5, do_sample=False)
        seam = target.generate(inputs, max_new_tokens=5, do_sample=False, custom_generate=dflash2_hf.custom_generate,
                               drafter=drafter)
        assert torch.equal(seam, expected)
    finally:
        integration.uninstall()
        integration.install()


def test_the_installed_transformers_is_a_supported_release():
    assert integration.transformers_release() in integration.SUPPORTED_TRANSFORMERS
    assert integration.transformers_release("5.25.0.dev0") == (5, 25)


ROUTES = {  # how a call reaches DFlash decoding: the assistant route and the public seam
    "assistant_model": lambda drafter: dict(assistant_model=drafter),
    "custom_generate": lambda drafter: dict(custom_generate=dflash2_hf.custom_generate, drafter=drafter),
}


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
def test_dflash_options_of_a_passed_generation_config_are_honoured(route):
    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter(seed=4)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, dflash_path="argmax", dflash_block_size=4,
                              dflash_tree_nodes=0)
    target.generate(torch.tensor([[5, 6, 7]]), generation_config=config, **route(drafter))
    stats = drafter.last_generation_stats
    assert (stats.path, stats.block_size) == ("argmax", 4)


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
def test_the_targets_own_generation_config_sets_dflash_options_and_the_call_overrides_them(route):
    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter(seed=4)
    target.generation_config.dflash_block_size = 4
    target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=12, do_sample=False, **route(drafter))
    assert drafter.last_generation_stats.block_size == 4
    target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=12, do_sample=False, dflash_block_size=5,
                    **route(drafter))
    assert drafter.last_generation_stats.block_size == 5


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
@pytest.mark.parametrize("field, value, message", [
    ("dflash_blok_size", 4, "dflash_blok_size, which is no DFlash option"),
    ("dflash_block_size", 99, "block_size must be between 2"),
    ("dflash_path", "sideways", "Unknown path strategy 'sideways'"),
])
def test_a_generation_configs_bad_dflash_option_is_refused_naming_it(route, field, value, message):
    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter(seed=4)
    config = GenerationConfig(max_new_tokens=4, do_sample=False, **{field: value})
    with pytest.raises(ValueError, match=re.escape(message)):
        target.generate(torch.tensor([[5, 6, 7]]), generation_config=config, **route(drafter))


class RecordingStreamer(BaseStreamer):
    """A streamer that keeps what it is given."""

    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens.append(value)

    def end(self):
        self.ended = True


@pytest.mark.parametrize("argument, value, instead", [
    ("streamer", "streamer", "assistant_model=drafter, streamer="),
    ("assistant_model", "drafter", "pass the drafter once"),
    ("synced_gpus", True, "leave synced_gpus unset"),
])
def test_an_argument_transformers_keeps_from_the_seam_is_refused_before_decoding(argument, value, instead,
                                                                                 public_seam_only):
    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter(seed=4)
    given = {"streamer": RecordingStreamer(), "drafter": drafter, True: True}[value]
    forwards = []
    target.register_forward_pre_hook(lambda module, args: forwards.append(module))
    with pytest.raises(ValueError, match=re.escape(f"does not hand `{argument}`") + ".*" + re.escape(instead)):
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, custom_generate=dflash2_hf.custom_generate,
                        drafter=drafter, **{argument: given})
    assert forwards == []
