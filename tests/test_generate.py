"""`target.generate(assistant_model=drafter)`: greedy output identical to plain `generate`, edge cases, errors."""

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from scripted import scripted_drafter
from transformers.generation.streamers import BaseStreamer

from dflash2_hf import DFlashGenerateOutput

PATHS = {"dflash": ["argmax"], "dflash2": ["argmax", "greedy", "viterbi", "expected"]}
CASES = [(arch, kind, path) for arch in ("llama", "qwen2", "qwen3") for kind in PATHS for path in PATHS[kind]]


def prompt(length: int = 12, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 90, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def plain(target, inputs, **kwargs):
    return target.generate(inputs, do_sample=False, **kwargs)


@pytest.mark.parametrize(("arch", "kind", "path"), CASES)
def test_greedy_output_equals_plain_generate(arch, kind, path):
    target, drafter = tiny_target(arch), tiny_drafter(kind)
    expected = plain(target, prompt(), max_new_tokens=40)
    actual = target.generate(prompt(), do_sample=False, max_new_tokens=40, assistant_model=drafter, dflash_path=path)
    assert torch.equal(actual, expected)
    assert drafter.last_generation_stats.path == path


@pytest.mark.parametrize("wrong_positions", [(), (15, 16, 30), set(range(14, 60, 3))])
def test_long_accepted_prefixes_keep_the_output_exact(target, wrong_positions):
    expected = plain(target, prompt(), max_new_tokens=40)
    drafter = scripted_drafter(tiny_drafter("dflash2"), expected[0].tolist(), wrong_positions)
    actual = target.generate(prompt(), do_sample=False, max_new_tokens=40, assistant_model=drafter)
    assert torch.equal(actual, expected)
    stats = drafter.last_generation_stats
    assert max(stats.acceptance_lengths) == 8 if not wrong_positions else max(stats.acceptance_lengths) > 1
    assert stats.new_tokens == 40


def test_a_perfect_draft_emits_a_full_block_per_verification(target):
    expected = plain(target, prompt(), max_new_tokens=33)
    drafter = scripted_drafter(tiny_drafter("dflash2"), expected[0].tolist())
    target.generate(prompt(), do_sample=False, max_new_tokens=33, assistant_model=drafter)
    assert drafter.last_generation_stats.acceptance_lengths == [8, 8, 8, 8]


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 8, 9, 13])
def test_max_new_tokens_ending_inside_a_block(target, max_new_tokens):
    full = plain(target, prompt(), max_new_tokens=30)[0].tolist()
    drafter = scripted_drafter(tiny_drafter("dflash2"), full)
    actual = target.generate(prompt(), do_sample=False, max_new_tokens=max_new_tokens, assistant_model=drafter)
    assert actual[0].tolist() == full[: 12 + max_new_tokens]


