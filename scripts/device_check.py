"""DFlash 2 decoding on an accelerator: exact, and how fast next to plain ``generate`` (issue 37, item 6).

    python scripts/device_check.py [--device cuda] [--target smollm2-135m] [--drafter FOLDER] [--per-source 3]
                                   [--max-new-tokens 64] [--samples 1000] [--out device_check.json]

Three checks, each on ``--device``, every model in float32:

1. Greedy identity: on ``--per-source`` HumanEval and MT-Bench prompts, the target with the drafter (through
   ``custom_generate`` and through ``assistant_model``) gives plain greedy ``generate``'s tokens.
2. Exact sampling: a tiny random target over a 5-token vocabulary with a tiny random DFlash 2 drafter (built here,
   seeded); ``--samples`` 4-token continuations sampled with the drafter fit the target's exact distribution
   (chi-square p > 1e-3), and the same run with a biased verifier that keeps every drafted token must not
   (p < 1e-6): the check can fail.
3. Speed: the same prompts decoded plainly and with the drafter (library defaults), timed after the device's queued
   work has finished; the ratio is plain seconds over drafted seconds.

Prints one line per check and writes the figures as JSON to ``--out``; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import dflash2_hf
from dflash2_hf import DFlash2DraftModel, DFlashConfig, DFlashDraftModel
from dflash2_hf.cli.checks import check_target_argument, drafter_config, refuse_below
from dflash2_hf.cost.timing import device_seconds
from dflash2_hf.generation import loop
from dflash2_hf.measuring.evaluation import benchmark_prompts
from dflash2_hf.measuring.exactness import continuation_distribution, goodness_of_fit, keep_every_draft, randomize
from dflash2_hf.presets import default_drafter_folder, load_target

COMMAND = "device_check.py"
VOCAB, NEW_TOKENS, PROMPT = 5, 4, [[1, 3, 2, 0]]


def greedy_identity(target, drafter, prompts, max_new_tokens: int) -> dict:
    """How many prompts decode to plain greedy ``generate``'s tokens through each route."""
    routes = {"custom_generate": {"custom_generate": dflash2_hf.custom_generate, "drafter": drafter},
              "assistant_model": {"assistant_model": drafter}}
    identical = dict.fromkeys(routes, 0)
    for inputs in prompts:
        plain = target.generate(inputs, max_new_tokens=max_new_tokens, do_sample=False)
        for route, kwargs in routes.items():
            identical[route] += torch.equal(plain, target.generate(inputs, max_new_tokens=max_new_tokens,
                                                                    do_sample=False, **kwargs))
    return {"prompts": len(prompts), "identical": identical,
            "passed": all(count == len(prompts) for count in identical.values())}


def tiny_pair(device: torch.device) -> tuple[torch.nn.Module, DFlashDraftModel]:
    """A tiny random Qwen3 target over VOCAB tokens and a tiny random DFlash 2 drafter for it (blocks of 3)."""
    shape = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=64)
    target = Qwen3ForCausalLM(Qwen3Config(**shape, intermediate_size=128, num_hidden_layers=3,
                                          tie_word_embeddings=False))
    config = DFlashConfig(**shape, intermediate_size=96, num_hidden_layers=2, num_target_layers=3,
                          target_layer_ids=[0, 2], block_size=3, mask_token_id=VOCAB - 1, conv_kernel_size=2,
                          conv_group_size=16, selector_rank=8, selector_top_k=3, default_plain_fallback=False)
    drafter = DFlash2DraftModel(config)
    return randomize(target, seed=2).to(device).eval(), randomize(drafter, seed=3).to(device).eval()


def sampled_continuations(target, drafter, samples: int) -> list[tuple[int, ...]]:
    """``samples`` continuations of PROMPT drawn with the drafter at temperature 1 (seeded)."""
    torch.manual_seed(0)
    prompt = torch.tensor(PROMPT, device=target.device)
    return [tuple(target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=0,
                                  assistant_model=drafter)[0, prompt.shape[1]:].tolist()) for _ in range(samples)]


