"""The float64 attention makes a bf16 block forward give what one-token steps give, so greedy decoding with a drafter
gives plain decoding's tokens in bf16 too (on CPUs whose bf16 matmuls are row-wise: oneDNN bf16)."""

import warnings

import pytest
import torch
from transformers import DynamicCache

from conftest import needs_exact_bf16, needs_onednn_bf16, tiny_drafter, tiny_target
from dflash2_hf.cpu.exact_attention import EXACT_ATTENTION, ROWS_ROUND_DIFFERENTLY, ExactAttention, float64_attention

SHAPES = [(prefix, block) for prefix in (7, 37, 64, 100) for block in (2, 5, 9, 16, 25)]


def block_and_steps_differ(model, tokens: torch.Tensor, prefix: int, block: int) -> bool:
    """Whether a forward over ``block`` tokens after a ``prefix`` gives other logits than ``block`` one-token steps."""
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(tokens[:, :prefix], cache=cache)
        at_once = model(tokens[:, prefix : prefix + block], cache=cache).logits[0]
        cache = DynamicCache(config=model.config)
        model(tokens[:, :prefix], cache=cache)
        steps = [model(tokens[:, prefix + i : prefix + i + 1], cache=cache).logits[0] for i in range(block)]
    return not torch.equal(at_once, torch.cat(steps))


@pytest.fixture(scope="module")
def bf16_target():
    return tiny_target("llama", seed=1).to(torch.bfloat16)


@pytest.fixture(scope="module")
def long_tokens(bf16_target):
    return torch.randint(0, bf16_target.config.vocab_size, (1, 130), generator=torch.Generator().manual_seed(0))


@needs_onednn_bf16
def test_bf16_block_forwards_equal_one_token_steps_with_the_exact_attention(bf16_target, long_tokens):
    with ExactAttention(bf16_target):
        assert not any(block_and_steps_differ(bf16_target, long_tokens, *shape) for shape in SHAPES)


@needs_onednn_bf16
def test_negative_control_sdpa_block_forwards_differ_from_one_token_steps_in_bf16(bf16_target, long_tokens):
    assert bf16_target.config._attn_implementation == "sdpa"
    assert any(block_and_steps_differ(bf16_target, long_tokens, *shape) for shape in SHAPES)


@needs_onednn_bf16
@pytest.mark.parametrize("mode", [dict(dflash_tree_nodes=0), dict(dflash_tree_nodes=6, dflash_lookup_tokens=8)])
def test_bf16_greedy_decoding_with_a_drafter_gives_plain_decodings_tokens(bf16_target, long_tokens, mode):
    """With sdpa, ours and plain decoding part ways from the prompts at 20, 40 and 70 (and agree at 0)."""
    drafter = tiny_drafter("dflash2", seed=4).to(torch.bfloat16)
    with ExactAttention(bf16_target):
        for start in (0, 20, 40, 70):
            prompt = long_tokens[:, start : start + 12]
            plain = bf16_target.generate(prompt, max_new_tokens=40, do_sample=False)
            ours = bf16_target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter, **mode)
            assert torch.equal(ours, plain)
            assert len(drafter.last_generation_stats.acceptance_lengths) > 1, "drafted cycles ran"