def test_eos_inside_an_accepted_block_ends_the_output_there(target):
    full = plain(target, prompt(), max_new_tokens=30)[0].tolist()
    eos = full[12 + 5]  # the 6th new token: generation must stop right after its first occurrence
    expected = plain(target, prompt(), max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    drafter = scripted_drafter(tiny_drafter("dflash2"), full)
    actual = target.generate(prompt(), do_sample=False, max_new_tokens=30, eos_token_id=eos, pad_token_id=0, assistant_model=drafter)
    assert torch.equal(actual, expected)
    assert actual[0, -1].item() == eos and actual.shape[1] <= 12 + 6


def test_block_size_overridden_per_call(target):
    expected = plain(target, prompt(), max_new_tokens=30)
    drafter = scripted_drafter(tiny_drafter("dflash2"), expected[0].tolist())
    actual = target.generate(prompt(), do_sample=False, max_new_tokens=30, assistant_model=drafter, dflash_block_size=4)
    assert torch.equal(actual, expected)
    assert max(drafter.last_generation_stats.acceptance_lengths) == 4
    assert drafter.last_generation_stats.block_size == 4


def test_prompt_longer_than_the_drafters_sliding_window(target):
    drafter = tiny_drafter("dflash2", layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    long_prompt = prompt(length=40)
    expected = plain(target, long_prompt, max_new_tokens=30)
    assert torch.equal(target.generate(long_prompt, do_sample=False, max_new_tokens=30, assistant_model=drafter), expected)


class CollectingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_every_accepted_token_in_order(target):
    expected = plain(target, prompt(), max_new_tokens=25)[0].tolist()
    drafter = scripted_drafter(tiny_drafter("dflash2"), expected, wrong_positions={20})
    streamer = CollectingStreamer()
    target.generate(prompt(), do_sample=False, max_new_tokens=25, assistant_model=drafter, streamer=streamer)
    assert streamer.chunks[0] == expected[:12], "the prompt comes first, as in plain generate"
    assert sum(streamer.chunks[1:], []) == expected[12:]
    assert any(len(chunk) > 1 for chunk in streamer.chunks[1:]) and streamer.ended


def test_scores_and_logits_match_plain_generate(target):
    kwargs = dict(do_sample=False, max_new_tokens=12, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, repetition_penalty=1.3)
    expected = target.generate(prompt(), **kwargs)
    drafter = scripted_drafter(tiny_drafter("dflash2"), expected.sequences[0].tolist(), wrong_positions={16})
    actual = target.generate(prompt(), assistant_model=drafter, **kwargs)
    assert isinstance(actual, DFlashGenerateOutput)
    assert torch.equal(actual.sequences, expected.sequences)
    assert len(actual.scores) == len(expected.scores) == 12
    for ours, theirs in zip(actual.scores, expected.scores):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    for ours, theirs in zip(actual.logits, expected.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert actual.dflash_stats.new_tokens == 12


def test_statistics_account_for_every_new_token(target):
    drafter = tiny_drafter("dflash2")
    output = target.generate(prompt(), do_sample=False, max_new_tokens=20, assistant_model=drafter)
    stats = drafter.last_generation_stats
    assert stats.new_tokens == output.shape[1] - 12
    assert stats.mean_acceptance_length == pytest.approx(sum(stats.acceptance_lengths) / stats.cycles)
    assert min(stats.draft_seconds, stats.select_seconds, stats.verify_seconds, stats.prefill_seconds) > 0


def test_batch_of_two_prompts_fails_before_any_work(target):
    with pytest.raises(ValueError, match="batch size 1"):
        target.generate(torch.cat([prompt(), prompt(seed=4)]), assistant_model=tiny_drafter("dflash2"), max_new_tokens=5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dflash_path": "beam"}, "Unknown path strategy 'beam'"),
        ({"dflash_block_size": 1}, "block_size must be between 2"),
        ({"dflash_block_size": 9}, "block_size must be between 2 and the drafter's 8"),
        ({"dflash_top_k": 0}, "top_k must be >= 1"),
        ({"num_beams": 2}, "beam search|num_beams"),
        ({"do_sample": True, "temperature": -1.0}, "temperature"),
        ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions"),
        ({"do_sample": True, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"do_sample": True, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"do_sample": True, "top_k": -1}, "top_k"),
        ({"repetition_penalty": 0.0}, "penalty"),
        ({"max_matching_ngram_size": 0}, "max_matching_ngram_size"),
    ],
)
def test_bad_generation_arguments_fail_clearly(target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        target.generate(prompt(), max_new_tokens=5, assistant_model=tiny_drafter("dflash2"), **kwargs)


def test_selector_path_needs_a_dflash2_drafter(target):
    with pytest.raises(ValueError, match="needs a DFlash 2 drafter"):
        target.generate(prompt(), max_new_tokens=5, assistant_model=tiny_drafter("dflash"), dflash_path="greedy")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 128, "conv_group_size": 16}, "hidden size"),
        ({"vocab_size": 200}, "vocabulary"),
        ({"target_layer_ids": [1, 7]}, "target_layer_ids"),
        ({"mask_token_id": None}, "mask_token_id"),
    ],
)
def test_drafter_that_does_not_fit_the_target_fails_before_generation(target, overrides, message):
    with pytest.raises(ValueError, match=message):
        target.generate(prompt(), max_new_tokens=5, assistant_model=tiny_drafter("dflash2", **overrides))


def test_empty_prompt_is_refused(target):
    with pytest.raises(ValueError, match="prompt is empty"):
        target.generate(torch.zeros(1, 0, dtype=torch.long), assistant_model=tiny_drafter("dflash2"), max_new_tokens=5)


def test_prompt_beyond_the_context_length_is_refused(target):
    too_long = target.config.max_position_embeddings + 1
    with pytest.raises(ValueError, match=f"prompt has {too_long} tokens"):
        target.generate(prompt(length=too_long), assistant_model=tiny_drafter("dflash2"), max_new_tokens=5)


def test_a_bf16_drafter_drafts_for_an_fp32_target_without_changing_the_output(target):
    plain = target.generate(prompt(), max_new_tokens=20, do_sample=False)
    drafted = target.generate(prompt(), max_new_tokens=20, do_sample=False,
                              assistant_model=tiny_drafter("dflash2").to(torch.bfloat16))
    assert torch.equal(drafted, plain)


def test_padded_prompt_is_refused(target):
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="padded"):
        target.generate(prompt(), attention_mask=mask, max_new_tokens=5, assistant_model=tiny_drafter("dflash2"))


def test_drafter_config_sets_the_default_path(target):
    drafter = tiny_drafter("dflash2", default_path_strategy="viterbi")
    target.generate(prompt(), do_sample=False, max_new_tokens=4, assistant_model=drafter)
    assert drafter.last_generation_stats.path == "viterbi"
    target.generate(prompt(), do_sample=False, max_new_tokens=4, assistant_model=drafter, dflash_path="expected")
    assert drafter.last_generation_stats.path == "expected"
