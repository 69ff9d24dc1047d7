"""Side-by-side decoding benchmark: every method on the same target, dtype and threads, interleaved per prompt.

Speed is only ever reported as a ratio to plain ``generate`` measured in the same run on the same prompt (paired
ratios: median and quartiles), so machine drift hits every method alike.
"""

from __future__ import annotations

import json
import platform
import resource
import statistics
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

from ..cpu.kernels import PackedLinears, cpu_description
from ..generation.stats import DFlashStats, DraftRecord
from .greedy_difference import DEFAULT_WIDEST, compare_greedy
from ..results_table import markdown_table

SELECTOR_PATHS = ("greedy", "viterbi", "expected")
#: Plain decoding on packed linears: the baseline of the drafter's own share of a speedup.
PACKED_PLAIN = "plain packed"


@dataclass
class Decoded:
    """One decoding call as the benchmark records it: the prompt and new tokens (``[1, length]``), the seconds the
    call took, the tokens emitted per verification cycle when the method reports them itself, and the statistics of a
    DFlash call (from its ``generate`` output)."""

    sequence: torch.Tensor
    seconds: float
    acceptance_lengths: list[int] = field(default_factory=list)
    stats: DFlashStats | None = None


@dataclass
class Method:
    """A decoding method: a name, the extra ``generate`` arguments that select it and, optionally, packed linears
    (:class:`~dflash2_hf.cpu.kernels.PackedLinears`) switched on around its calls.

    A method that does not decode through the target's ``generate`` (a peer in another process, say) overrides
    :meth:`decode`.
    """

    name: str
    generate_kwargs: dict = field(default_factory=dict)
    linears: PackedLinears | None = None

    @property
    def uses_dflash(self) -> bool:
        return "dflash_path" in self.generate_kwargs

    def decode(self, target, inputs: torch.Tensor, max_new_tokens: int, temperature: float, seed: int) -> Decoded:
        """Seed torch, run ``target.generate`` with this method's arguments (greedy at temperature 0) and time it."""
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        torch.manual_seed(seed)
        with self.linears or nullcontext():
            started = time.perf_counter()
            output = target.generate(inputs, max_new_tokens=max_new_tokens, **sampling, **self.generate_kwargs,
                                     return_dict_in_generate=self.uses_dflash)
            seconds = time.perf_counter() - started
        if self.uses_dflash:
            return Decoded(output.sequences, seconds, stats=output.dflash_stats)
        return Decoded(output, seconds)


def with_packed_linears(methods: list[Method], linears: PackedLinears) -> list[Method]:
    """Each method followed by its twin on packed linears (named ``... packed``); methods that do not decode
    through the target's ``generate`` (peers) have no twin."""
    twins = []
    for method in methods:
        twins.append(method)
        if type(method) is Method:
            twins.append(replace(method, name=f"{method.name} packed", linears=linears))
    return twins


def standard_methods(
    drafter, paths=("argmax",) + SELECTOR_PATHS, assistant=None, prompt_lookup: int = 10, **drafting,
) -> list[Method]:
    """:func:`baseline_methods`, then :func:`drafter_methods` of ``drafter`` (none without one); ``drafting`` holds
    the latter's size options."""
    drafted = drafter_methods(drafter, paths, **drafting) if drafter is not None else []
    return baseline_methods(assistant, prompt_lookup) + drafted


def baseline_methods(assistant=None, prompt_lookup: int = 10, linears: PackedLinears | None = None,
                     peers: bool = True) -> list[Method]:
    """The methods that need no drafter of ours: plain decoding and, with ``peers``, prompt lookup and, when a small
    draft LM is given, classic assisted generation. With ``linears`` (the target's packed linears), plain decoding
    and prompt lookup also run on them (named ``... packed``): a drafter call packs its linears by default, and
    packing speeds up any decoding, so the drafter's own share of a speedup is its ratio to packed plain decoding."""
    methods = [Method("plain")]
    if peers:
        methods.append(Method("prompt lookup", {"prompt_lookup_num_tokens": prompt_lookup}))
    if linears is not None:
        methods = with_packed_linears(methods, linears)
    if peers and assistant is not None:
        methods.append(Method("assisted (draft LM)", {"assistant_model": assistant}))
    return methods


