"""`dflash2-hf bench`: every decoding method side by side on held-out prompts."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..cpu.exact_attention import ExactAttention
from ..cpu.kernels import PackedLinears
from ..export import describe_drafter
from ..drafting.options import EXACTNESS
from ..measuring.reference_peer import DEFAULT_VENV
from ..modeling import DFlashDraftModel
from .checks import (
    PATHS,
    PROMPT_SOURCES,
    check_bf16_cpu_options,
    check_decoding_sizes,
    check_prompts_fit,
    check_out_folder,
    check_target_argument,
    drafter_config,
    refuse_below,
)
from .parsers import add_command, add_cpu_kernel_options, add_target


SHIPPED = "shipped"  # --drafter's name for the drafter shipped for the preset target


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dflash2-hf bench` and its options, in groups."""
    measure = add_command(commands, "bench", "benchmark every decoding method side by side",
                          "Benchmark decoding methods side by side, interleaved per prompt: plain generate, "
                          "transformers' prompt lookup, ours (the default and each path) and any peers asked for; "
                          "prints a table of tokens/s, speedup (median of paired ratios to plain generate in the "
                          "same run) and acceptance per method and temperature, and writes results.json, "
                          "results.md and plots to --out.")
    models = measure.add_argument_group("models")
    add_target(models)
    models.add_argument("--drafter", nargs="+",
                        help="drafter folder, or `shipped` for the one shipped for the preset (the default); "
                             "several run side by side, each method's name ending in its folder's name")
    models.add_argument("--assistant", help="a small draft LM (preset or folder) for classic assisted generation")
    models.add_argument("--no-drafter", action="store_true",
                        help="leave our drafter out (e.g. a target without a drafter yet, with --assistant)")
    models.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of every model")
    models.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (>= 1)")
    prompts = measure.add_argument_group("prompts")
    prompts.add_argument("--prompts", nargs="+", default=list(PROMPT_SOURCES),
                         help="humaneval, mtbench, sharegpt (held-out tail) or a JSONL file of prompts/messages")
    prompts.add_argument("--per-source", type=int, default=5, help="prompts per source (>= 1)")
    prompts.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0],
                         help="sampling temperatures (>= 0; 0 decodes greedily)")
    prompts.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer (>= 1)")
    add_method_options(measure.add_argument_group("methods"))
    peers = measure.add_argument_group("peers")
    peers.add_argument("--llama-cpp", action="store_true",
                       help="add llama.cpp's plain decoding of the preset's GGUF file (needs llama-cpp-python)")
    peers.add_argument("--reference-venv", nargs="?", const=str(DEFAULT_VENV), metavar="VENV",
                       help="also run the authors' reference implementation (PyPI dflash 0.1.0) on the same target "
                            "and drafter, from this venv (the flag alone: ./.venv-reference)")
    measure.add_argument_group("output").add_argument("--out", default="bench",
                                                      help="folder for results.json, results.md and plots")
    measure.set_defaults(run=bench)


def add_method_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--paths", nargs="+", choices=PATHS, default=PATHS,
                       help="path strategies run as methods of their own (one whole path drafted every cycle)")
    group.add_argument("--block-sizes", nargs="+", type=int, metavar="N",
                       help="verified block sizes to compare (default: the drafter's); one method per path and size")
    group.add_argument("--adaptive-block", action="store_true",
                       help="also run each path with the cost-aware block length, and each tree size cost-sized "
                            "(cost measured here first)")
    group.add_argument("--tree-nodes", nargs="+", type=int, metavar="N",
                       help="also run each path with token trees of up to N drafted tokens (>= 1; one method per N)")
    group.add_argument("--lookup-tokens", nargs="+", type=int, metavar="L",
                       help="with --tree-nodes, also run each tree with a context-lookup branch of up to L tokens "
                            "(>= 1)")
    group.add_argument("--lookup-ngrams", nargs="+", type=int, metavar="M",
                       help="with --lookup-tokens, run each lookup branch once per longest matched suffix of M "
                            "tokens (max_matching_ngram_size; default: one run at 8)")
    group.add_argument("--exactness", choices=EXACTNESS, default="rounding",
                       help="the 'dflash2 default' method's (rounding: the library default, drafting at every width; "
                            "bitwise: the strict opt-in, which decodes greedy float32 plainly where no verification "
                            "width rounds as one-token steps); the per-path methods always draft at every width")
    group.add_argument("--no-peers", action="store_true",
                       help="leave out the methods that are not ours or plain decoding (prompt lookup, transformers' "
                            "DFlash): a bench of drafters against each other in half the time")
    add_cpu_kernel_options(group, "a packed twin of every method, its name ending in 'packed'; attention: every "
                                  "method, plain included")


