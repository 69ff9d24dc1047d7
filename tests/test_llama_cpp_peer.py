"""llama.cpp's plain decoding as a benchmark peer, on the real SmolLM2-135M-Instruct GGUF file (slow: CI builds
llama-cpp-python for this CPU in `.ci/run`)."""

import pytest
import torch

from dflash2_hf.evaluation import benchmark_prompts
from dflash2_hf.llama_cpp_peer import LlamaCppMethod
from dflash2_hf.presets import SMOLLM2_135M, load_target

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    target, tokenizer = load_target("smollm2-135m", dtype=torch.float32)
    folder, name = SMOLLM2_135M.gguf_location()
    return target, tokenizer, LlamaCppMethod(folder / name, threads=2)


def test_llama_cpp_decodes_the_same_model_from_the_same_prompt_tokens(smollm2):
    target, tokenizer, llama = smollm2
    (_, prompt), = benchmark_prompts(tokenizer, ["humaneval"], 1)
    decoded = llama.decode(target, prompt, max_new_tokens=24, temperature=0.0, seed=0)
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(decoded.sequence[:, : prompt.shape[1]], prompt)
    assert decoded.sequence.shape[1] == prompt.shape[1] + 24 and decoded.seconds > 0
    # Native Q4_1 arithmetic vs the de-quantized fp32 model: the same model, so greedy answers start alike.
    assert torch.equal(decoded.sequence[0, prompt.shape[1] : prompt.shape[1] + 8], plain[0, prompt.shape[1] : prompt.shape[1] + 8])


def test_llama_cpp_stops_at_the_targets_end_of_turn_token(smollm2):
    target, tokenizer, llama = smollm2
    messages = [{"role": "user", "content": "Reply with the single word: yes"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    decoded = llama.decode(target, prompt, max_new_tokens=64, temperature=0.0, seed=0)
    assert decoded.sequence[0, -1].item() == target.generation_config.eos_token_id
    assert decoded.sequence.shape[1] - prompt.shape[1] < 64


def test_llama_cpp_sampling_is_reproducible_per_seed(smollm2):
    target, tokenizer, llama = smollm2
    (_, prompt), = benchmark_prompts(tokenizer, ["mtbench"], 1)
    first, again, other = (llama.decode(target, prompt, 16, 1.0, seed).sequence for seed in (3, 3, 4))
    assert torch.equal(first, again) and not torch.equal(first, other)