def drafter_methods(
    drafter, paths=("argmax",) + SELECTOR_PATHS, label: str = "", block_sizes: list[int] | None = None,
    cycle_cost=None, tree_nodes: list[int] | None = None, lookup_tokens: list[int] | None = None,
    lookup_ngrams: list[int] | None = None, exactness: str = "rounding", peers: bool = True,
) -> list[Method]:
    """Ours as the drafter's defaults set it up (``dflash2 default``: what ``generate(assistant_model=drafter)`` does
    with no option, the fallback to plain decoding included), transformers' built-in DFlash on the drafter, and ours
    per path (drafting every cycle, one whole path each, even for a drafter whose config defaults to a tree; per
    verified block size when several are given: names end in ``b<size>``). With a ``cycle_cost``
    (:class:`~dflash2_hf.cost.cycle_cost.CycleCost`), each path also runs with the cost-aware block length (names end
    in ``adaptive``), and with ``tree_nodes`` once per token-tree size (names end in ``tree<N>``; with a cost also
    cost-sized: ``tree<N> adaptive``; with ``lookup_tokens``, each tree also with a context-lookup branch of up to
    ``L`` tokens: ``tree<N> lookup<L>``, and with ``lookup_ngrams`` once per longest matched suffix:
    ``tree<N> lookup<L> ngram<M>``). A ``label`` (several drafters side by side) ends every name: ``(label)``.
    ``exactness`` is the default method's (the per-path methods draft at every width: the modes as named); without
    ``peers``, transformers' built-in DFlash is left out."""
    methods = [Method("dflash2 default", {"assistant_model": drafter, "dflash_path": None,
                                          "dflash_record_drafts": True, "dflash_exactness": exactness})]
    if peers:
        methods.append(Method("transformers dflash", {"assistant_model": drafter, "speculation_type": "dflash"}))
    sizes = block_sizes or [None]
    for path in (p for p in paths if p == "argmax" or drafter.config.is_dflash2):
        for size in sizes:
            kwargs = {"assistant_model": drafter, "dflash_path": path, "dflash_record_drafts": True,
                      "dflash_tree_nodes": 0,  # one whole path, whatever the drafter's default mode
                      "dflash_plain_fallback": False,  # drafting every cycle: the mode as named,
                      "dflash_exactness": "rounding"}  # at every width, whatever this machine's kernels round
            if size is not None:
                kwargs["dflash_block_size"] = size
            name = f"dflash2 {path}" + (f" b{size}" if len(sizes) > 1 else "")
            methods += _path_methods(name, kwargs, cycle_cost, tree_nodes, lookup_tokens, lookup_ngrams)
    return [replace(method, name=f"{method.name} ({label})") for method in methods] if label else methods


def _path_methods(name: str, kwargs: dict, cycle_cost, tree_nodes: list[int] | None,
                  lookup_tokens: list[int] | None, lookup_ngrams: list[int] | None) -> list[Method]:
    """One path at one block size: alone, cost-aware, and as each token tree asked for (see
    :func:`drafter_methods`)."""
    methods = [Method(name, kwargs)]
    if cycle_cost is not None:
        methods.append(Method(f"{name} adaptive", kwargs | {"dflash_adaptive_block": cycle_cost}))
    for nodes in tree_nodes or []:
        tree = kwargs | {"dflash_tree_nodes": nodes, "dflash_lookup_tokens": 0}
        methods.append(Method(f"{name} tree{nodes}", tree))
        for length in lookup_tokens or []:
            lookup = tree | {"dflash_lookup_tokens": length}
            if not lookup_ngrams:
                methods.append(Method(f"{name} tree{nodes} lookup{length}", lookup))
            for ngram in lookup_ngrams or []:
                methods.append(Method(f"{name} tree{nodes} lookup{length} ngram{ngram}",
                                      lookup | {"max_matching_ngram_size": ngram}))
        if cycle_cost is not None:
            methods.append(Method(f"{name} tree{nodes} adaptive", tree | {"dflash_adaptive_block": cycle_cost}))
    return methods


@dataclass
class Run:
    """One ``generate`` call."""

    method: str
    prompt: int
    benchmark: str
    temperature: float
    new_tokens: int
    seconds: float
    acceptance_lengths: list[int] = field(default_factory=list)
    verified_lengths: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    select_seconds: float = 0.0
    verify_seconds: float = 0.0
    plain_steps: int = 0  # one-token steps where the fallback found drafting slower than plain decoding
    lookup_cycles: int = 0  # cycles among the fallback's steps that verified copied tokens alone
    recall: dict = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)  # the new tokens, to compare greedy runs with plain decoding
    greedy_difference: dict | None = None  # greedy: how the tokens compare with plain decoding's (GreedyDifference)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds


def draft_recall(drafts: list[DraftRecord], sequence: list[int]) -> dict:
    """Per-position top-1 / top-K hits of the drafted lattices against the tokens actually emitted, and the oracle
    acceptance length (1 + the prefix whose every true token is among the candidates) of every cycle."""
    top1, topk, oracle = [], [], []
    for record in drafts:
        truth = sequence[record.anchor_position + 1 : record.anchor_position + 1 + record.candidate_ids.shape[0]]
        if not truth:
            continue
        hits_1 = [int(record.candidate_ids[j, 0]) == t for j, t in enumerate(truth)]
        hits_k = [t in record.candidate_ids[j].tolist() for j, t in enumerate(truth)]
        top1.append(hits_1)
        topk.append(hits_k)
        prefix = 0
        while prefix < len(hits_k) and hits_k[prefix]:
            prefix += 1
        oracle.append(1 + prefix)
    return {"top1": top1, "topk": topk, "oracle": oracle}


def oracle_acceptance(candidates: list[list[int]], truth: list[int]) -> int:
    """1 + the length of the prefix of ``truth`` whose every token is among that position's candidates."""
    record = DraftRecord(-1, torch.tensor(candidates), [])
    return draft_recall([record], truth)["oracle"][0]


class Benchmark:
    """Runs every method on every prompt at every temperature, rotating the method order from prompt to prompt.

    Each method first decodes ``warmup_tokens`` tokens of the first prompt untimed, so that what happens once per
    process (packing the linears, measuring and caching the cycle cost, a peer's start-up) is not timed as part of
    the first prompt.
    """

    def __init__(self, target, methods: list[Method], max_new_tokens: int = 128, seed: int = 0,
                 warmup_tokens: int = 4):
        self.target = target
        self.methods = methods
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.warmup_tokens = warmup_tokens
        self.runs: list[Run] = []

    def _one(self, method: Method, inputs: torch.Tensor, index: int, benchmark: str, temperature: float) -> Run:
        decoded = method.decode(self.target, inputs, self.max_new_tokens, temperature, seed=self.seed + index)
        output = decoded.sequence
        run = Run(method.name, index, benchmark, temperature, output.shape[1] - inputs.shape[1], decoded.seconds,
                  acceptance_lengths=list(decoded.acceptance_lengths), token_ids=output[0, inputs.shape[1]:].tolist())
        stats = decoded.stats
        if stats is not None:
            run.acceptance_lengths = list(stats.acceptance_lengths)
            run.verified_lengths = list(stats.verified_lengths)
            run.draft_seconds, run.select_seconds, run.verify_seconds = stats.draft_seconds, stats.select_seconds, stats.verify_seconds
            run.plain_steps = stats.plain_steps
            run.lookup_cycles = stats.lookup_cycles
            run.recall = draft_recall(stats.drafts or [], output[0].tolist())
        return run

    def run(self, prompts: list[tuple[str, torch.Tensor]], temperatures: list[float]) -> list[Run]:
        if prompts and self.warmup_tokens > 0:
            for method in tqdm(self.methods, desc="warm-up", unit="method"):
                method.decode(self.target, prompts[0][1], self.warmup_tokens, temperatures[0], seed=self.seed)
        total = len(prompts) * len(temperatures) * len(self.methods)
        with tqdm(total=total, desc="benchmark", unit="run") as progress:  # closed on an error too
            for index, (benchmark, inputs) in enumerate(prompts):
                for temperature in temperatures:
                    shift = index % len(self.methods)
                    for method in self.methods[shift:] + self.methods[:shift]:
                        self.runs.append(self._one(method, inputs, index, benchmark, temperature))
                        progress.update(1)
        self._compare_greedy_runs(prompts)
        return self.runs

    def _compare_greedy_runs(self, prompts: list[tuple[str, torch.Tensor]]) -> None:
        """Every greedy run of a method other than plain decoding, compared with plain decoding's tokens on the same
        prompt (:func:`~dflash2_hf.measuring.greedy_difference.compare_greedy`; after the timed runs, so a difference's
        second plain decoding and the rounding measurement are not timed)."""
        plain = {r.prompt: r.token_ids for r in self.runs if r.method == "plain" and r.temperature == 0}
        widest = max([DEFAULT_WIDEST] + [1 + v for r in self.runs for v in r.verified_lengths])
        for run in self.runs:
            if run.temperature == 0 and run.method != "plain" and run.prompt in plain and run.token_ids:
                inputs = prompts[run.prompt][1]
                run.greedy_difference = compare_greedy(self.target, inputs, run.token_ids, plain[run.prompt],
                                                       widest).to_json()


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return (values[0],) * 3 if values else (float("nan"),) * 3
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")  # within the observed range
    return q1, median, q3