def check_bench_arguments(args: argparse.Namespace) -> None:
    """Refuse, in one line and before any model loads, every `dflash2-hf bench` argument that would otherwise fail
    after loading, measure nothing or add a method that repeats another."""
    from ..measuring.evaluation import check_per_source, prompt_file_messages

    command = "dflash2-hf bench"
    check_out_folder("bench", "--out", args.out)
    check_decoding_sizes(args, command, smallest_tree=1)
    refuse_below(command, "--per-source", args.per_source, 1)
    refuse_below(command, "--temperatures", args.temperatures, 0, " (0: greedy)")
    refuse_below(command, "--threads", args.threads, 1)
    check_per_source(args.prompts, args.per_source)
    for source in args.prompts:
        if source not in PROMPT_SOURCES and not Path(source).is_file():
            raise SystemExit(f"dflash2-hf bench: --prompts {source}: neither {', '.join(PROMPT_SOURCES)} nor a "
                             "JSONL file.")
        if source not in PROMPT_SOURCES:
            prompt_file_messages(source, args.per_source)
    if args.lookup_tokens and not args.tree_nodes:
        raise SystemExit("dflash2-hf bench: --lookup-tokens adds a branch to token trees; give --tree-nodes too.")
    if args.lookup_ngrams and not args.lookup_tokens:
        raise SystemExit("dflash2-hf bench: --lookup-ngrams sets how the lookup branch matches; give --lookup-tokens too.")
    if args.lookup_ngrams and min(args.lookup_ngrams) < 1:
        raise SystemExit("dflash2-hf bench: --lookup-ngrams must be >= 1.")
    check_bf16_cpu_options(args, command)
    check_target_argument(command, "--target", args.target)
    if args.no_peers and (args.assistant or args.llama_cpp or args.reference_venv):
        raise SystemExit("dflash2-hf bench: --no-peers leaves every peer out; drop it, or drop --assistant, "
                         "--llama-cpp and --reference-venv.")
    if args.assistant:
        check_target_argument(command, "--assistant", args.assistant)
    if not args.no_drafter:
        check_drafters(args)


def check_drafters(args: argparse.Namespace) -> None:
    """Each ``--drafter`` folder holds a drafter whose block fits every ``--block-sizes``; none is given twice, and
    the reference peer (which drafts with one drafter) is not asked for next to several."""
    folders = asked_drafters(args)
    resolved = [Path(folder).resolve() if folder else None for folder in folders]
    if len(set(resolved)) < len(resolved):
        raise SystemExit("dflash2-hf bench: --drafter names the same folder twice.")
    if len(folders) > 1 and args.reference_venv:
        raise SystemExit("dflash2-hf bench: --reference-venv drafts with one drafter; give one --drafter.")
    for folder in folders:
        block_size = drafter_config("dflash2-hf bench", "--drafter", folder, args.target).block_size
        for size in args.block_sizes or []:
            if not 2 <= size <= block_size:
                raise SystemExit(f"dflash2-hf bench: --block-sizes must be between 2 and the drafter's {block_size} "
                                 f"(tokens per block, the anchor included), got {size}.")


