"""`dflash2-hf generate`: answer a prompt with the drafter (streamed) and compare with plain decoding."""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

from ..cpu.exact_attention import ExactAttention
from ..cpu.kernels import (
    PackedLinears,
    bf16_rows_independent,
    cpu_description,
    exact_bf16_supported,
    fastest_exact_setting,
)
from ..drafting.options import EXACTNESS, DraftOptions
from ..measuring.greedy_difference import GreedyDifference, compare_greedy
from ..modeling import DFlashDraftModel
from .checks import (
    PATHS,
    check_bf16_cpu_options,
    check_decoding_sizes,
    check_prompts_fit,
    check_selector_paths,
    check_target_argument,
    drafter_config,
    refuse_below,
)
from .parsers import add_command, add_cpu_kernel_options, add_target


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dflash2-hf generate` and its options."""
    run = add_command(commands, "generate", "answer a prompt with the default drafter, report speed vs plain decoding",
                      "Answer one prompt with the target and a drafter: prints the setting chosen for this CPU, "
                      "streams the answer, then decodes it again without the drafter and prints tokens/s, mean "
                      "acceptance length, the speedup and whether both outputs are identical.")
    run.add_argument("prompt", nargs="?", help="the question (default: read stdin)")
    models = run.add_argument_group("models and numerics")
    add_target(models)
    models.add_argument("--drafter", help="drafter folder (default: the one shipped for the preset)")
    models.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto (default): this CPU's fastest exact setting (bf16 with packed linears and the "
                             "float64 attention where the CPU has bf16 matmul instructions, else float32 with packed "
                             "linears); float32: greedy output token-identical to plain decoding")
    add_cpu_kernel_options(models, "ours and the baseline alike")
    add_decoding_options(run.add_argument_group("decoding"))
    run.add_argument_group("output").add_argument("--no-baseline", action="store_true",
                                                  help="skip the plain-decoding comparison")
    run.set_defaults(run=generate)


def add_decoding_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--path", choices=PATHS, help="path strategy (default: the drafter's)")
    group.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate (>= 1)")
    group.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (>= 0; 0 decodes greedily)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling share (0 < p <= 1)")
    group.add_argument("--tree-nodes", type=int,
                       help="verify a token tree of up to this many drafted tokens in one target forward (>= 0; 0: one "
                            "path; default: the drafter's, 8 for the shipped one)")
    group.add_argument("--adaptive-block", action="store_true",
                       help="verify each drafted path only as far as it pays on this machine (cost measured once, "
                            "cached); with --tree-nodes, size each tree that way, up to that many nodes")
    group.add_argument("--lookup-tokens", type=int,
                       help="add a branch of up to this many tokens copied from the context to each token tree "
                            "(>= 0; 0: none; default: the drafter's)")
    group.add_argument("--exactness", choices=EXACTNESS, default="rounding",
                       help="greedy float32: rounding (default) drafts at any width, plain decoding's output except "
                            "where two logits tie within float rounding (every difference shown to be one); bitwise, "
                            "the strict opt-in, verifies drafts only at widths this machine computes as one-token "
                            "steps, else decodes plainly")


def check_generate_arguments(args: argparse.Namespace) -> None:
    """Refuse, in one line and before any model loads, every `dflash2-hf generate` argument that would otherwise
    fail after loading (with a traceback) or be misread (a negative temperature decoded greedily)."""
    command = "dflash2-hf generate"
    check_decoding_sizes(args, command, smallest_tree=0)
    refuse_below(command, "--temperature", args.temperature, 0, " (0: greedy)")
    if not 0 < args.top_p <= 1:
        raise SystemExit(f"dflash2-hf generate: --top-p must be in (0, 1], got {args.top_p}.")
    check_bf16_cpu_options(args, command)
    check_target_argument(command, "--target", args.target)
    config = drafter_config(command, "--drafter", args.drafter, args.target)
    check_selector_paths(command, "--path", [args.path] if args.path else [], config)


def identity_verdict(difference: GreedyDifference, dtype: str, exact_attention: bool = False) -> str:
    """``yes``, or where and why the outputs part (:mod:`~dflash2_hf.measuring.greedy_difference`: at a near-tie of
    plain decoding's logits, or where its choice was clear: a bug); a bf16 difference is explained, since only fp32
    (or bf16 with the exact attention, on a CPU whose bf16 blocks round as single rows do) keeps near-ties rare."""
    if difference.outcome == "identical":
        return "yes"
    if dtype == "bfloat16" and not exact_attention:
        return ("no (bf16 promises no identity: a many-token verification can round differently from one-token "
                "steps; --dtype float32, or --exact-attention, is the exact setting)")
    if dtype == "bfloat16" and not bf16_rows_independent():
        return ("no (this CPU's bf16 matmuls round a many-token block differently from one-token steps, which the "
                "float64 attention cannot change; --dtype float32 is the exact setting here)")
    return f"no: {difference.describe()}"


def exact_bf16_tip(dtype: str) -> str | None:
    """For a float32 run on a CPU where bf16 decoding is exact too
    (:func:`~dflash2_hf.cpu.kernels.exact_bf16_supported`): the bf16 setting, faster there."""
    if dtype != "float32" or not exact_bf16_supported():
        return None
    return ("exact too and faster on this CPU: --dtype bfloat16 --packed-linears --exact-attention (a bf16 block "
            "costs about as much to verify as one token; see docs/generation.md, exact greedy decoding in bf16)")


def choose_setting(args: argparse.Namespace) -> str | None:
    """With ``--dtype auto`` (the default), this CPU's fastest exact setting in place of the dtype and kernel flags,
    and the line saying what was chosen and why; ``None`` when the dtype was given."""
    if args.dtype != "auto":
        return None
    if args.packed_linears or args.exact_attention:
        raise SystemExit("dflash2-hf generate: --packed-linears and --exact-attention go with an explicit --dtype; "
                         "--dtype auto (the default) chooses them itself.")
    setting = fastest_exact_setting()
    args.dtype = setting.dtype
    args.packed_linears, args.exact_attention = setting.packed_linears, setting.exact_attention
    return f"setting for {cpu_description()}: {setting.describe()} (--dtype float32 or bfloat16 to choose yourself)"


def prompt_text(args: argparse.Namespace) -> str:
    """The prompt: the argument, else standard input (refused when there is none, it is not UTF-8, or it is empty)."""
    if args.prompt is not None:
        return args.prompt
    if sys.stdin is None or sys.stdin.closed:
        raise SystemExit("dflash2-hf generate: no prompt: pass it as an argument or on standard input.")
    try:
        text = sys.stdin.buffer.read().decode("utf-8") if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    except UnicodeDecodeError as error:
        raise SystemExit(f"dflash2-hf generate: standard input is not UTF-8 text ({error}).") from None
    if not text.strip():
        raise SystemExit("dflash2-hf generate: no prompt: standard input was empty; pass the prompt as an argument.")
    return text


def generate(args: argparse.Namespace) -> None:
    """Answer a prompt with the drafter (streamed), then plain decoding, and report the speedup of this run."""
    from transformers import TextStreamer

    from ..presets import default_drafter_folder, load_target

    chosen = choose_setting(args)
    check_generate_arguments(args)
    warnings.filterwarnings("ignore", message="Decoding plainly")  # the result line says it, with the flag to pass
    prompt = prompt_text(args)
    if chosen:
        print(f"--- {chosen}", flush=True)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_target(args.target, dtype=dtype)
    drafter = DFlashDraftModel.from_pretrained(args.drafter or default_drafter_folder(args.target), dtype=dtype).eval()
    if args.packed_linears:  # for ours and the plain baseline alike
        PackedLinears(target, drafter).enable()
    if args.exact_attention:  # the target's, for ours and the plain baseline alike
        ExactAttention(target).enable()
    messages = [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    check_prompts_fit("dflash2-hf generate", [("argv", inputs["input_ids"])], args.max_new_tokens, target)
    sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p} if args.temperature > 0 else {"do_sample": False}
    settings = dict(max_new_tokens=args.max_new_tokens, **sampling)
    ours_kwargs = {"assistant_model": drafter, "dflash_path": args.path, "dflash_tree_nodes": args.tree_nodes,
                   "dflash_adaptive_block": args.adaptive_block or None,
                   "dflash_lookup_tokens": args.lookup_tokens,  # unset: the drafter config's defaults
                   "dflash_exactness": args.exactness}
    # Warm both methods up (first-call allocations, lazy inits, the adaptive block's cost measurement) so neither
    # pays them inside its timing.
    target.generate(**inputs, **ours_kwargs, max_new_tokens=8, do_sample=False)
    if not args.no_baseline:
        target.generate(**inputs, max_new_tokens=8, do_sample=False)

    started = time.perf_counter()
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    output = target.generate(**inputs, **ours_kwargs, streamer=streamer, return_dict_in_generate=True, **settings)
    ours_seconds = time.perf_counter() - started
    ours, stats = output.sequences, output.dflash_stats
    new_tokens = ours.shape[1] - inputs["input_ids"].shape[1]
    acceptance = f", mean acceptance length {stats.mean_acceptance_length:.2f}" if stats.cycles else ""
    print(f"\n--- dflash2 ({stats.path}, {decoding_mode(args, drafter, stats)}; exactness {args.exactness}): "
          f"{new_tokens} tokens, {new_tokens / ours_seconds:.1f} tok/s{acceptance}")
    if not args.no_baseline:
        compare_with_plain(args, target, inputs, settings, ours, new_tokens / ours_seconds)


def decoding_mode(args: argparse.Namespace, drafter: DFlashDraftModel, stats) -> str:
    """How the drafted tokens were verified (one path, a tree, sized by cost, with a lookup branch) and, with the
    fallback to plain steps, how many steps took it."""
    options = DraftOptions.for_drafter(drafter, tree_nodes=args.tree_nodes, adaptive_block=args.adaptive_block or None,
                                       lookup_tokens=args.lookup_tokens)
    mode = (f"tree of up to {options.tree_nodes}, sized by cost" if options.tree_nodes and options.adaptive_block
            else f"tree of {options.tree_nodes}" if options.tree_nodes
            else "adaptive block" if options.adaptive_block else f"one path of {options.block_size - 1}")
    mode += f" + lookup of {options.lookup_tokens}" if options.lookup_tokens else ""
    if not stats.cycles and stats.plain_steps:
        return (f"{mode} asked; plain decoding here, since no verification width of this CPU rounds as one-token "
                "steps; --exactness rounding drafts anyway")
    if options.plain_fallback:
        mode += (f"; {stats.plain_steps} plain steps and {stats.lookup_cycles} copies from the context verified "
                 "alone where drafting did not pay")
    return mode


def compare_with_plain(args: argparse.Namespace, target, inputs, settings: dict, ours: torch.Tensor,
                       ours_rate: float) -> None:
    """Decode the prompt plainly with the same settings; print the speedup and, greedy, whether the tokens match."""
    started = time.perf_counter()
    plain = target.generate(**inputs, **settings)
    plain_seconds = time.perf_counter() - started
    plain_tokens = plain.shape[1] - inputs["input_ids"].shape[1]
    speedup = ours_rate / (plain_tokens / plain_seconds)
    print(f"--- plain decoding: {plain_tokens} tokens, {plain_tokens / plain_seconds:.1f} tok/s; speedup {speedup:.2f}x")
    if not settings["do_sample"]:
        prompt_length = inputs["input_ids"].shape[1]
        difference = compare_greedy(target, inputs, ours[0, prompt_length:].tolist(), plain[0, prompt_length:].tolist())
        verdict = identity_verdict(difference, args.dtype, args.exact_attention)
        print(f"--- identical to plain decoding: {verdict}")
        if tip := exact_bf16_tip(args.dtype):
            print(f"--- {tip}")