def summarize(runs: list[Run]) -> list[dict]:
    """Figures per method and temperature (see the module docstring for how speed is compared)."""
    plain = {(r.prompt, r.temperature): r for r in runs if r.method == "plain"}
    packed_plain = {(r.prompt, r.temperature): r for r in runs if r.method == PACKED_PLAIN}
    rows = []
    for method in dict.fromkeys(r.method for r in runs):
        for temperature in sorted({r.temperature for r in runs}):
            group = [r for r in runs if r.method == method and r.temperature == temperature]
            if not group:
                continue
            ratios = [r.tokens_per_second / plain[(r.prompt, temperature)].tokens_per_second
                      for r in group if (r.prompt, temperature) in plain]
            q1, median, q3 = _quartiles(ratios)
            row = {"method": method, "temperature": temperature, "runs": len(group),
                   "tokens_per_second": sum(r.new_tokens for r in group) / sum(r.seconds for r in group),
                   "speedup_median": median, "speedup_q1": q1, "speedup_q3": q3}
            over_packed = [r.tokens_per_second / packed_plain[(r.prompt, temperature)].tokens_per_second
                           for r in group if (r.prompt, temperature) in packed_plain]
            if over_packed:  # the share of the speedup that is not the packed linears' own
                row["speedup_over_packed_plain_median"] = _quartiles(over_packed)[1]
            if temperature == 0 and group[0].token_ids:  # greedy: does it give plain decoding's tokens, prompt by prompt?
                row["same_tokens_as_plain"] = sum(r.token_ids == plain[(r.prompt, 0)].token_ids
                                                  for r in group if (r.prompt, 0) in plain)
                row |= _difference_counts(group)
            lengths = [a for r in group for a in r.acceptance_lengths]
            if lengths:
                row |= {"mean_acceptance_length": sum(lengths) / len(lengths),
                        "acceptance_histogram": {n: lengths.count(n) for n in sorted(set(lengths))}}
                row |= _draft_figures(group)
            rows.append(row)
    return rows


def _difference_counts(group: list[Run]) -> dict:
    """How many greedy runs parted from plain decoding at a near-tie, and how many where its choice was clear (a
    bug), where the runs were compared (:meth:`Benchmark._compare_greedy_runs`)."""
    outcomes = [r.greedy_difference["outcome"] for r in group if r.greedy_difference]
    if not outcomes:
        return {}
    return {"near_ties": outcomes.count("near-tie"), "clear_differences": outcomes.count("clear")}


def _draft_figures(group: list[Run]) -> dict:
    """Oracle acceptance, recall by block position and the time shares of a cycle, for the runs that recorded their
    drafts and timed their cycles (a peer in another process reports acceptance lengths only)."""
    figures = {}
    verified = [v for r in group for v in r.verified_lengths]
    if verified:
        figures["mean_verified_drafted_tokens"] = statistics.fmean(verified)
    oracle = [o for r in group for o in r.recall.get("oracle", [])]
    if oracle:
        top1 = [h for r in group for h in r.recall.get("top1", [])]
        topk = [h for r in group for h in r.recall.get("topk", [])]
        width = max((len(h) for h in topk), default=0)
        figures |= {"oracle_acceptance_length": statistics.fmean(oracle),
                    "top1_recall_by_position": [_mean_at(top1, j) for j in range(width)],
                    "topk_recall_by_position": [_mean_at(topk, j) for j in range(width)]}
    cycle = sum(r.draft_seconds + r.select_seconds + r.verify_seconds for r in group)
    if cycle > 0:
        figures |= {"draft_share": sum(r.draft_seconds for r in group) / cycle,
                    "select_share": sum(r.select_seconds for r in group) / cycle,
                    "verify_share": sum(r.verify_seconds for r in group) / cycle}
    return figures


def _mean_at(hits: list[list[bool]], position: int) -> float:
    values = [h[position] for h in hits if len(h) > position]
    return sum(values) / len(values) if values else float("nan")


