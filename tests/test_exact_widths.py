"""Greedy float32 decoding drafts at every width by default (exactness="rounding"); with exactness="bitwise", the
strict opt-in, it verifies only at widths this machine computes as one-token steps and decodes plainly where there is
none."""

import copy
import warnings

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from conftest import tiny_drafter, tiny_target
from dflash2_hf.generation import exact_widths
from dflash2_hf.drafting.options import DraftOptions
from dflash2_hf.generation.loop import widest_forward

def prompt(length: int = 9) -> torch.Tensor:
    return torch.randint(0, 90, (1, length), generator=torch.Generator().manual_seed(length))


def generate(target, drafter, **kwargs):
    """Greedy decoding with the drafter (``exactness="bitwise"`` unless ``kwargs`` say otherwise), the warnings it
    gave, and its statistics."""
    kwargs.setdefault("dflash_exactness", "bitwise")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = target.generate(prompt(), max_new_tokens=24, do_sample=False, assistant_model=drafter, **kwargs)
    return output, [str(warning.message) for warning in caught], drafter.last_generation_stats


def rows_differ_here(target, width: int) -> bool:
    """Measured in the test itself: whether a ``width``-token forward gives any row other logits than one-token
    forwards after the same context."""
    tokens = prompt(24 + width)
    with torch.no_grad():
        cache = DynamicCache(config=target.config)
        target(input_ids=tokens[:, :24], cache=cache)
        block_cache, rows_cache = copy.deepcopy(cache), copy.deepcopy(cache)
        block = target(input_ids=tokens[:, 24:], cache=block_cache).logits[0]
        rows = torch.cat([target(input_ids=tokens[:, 24 + i: 25 + i], cache=rows_cache).logits[0]
                          for i in range(width)])
    return not torch.equal(block, rows)


@pytest.mark.measured_widths
def test_the_probe_agrees_with_a_direct_comparison_on_this_machine():
    target = tiny_target()
    assert exact_widths.rows_as_alone(target, 2) is not rows_differ_here(target, 2)


@pytest.mark.measured_widths
def test_decoding_verifies_within_the_widest_exact_width(monkeypatch):
    target, drafter = tiny_target(), tiny_drafter()
    monkeypatch.setattr(exact_widths, "rows_as_alone", lambda model, width: width <= 5)
    output, caught, stats = generate(target, drafter, dflash_tree_nodes=8, dflash_lookup_tokens=4)
    assert stats.exact_width == 5 and stats.cycles > 0 and not caught
    assert max(stats.verified_lengths) + 1 <= 5
    assert torch.equal(output, target.generate(prompt(), max_new_tokens=24, do_sample=False))


@pytest.mark.measured_widths
def test_where_two_rows_already_round_differently_bitwise_decodes_plainly_and_says_so():
    target, drafter = tiny_target(), tiny_drafter()
    if not rows_differ_here(target, 2):
        pytest.skip("this machine's float32 kernels give a 2-row forward's rows what one-row forwards give")
    output, caught, stats = generate(target, drafter)
    assert stats.exact_width == 1 and stats.cycles == 0 and stats.plain_steps == 23
    assert any("dflash_exactness='rounding'" in message for message in caught)
    assert torch.equal(output, target.generate(prompt(), max_new_tokens=24, do_sample=False))


@pytest.mark.measured_widths
def test_the_default_drafts_at_every_width_whatever_this_machine_measures(monkeypatch):
    monkeypatch.setattr(exact_widths, "rows_as_alone", lambda model, width: pytest.fail("measured"))
    drafter = tiny_drafter()
    tiny_target().generate(prompt(), max_new_tokens=24, do_sample=False, assistant_model=drafter)
    stats = drafter.last_generation_stats
    assert stats.exact_width is None and stats.cycles > 0
    assert DraftOptions.for_drafter(drafter).exactness == "rounding"


@pytest.mark.measured_widths
def test_the_measurement_is_kept_per_target_and_setting(monkeypatch):
    target, calls = tiny_target(), []
    monkeypatch.setattr(exact_widths, "rows_as_alone", lambda model, width: calls.append(width) or width <= 5)
    assert [exact_widths.exact_verify_width(target, widest) for widest in (3, 17, 17, 9)] == [3, 5, 5, 5]
    assert calls == [2, 3, 4, 5, 6], "each width is measured once, and none past the first that fails"


