"""llama.cpp's plain decoding as a benchmark peer, on the real SmolLM2-135M-Instruct GGUF file (slow: CI builds
llama-cpp-python for this CPU in `.ci/run`), and the build command it asks for (fast)."""

import contextlib
import io
import json

import pytest
import torch

from dflash2_hf.cli import main
from dflash2_hf.cpu import kernels
from dflash2_hf.cpu.kernels import packed_linears_supported
from dflash2_hf.measuring.evaluation import benchmark_prompts
from dflash2_hf.measuring.llama_cpp_peer import LlamaCppMethod, install_command
from dflash2_hf.presets import SHIPPED_DRAFTERS, SMOLLM2_135M, load_target

slow = pytest.mark.slow


@pytest.mark.parametrize("flags, avx512", [({"avx2", "fma"}, "OFF"), ({"avx2", "avx512f", "avx512_bf16"}, "ON"),
                                           (set(), "OFF")])
def test_the_build_command_asks_for_avx512_only_on_a_cpu_that_has_it(monkeypatch, flags, avx512):
    """An AVX-512 build dies with "Illegal instruction" on an AVX2-only CPU: the hint must follow the CPU."""
    monkeypatch.setattr(kernels, "_cpuinfo", lambda: ("a CPU", frozenset(flags)))
    assert f"-DGGML_AVX512={avx512} " in install_command() and "-DGGML_NATIVE=OFF" in install_command()


@pytest.fixture(scope="module")
def smollm2():
    target, tokenizer = load_target("smollm2-135m", dtype=torch.float32)
    folder, name = SMOLLM2_135M.gguf_location()
    return target, tokenizer, LlamaCppMethod(folder / name, threads=2)


@slow
def test_llama_cpp_decodes_the_same_model_from_the_same_prompt_tokens(smollm2):
    target, tokenizer, llama = smollm2
    (_, prompt), = benchmark_prompts(tokenizer, ["humaneval"], 1)
    decoded = llama.decode(target, prompt, max_new_tokens=24, temperature=0.0, seed=0)
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(decoded.sequence[:, : prompt.shape[1]], prompt)
    assert decoded.sequence.shape[1] == prompt.shape[1] + 24 and decoded.seconds > 0
    # Native Q4_1 arithmetic vs the de-quantized fp32 model: the same model, so greedy answers start alike.
    assert torch.equal(decoded.sequence[0, prompt.shape[1] : prompt.shape[1] + 8], plain[0, prompt.shape[1] : prompt.shape[1] + 8])


@slow
def test_llama_cpp_stops_at_the_targets_end_of_turn_token(smollm2):
    target, tokenizer, llama = smollm2
    messages = [{"role": "user", "content": "Reply with the single word: yes"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    decoded = llama.decode(target, prompt, max_new_tokens=64, temperature=0.0, seed=0)
    assert decoded.sequence[0, -1].item() == target.generation_config.eos_token_id
    assert decoded.sequence.shape[1] - prompt.shape[1] < 64


@slow
def test_llama_cpp_sampling_is_reproducible_per_seed(smollm2):
    target, tokenizer, llama = smollm2
    (_, prompt), = benchmark_prompts(tokenizer, ["mtbench"], 1)
    first, again, other = (llama.decode(target, prompt, 16, 1.0, seed).sequence for seed in (3, 3, 4))
    assert torch.equal(first, again) and not torch.equal(first, other)


def bench_report(tmp_path, *argv: str) -> dict:
    """`dflash2-hf bench ARGV` on 1 HumanEval prompt, 8 new tokens, 1 thread: its results.json."""
    threads = torch.get_num_threads()
    out = tmp_path / "report"
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["bench", "--prompts", "humaneval", "--per-source", "1", "--temperatures", "0",
                         "--max-new-tokens", "8", "--dtype", "float32", "--threads", "1", *argv, "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "results.json").read_text())


@slow
def test_bench_runs_llama_cpp_next_to_trees_and_adaptive_blocks(tmp_path, monkeypatch):
    """docs/results.md's SmolLM2 runs with `--paths greedy --adaptive-block --tree-nodes 8 16 --lookup-tokens 16
    --llama-cpp`, on the shipped drafter named by `--drafter` (one tree size), as docs/training.md's Qwen2.5-Coder run
    names its own."""
    monkeypatch.setenv("DFLASH2_HF_CACHE", str(tmp_path / "cache"))
    report = bench_report(tmp_path, "--target", "smollm2-135m", "--drafter", str(SHIPPED_DRAFTERS["smollm2-135m"]),
                          "--paths", "greedy", "--adaptive-block", "--tree-nodes", "8", "--lookup-tokens", "16",
                          "--llama-cpp")
    methods = {row["method"] for row in report["summary"]}
    assert {"dflash2 greedy", "dflash2 greedy adaptive", "dflash2 greedy tree8", "dflash2 greedy tree8 lookup16",
            "llama.cpp plain (GGUF)"} <= methods
    assert report["settings"]["llama_cpp"] == "0.3.36"


@slow
def test_bench_runs_llama_cpp_without_a_drafter(tmp_path):
    """docs/results.md's Qwen2.5-Coder runs (`--no-drafter --llama-cpp`), on SmolLM2 (CI installs no 1.5B parts)."""
    report = bench_report(tmp_path, "--target", "smollm2-135m", "--assistant", "smollm2-135m", "--no-drafter",
                          "--llama-cpp", "--dtype", "float32")
    packed = {"plain packed", "prompt lookup packed"}  # float32 linears pack on every CPU: the drafter's own share
    assert {row["method"] for row in report["summary"]} == {"plain", "prompt lookup", "assisted (draft LM)",
                                                            "llama.cpp plain (GGUF)"} | packed


@slow
def test_bench_runs_every_method_also_on_packed_linears_next_to_llama_cpp(tmp_path):
    """docs/results.md's bf16 run with `--packed-linears --llama-cpp` (one tree size with its lookup branch)."""
    if not packed_linears_supported():
        pytest.skip("this CPU has no oneDNN bf16 matmuls")
    report = bench_report(tmp_path, "--target", "smollm2-135m", "--dtype", "bfloat16", "--paths", "greedy",
                          "--tree-nodes", "8", "--lookup-tokens", "16", "--packed-linears", "--llama-cpp")
    rows = {row["method"]: row for row in report["summary"]}
    assert {"plain packed", "dflash2 greedy tree8 lookup16 packed", "llama.cpp plain (GGUF)"} <= set(rows)
    assert "llama.cpp plain (GGUF) packed" not in rows
    ours, packed = rows["dflash2 greedy tree8 lookup16"], rows["dflash2 greedy tree8 lookup16 packed"]
    assert packed["mean_acceptance_length"] == ours["mean_acceptance_length"], "the same tokens accepted"


@slow
def test_bench_without_a_drafter_runs_packed_twins_next_to_llama_cpp(tmp_path):
    """docs/results.md's Qwen2.5-Coder-0.5B run with `--no-drafter --llama-cpp --packed-linears`, on SmolLM2."""
    if not packed_linears_supported():
        pytest.skip("this CPU has no oneDNN bf16 matmuls")
    report = bench_report(tmp_path, "--target", "smollm2-135m", "--no-drafter", "--dtype", "bfloat16",
                          "--packed-linears", "--llama-cpp")
    assert {row["method"] for row in report["summary"]} == {"plain", "plain packed", "prompt lookup",
                                                            "prompt lookup packed", "llama.cpp plain (GGUF)"}