def summarize_by_benchmark(runs: list[Run]) -> list[dict]:
    """:func:`summarize` for each prompt source separately (code and chat accept very differently)."""
    return [{"benchmark": name, **row}
            for name in dict.fromkeys(r.benchmark for r in runs)
            for row in summarize([r for r in runs if r.benchmark == name])]


def acceptance_table(rows: list[dict]) -> str:
    """Mean acceptance length per benchmark and temperature (rows) and drafting method (columns)."""
    methods = list(dict.fromkeys(r["method"] for r in rows if "mean_acceptance_length" in r))
    cells: dict[tuple[str, float], dict[str, float]] = {}
    for row in rows:
        if "mean_acceptance_length" in row:
            cells.setdefault((row["benchmark"], row["temperature"]), {})[row["method"]] = row["mean_acceptance_length"]
    lines = ["| benchmark | T | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for (benchmark, temperature), values in cells.items():
        lines.append(f"| {benchmark} | {temperature:g} | "
                     + " | ".join(f"{values[m]:.2f}" if m in values else "–" for m in methods) + " |")
    return "\n".join(lines)


def speedup_table(rows: list[dict], figure: str = "speedup_median") -> str:
    """Median paired speedup per method (rows) and prompt source and temperature (columns), from
    :func:`summarize_by_benchmark`'s rows: a method can gain on code and lose on chat. ``figure`` picks the
    baseline: plain decoding (default) or, with ``speedup_over_packed_plain_median``, plain decoding on packed
    linears."""
    columns = list(dict.fromkeys((row["benchmark"], row["temperature"]) for row in rows))
    cells = {(row["method"], row["benchmark"], row["temperature"]): row[figure] for row in rows if figure in row}
    lines = ["| method | " + " | ".join(f"{benchmark} T={temperature:g}" for benchmark, temperature in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for method in dict.fromkeys(row["method"] for row in rows):
        lines.append(f"| {method} | " + " | ".join(
            f"{cells[(method, *column)]:.2f}" if (method, *column) in cells else "–" for column in columns) + " |")
    return "\n".join(lines)


def environment() -> dict:
    """Versions, threads, CPU (model and the flags that decide kernel speed) and peak memory of this process:
    results from different machines differ."""
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "cpu": cpu_description(),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _drafter_sizes(settings: dict) -> dict[str, dict]:
    """The bench's drafters by label (``""`` for a lone one), each with its parameter counts."""
    if "selector_parameters" in settings:
        return {"": {"parameters": settings["drafter_parameters"],
                     "selector_parameters": settings["selector_parameters"]}}
    return settings.get("drafters", {})


def _drafter_size(label: str, size: dict) -> str:
    named = f"Drafter {label}" if label else "Drafter"
    return (f"{named}: {size['parameters']:,} parameters, of which the candidate selector "
            f"{size['selector_parameters']:,}.")


def write_report(runs: list[Run], folder: str | Path, command: str, settings: dict) -> dict:
    """Write ``results.json`` (every raw number + environment), ``results.md`` and the PNG plots."""
    from .plots import benchmark_plots

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows, by_benchmark = summarize(runs), summarize_by_benchmark(runs)
    report = {"command": command, "settings": settings, "environment": environment(), "summary": rows,
              "summary_by_benchmark": by_benchmark, "runs": [asdict(r) for r in runs]}
    (folder / "results.json").write_text(json.dumps(report, indent=2))
    by_source = f"\nSpeedup (median of paired ratios) by prompt source:\n\n{speedup_table(by_benchmark)}\n"
    if any("speedup_over_packed_plain_median" in row for row in by_benchmark):
        by_source += ("\nSpeedup over plain decoding on packed linears (the share that is not the packing's own) by "
                      f"prompt source:\n\n{speedup_table(by_benchmark, 'speedup_over_packed_plain_median')}\n")
    if any("mean_acceptance_length" in row for row in by_benchmark):
        by_source += f"\nMean acceptance length by prompt source:\n\n{acceptance_table(by_benchmark)}\n"
    sizes = "".join(f"{_drafter_size(name, size)}\n\n" for name, size in _drafter_sizes(settings).items())
    machine = f"CPU: {report['environment']['cpu']}.\n\n"
    if "exactness" in settings:
        machine += f"Greedy exactness of `dflash2 default`: {settings['exactness']}.\n\n"
    (folder / "results.md").write_text(f"Command: `{command}`\n\n{machine}{sizes}{markdown_table(rows)}\n{by_source}")
    benchmark_plots(rows, folder)
    return report