def asked_drafters(args: argparse.Namespace) -> list[str | None]:
    """The ``--drafter`` folders as given, ``None`` for the preset's shipped one (``shipped``, or no ``--drafter``)."""
    return [None if folder == SHIPPED else folder for folder in args.drafter or [SHIPPED]]


def drafter_labels(folders: list[Path]) -> list[str]:
    """A short name per drafter folder: the fewest trailing path parts that tell the folders apart, a last part
    ``drafter`` left out (`train` writes ``RUN/drafter``, so the run names it): ``runs/a/drafter`` and
    ``runs/b/drafter`` -> ``a``, ``b``."""
    parts = [_without_drafter(Path(folder).resolve().parts) for folder in folders]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(folder) for folder in folders]


def _without_drafter(parts: tuple[str, ...]) -> tuple[str, ...]:
    return parts[:-1] if len(parts) > 1 and parts[-1] == "drafter" else parts


def start_peers(args: argparse.Namespace, stack, drafter_folder, dtype: torch.dtype, settings: dict) -> list:
    """The peer methods asked for (the authors' reference, llama.cpp), started before any model loads, so a missing
    or broken venv, a missing build or a non-GGUF target fails at once; their versions go into ``settings``."""
    from ..measuring.llama_cpp_peer import LlamaCppError, LlamaCppMethod
    from ..measuring.reference_peer import ReferenceMethod, ReferencePeer
    from ..presets import checkpoint_location

    peers = []
    if args.reference_venv:
        folder, gguf_file = checkpoint_location(args.target)
        peer = stack.enter_context(ReferencePeer(args.reference_venv, folder, drafter_folder, gguf_file=gguf_file,
                                                 dtype=dtype, threads=args.threads))
        settings["reference"] = {"venv": str(args.reference_venv), **peer.versions}
        peers.append(ReferenceMethod(peer))
    if args.llama_cpp:
        folder, gguf_file = checkpoint_location(args.target)
        if gguf_file is None:
            raise LlamaCppError(f"{args.target} is not a GGUF checkpoint; --llama-cpp needs a GGUF preset target.")
        peers.append(LlamaCppMethod(folder / gguf_file, threads=args.threads))
        settings["llama_cpp"] = peers[-1].version
    return peers


def bench(args: argparse.Namespace) -> None:
    """Every decoding method side by side on held-out prompts; writes results.json, results.md and plots."""
    from contextlib import ExitStack

    from ..measuring.benchmark import Benchmark, baseline_methods, with_packed_linears, write_report
    from ..measuring.evaluation import benchmark_prompts
    from ..measuring.llama_cpp_peer import LlamaCppError
    from ..measuring.reference_peer import ReferencePeerError
    from ..presets import default_drafter_folder, load_target

    check_bench_arguments(args)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    folders = [] if args.no_drafter else [Path(folder) if folder else default_drafter_folder(args.target)
                                          for folder in asked_drafters(args)]
    if args.reference_venv and not folders:
        raise SystemExit("dflash2-hf bench: the reference peer drafts with our drafter; drop --no-drafter.")
    named = [str(folder) for folder in folders]
    settings = {"target": args.target, "drafter": named[0] if len(named) == 1 else named or None,
                "block_sizes": args.block_sizes, "tree_nodes": args.tree_nodes, "lookup_tokens": args.lookup_tokens,
                "lookup_ngrams": args.lookup_ngrams, "dtype": args.dtype, "threads": args.threads,
                "max_new_tokens": args.max_new_tokens, "prompts": args.prompts, "per_source": args.per_source,
                "packed_linears": args.packed_linears, "exact_attention": args.exact_attention,
                "exactness": args.exactness}
    try:
        with ExitStack() as stack:
            peers = start_peers(args, stack, folders[0] if folders else None, dtype, settings)
            target, tokenizer = load_target(args.target, dtype=dtype)
            if args.exact_attention:  # every method's target, plain decoding included
                ExactAttention(target).enable()
            drafters = load_drafters(folders, dtype, settings)
            assistant = load_target(args.assistant, dtype=dtype)[0] if args.assistant else None
            prompts = benchmark_prompts(tokenizer, args.prompts, args.per_source)
            check_prompts_fit("dflash2-hf bench", prompts, args.max_new_tokens, target)
            packed = None if args.packed_linears else packed_baselines(target)
            methods = (baseline_methods(assistant, linears=packed, peers=not args.no_peers)
                       + drafted_methods(args, target, drafters, settings))
            if args.packed_linears:
                models = [target, *drafters.values(), *([assistant] if assistant else [])]
                methods = with_packed_linears(methods, PackedLinears(*models))
            methods += peers
            runs = Benchmark(target, methods, max_new_tokens=args.max_new_tokens).run(prompts, args.temperatures)
    except (ReferencePeerError, LlamaCppError) as error:
        raise SystemExit(f"dflash2-hf bench: {error}") from None
    write_report(runs, args.out, args.command_line, settings)
    print((Path(args.out) / "results.md").read_text())