def test_float64_attention_agrees_with_sdpa_in_float32():
    """Grouped heads and a causal mask (additive or boolean, shared or per head): the same attention as sdpa's."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, heads, rows, 16, generator=generator)
                         for heads, rows in ((4, 5), (2, 9), (2, 9)))
    allowed = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4)
    additive = torch.zeros(1, 1, 5, 9).masked_fill(~allowed, torch.finfo(torch.float32).min)
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, enable_gqa=True)
    for mask in (additive, allowed[None, None], allowed[None, None].expand(1, 4, 5, 9)):  # shared or per head
        output, weights = float64_attention(torch.nn.Module(), query, key, value, mask)
        assert weights is None and output.dtype == torch.float32
        torch.testing.assert_close(output, expected.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_float64_attention_refuses_dropout():
    query = key = value = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="takes no dropout"):
        float64_attention(torch.nn.Module(), query, key, value, None, dropout=0.1)


@pytest.mark.parametrize("independent", [True, False])
def test_the_exact_attention_warns_where_the_cpus_bf16_blocks_stay_inexact(monkeypatch, independent):
    monkeypatch.setattr("dflash2_hf.cpu.exact_attention.bf16_rows_independent", lambda: independent)
    model = tiny_target("llama", seed=1).to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ExactAttention(model).enable()
    assert [str(w.message) for w in caught] == ([] if independent else [ROWS_ROUND_DIFFERENTLY])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ExactAttention(model.float()).enable()
    assert not caught, "float32 is exact without the probe"


def test_exact_attention_switches_the_model_and_back():
    target = tiny_target("qwen3", seed=1)
    with ExactAttention(target):
        assert target.config._attn_implementation == EXACT_ATTENTION
    assert target.config._attn_implementation == "sdpa"



@pytest.fixture(scope="module")
def smollm2_bf16():
    """The real SmolLM2-135M and its shipped drafter in bf16 on packed linears, one HumanEval and one MT-Bench prompt
    (the data packages CI installs)."""
    from dflash2_hf import DFlashDraftModel
    from dflash2_hf.cpu.kernels import PackedLinears
    from dflash2_hf.measuring.evaluation import benchmark_prompts
    from dflash2_hf.presets import default_drafter_folder, load_target

    target, tokenizer = load_target("smollm2-135m", dtype=torch.bfloat16)
    drafter = DFlashDraftModel.from_pretrained(default_drafter_folder("smollm2-135m"), dtype=torch.bfloat16).eval()
    prompts = [prompt for _, prompt in benchmark_prompts(tokenizer, ["humaneval", "mtbench"], 1)]
    with PackedLinears(target, drafter):
        yield target, drafter, prompts


def ours_equals_plain(target, drafter, prompt) -> bool:
    """Whether greedy decoding with the drafter (its default tree + lookup) gives plain decoding's 96 tokens."""
    plain = target.generate(prompt, max_new_tokens=96, do_sample=False)
    return torch.equal(target.generate(prompt, max_new_tokens=96, do_sample=False, assistant_model=drafter), plain)


@needs_exact_bf16
@pytest.mark.slow
def test_smollm2_bf16_decoding_with_its_drafter_gives_plain_decodings_tokens(smollm2_bf16):
    target, drafter, prompts = smollm2_bf16
    with ExactAttention(target):
        assert all(ours_equals_plain(target, drafter, prompt) for prompt in prompts)


@needs_onednn_bf16
@pytest.mark.slow
def test_negative_control_smollm2_bf16_decoding_with_sdpa_parts_from_plain_decoding(smollm2_bf16):
    target, drafter, prompts = smollm2_bf16
    assert not all(ours_equals_plain(target, drafter, prompt) for prompt in prompts)


@needs_exact_bf16
@pytest.mark.slow
def test_smollm2_bench_with_the_exact_attention_counts_every_greedy_method_identical(tmp_path):
    """docs/results.md's bf16 runs (here 1 HumanEval and 1 MT-Bench prompt, 32 new tokens): with `--exact-attention`,
    every method that decodes through generate gives plain decoding's tokens, packed twins included; llama.cpp, next
    to them, decodes the GGUF file's 4-bit weights itself (its own numerics, not counted)."""
    import contextlib
    import io
    import json

    from dflash2_hf.cli import main

    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            main(["bench", "--prompts", "humaneval", "mtbench", "--per-source", "1", "--temperatures", "0",
                  "--max-new-tokens", "32", "--dtype", "bfloat16", "--threads", "2", "--paths", "greedy",
                  "--tree-nodes", "8", "--lookup-tokens", "16", "--packed-linears", "--exact-attention",
                  "--llama-cpp", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    rows = {row["method"]: row for row in json.loads((tmp_path / "results.json").read_text())["summary"]}
    assert rows.pop("llama.cpp plain (GGUF)")["tokens_per_second"] > 0
    assert "dflash2 greedy tree8 lookup16 packed" in rows
    assert {name: row["same_tokens_as_plain"] for name, row in rows.items()} == {name: 2 for name in rows}