def exact_sampling(device: torch.device, samples: int) -> dict:
    """Chi-square p-values of drafted samples against the exact distribution, with the verifier and a biased one."""
    target, drafter = tiny_pair(device)
    exact = continuation_distribution(target, torch.tensor(PROMPT, device=device), NEW_TOKENS, temperature=1.0)
    p_value = goodness_of_fit(sampled_continuations(target, drafter, samples), exact)
    real_verifier = loop.verify_sampled
    loop.verify_sampled = keep_every_draft
    try:
        control = goodness_of_fit(sampled_continuations(target, drafter, samples), exact)
    finally:
        loop.verify_sampled = real_verifier
    return {"samples": samples, "p_value": p_value, "biased_control_p_value": control,
            "passed": p_value > 1e-3 and control < 1e-6}


def timed(device: torch.device, run) -> float:
    """Seconds ``run()`` takes, from and to an idle device."""
    started = device_seconds(device)
    run()
    return device_seconds(device) - started


def speed(target, drafter, prompts, max_new_tokens: int) -> dict:
    """Plain and drafted greedy decoding of every prompt (after one warm-up of each), timed on the device."""
    methods = {"plain": {}, "dflash2": {"assistant_model": drafter}}
    seconds = {}
    for name, kwargs in methods.items():
        target.generate(prompts[0], max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
        seconds[name] = sum(timed(target.device, lambda: target.generate(
            inputs, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)) for inputs in prompts)
    return {"seconds": seconds, "speedup": seconds["plain"] / seconds["dflash2"]}


def device_name(device: torch.device) -> str:
    """The accelerator's name (CUDA), else the device as torch names it."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


def parsed_arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line, refused in one line (before any model loads) where a value or the device is unusable."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="a torch device: cuda, cuda:1, xpu, mps or cpu")
    parser.add_argument("--target", default="smollm2-135m", help="a preset name or a checkpoint folder")
    parser.add_argument("--drafter", help="a drafter folder (default: the one shipped for the target)")
    parser.add_argument("--per-source", type=int, default=3, help="HumanEval and MT-Bench prompts each")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--samples", type=int, default=1000, help="continuations drawn for the chi-square test")
    parser.add_argument("--out", type=Path, default=Path("device_check.json"))
    args = parser.parse_args(argv)
    for flag in ("--per-source", "--max-new-tokens", "--samples"):
        refuse_below(COMMAND, flag, getattr(args, flag[2:].replace("-", "_")), 1)
    check_target_argument(COMMAND, "--target", args.target)
    drafter_config(COMMAND, "--drafter", args.drafter, args.target)
    try:
        torch.empty(0, device=args.device)
    except (RuntimeError, AssertionError) as error:
        raise SystemExit(f"{COMMAND}: --device {args.device}: not usable here ({str(error).splitlines()[0]}).")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parsed_arguments(argv)
    device = torch.device(args.device)
    target, tokenizer = load_target(args.target, dtype=torch.float32)
    target = target.to(device)
    drafter = DFlashDraftModel.from_pretrained(args.drafter or default_drafter_folder(args.target),
                                               dtype=torch.float32).to(device).eval()
    prompts = [inputs.to(device) for _, inputs in benchmark_prompts(tokenizer, ["humaneval", "mtbench"],
                                                                      args.per_source)]
    report = {"device": device_name(device), "target": args.target, "torch": torch.__version__,
              "greedy_identity": greedy_identity(target, drafter, prompts, args.max_new_tokens),
              "exact_sampling": exact_sampling(device, args.samples),
              "speed": speed(target, drafter, prompts, args.max_new_tokens)}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"device: {report['device']}\n{json.dumps(report, indent=2)}\nwritten to {args.out}")
    passed = report["greedy_identity"]["passed"] and report["exact_sampling"]["passed"]
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