def packed_baselines(target) -> PackedLinears | None:
    """The target's linears packed, for plain decoding (and prompt lookup) on the packed weights a drafter call
    runs on by default; ``None`` where this CPU or dtype does not pack them."""
    try:
        return PackedLinears(target)
    except ValueError:
        return None


def load_drafters(folders: list[Path], dtype: torch.dtype, settings: dict) -> dict[str, DFlashDraftModel]:
    """Each drafter by its label (no label for a lone one); their sizes go into ``settings`` (the selector's overhead
    in parameters, next to its share of the cycle time): flat for one drafter, by label for several."""
    labels = drafter_labels(folders) if len(folders) > 1 else [""] * len(folders)
    drafters, sizes = {}, {}
    for label, folder in zip(labels, folders):
        drafters[label] = DFlashDraftModel.from_pretrained(folder, dtype=dtype).eval()
        described = describe_drafter(folder)
        sizes[label] = {"parameters": described["parameters"], "selector_parameters": described["selector_parameters"]}
    if len(folders) == 1:
        settings |= {"drafter_parameters": sizes[""]["parameters"],
                     "selector_parameters": sizes[""]["selector_parameters"]}
    elif folders:
        settings["drafters"] = {label: {"folder": str(folder), **sizes[label]}
                                for label, folder in zip(labels, folders)}
    return drafters


def drafted_methods(args: argparse.Namespace, target, drafters: dict[str, DFlashDraftModel], settings: dict) -> list:
    """Every drafter's methods (:func:`~dflash2_hf.measuring.benchmark.drafter_methods`), each named with its label;
    with ``--adaptive-block`` each drafter's cycle cost is measured (or read) first, before any timed run."""
    from ..cost.cycle_cost import cycle_cost_for
    from ..measuring.benchmark import drafter_methods

    methods = []
    for label, drafter in drafters.items():
        cycle_cost = None
        if args.adaptive_block:
            longest = max(args.tree_nodes or [0]) + max(args.lookup_tokens or [0]) + 1
            cycle_cost = cycle_cost_for(target, drafter, drafter.config.block_size, longest_forward=longest)
            if label:
                settings.setdefault("cycle_costs", {})[label] = cycle_cost.to_json()
            else:
                settings["cycle_cost"] = cycle_cost.to_json()
        methods += drafter_methods(drafter, args.paths, label=label, block_sizes=args.block_sizes,
                                   cycle_cost=cycle_cost, tree_nodes=args.tree_nodes,
                                   lookup_tokens=args.lookup_tokens, lookup_ngrams=args.lookup_ngrams,
                                   exactness=args.exactness, peers=not args.no_peers)
    return methods