CAPS = {  # options asked for -> the exact width measured -> the options decoded with
    "path cut to the width": (dict(tree_nodes=0), 5, dict(block_size=5, tree_nodes=0, lookup_tokens=0)),
    "tree cut, lookup dropped": (dict(tree_nodes=8, lookup_tokens=8), 6, dict(block_size=6, tree_nodes=5,
                                                                              lookup_tokens=0)),
    "lookup cut to the room left": (dict(tree_nodes=3, lookup_tokens=8), 7, dict(block_size=7, tree_nodes=3,
                                                                                 lookup_tokens=3)),
    "wide enough: unchanged": (dict(tree_nodes=8, lookup_tokens=8), 17, dict(block_size=8, tree_nodes=8,
                                                                             lookup_tokens=8)),
}


@pytest.mark.measured_widths
@pytest.mark.parametrize(("asked", "width", "decoded"), CAPS.values(), ids=CAPS.keys())
def test_options_are_cut_to_the_widest_exact_verification(asked, width, decoded, monkeypatch):
    target, drafter = tiny_target(), tiny_drafter()
    monkeypatch.setattr(exact_widths, "rows_as_alone", lambda model, probed: probed <= width)
    options, measured = exact_widths.exact_options(
        target, DraftOptions.for_drafter(drafter, **asked, exactness="bitwise"), False)
    assert measured == width and widest_forward(options) <= width
    assert {name: getattr(options, name) for name in decoded} == decoded


UNCHANGED = {  # calls the rule leaves alone: nothing is measured
    "sampling": (torch.float32, "bitwise", True),
    "bf16 (no identity promised)": (torch.bfloat16, "bitwise", False),
    "exactness='rounding'": (torch.float32, "rounding", False),
}


@pytest.mark.measured_widths
@pytest.mark.parametrize(("dtype", "exactness", "do_sample"), UNCHANGED.values(), ids=UNCHANGED.keys())
def test_sampling_bf16_and_rounding_are_not_measured(dtype, exactness, do_sample, monkeypatch):
    monkeypatch.setattr(exact_widths, "rows_as_alone", lambda model, width: pytest.fail("measured"))
    options = DraftOptions.for_drafter(tiny_drafter(), exactness=exactness)
    assert exact_widths.exact_options(tiny_target().to(dtype), options, do_sample) == (options, None)


BAD_EXACTNESS = {"a misspelling": "bitwize", "upper case": "BITWISE", "a bool": True, "a number": 1}


@pytest.mark.parametrize("value", BAD_EXACTNESS.values(), ids=BAD_EXACTNESS.keys())
def test_an_unknown_exactness_is_refused_naming_the_choices(value):
    with pytest.raises(ValueError, match="exactness must be one of 'bitwise', 'rounding'"):
        tiny_target().generate(prompt(), max_new_tokens=4, assistant_model=tiny_drafter(), dflash_exactness=value)


def test_a_generation_config_carries_exactness():
    drafter = tiny_drafter()
    config = GenerationConfig(max_new_tokens=8, do_sample=False, dflash_exactness="bitwise")
    tiny_target().generate(prompt(), generation_config=config, assistant_model=drafter)
    assert drafter.last_generation_stats.exact_width is not None


@pytest.mark.parametrize("exactness", ["bitwise", "rounding"])
def test_bench_runs_its_default_with_the_exactness_asked_and_every_path_at_every_width(exactness):
    from dflash2_hf.cli import command_parser
    from dflash2_hf.measuring.benchmark import drafter_methods

    assert command_parser().parse_args(["bench"]).exactness == "rounding", "the library's default"
    args = command_parser().parse_args(["bench", "--exactness", exactness])
    methods = {m.name: m.generate_kwargs for m in drafter_methods(tiny_drafter(), exactness=args.exactness)}
    assert methods["dflash2 default"]["dflash_exactness"] == exactness
    paths = [name for name in methods if name.startswith("dflash2 ") and name != "dflash2 default"]
    assert paths and all(methods[name]["dflash_exactness"] == "rounding" for name in paths)
