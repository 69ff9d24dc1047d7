"""Mean acceptance length of a drafter on held-out prompts (HumanEval code, MT-Bench chat), per path strategy and
temperature, measured with the real ``generate`` loop."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..modeling import DFlashDraftModel
from ..training.code_prompts import code_request
from ..training.data import evaluation_prompts


def chat_inputs(tokenizer, benchmark: str, prompt: str) -> torch.Tensor:
    """Token ids of an evaluation prompt in the target's chat format."""
    content = code_request(prompt) if benchmark == "humaneval" else prompt
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


def check_per_source(sources: list[str], per_source: int) -> None:
    """Refuse asking ShareGPT for more prompts than it holds out (the rest may be training data)."""
    from ..training.data import SHAREGPT_BENCHMARK_PROMPTS

    if "sharegpt" in sources and not 0 < per_source <= SHAREGPT_BENCHMARK_PROMPTS:
        raise ValueError(f"--per-source {per_source}: ShareGPT holds out {SHAREGPT_BENCHMARK_PROMPTS} benchmark prompts "
                         "(the rest may be training data).")


def benchmark_prompts(tokenizer, sources: list[str], per_source: int) -> list[tuple[str, torch.Tensor]]:
    """``(source, input_ids)`` pairs: HumanEval, MT-Bench, the held-out tail of ShareGPT, or local JSONL files
    (``{"prompt": ...}`` or ``{"messages": [...]}`` per line)."""
    from ..training.data import sharegpt_benchmark_prompts

    check_per_source(sources, per_source)
    evaluation = evaluation_prompts()
    pairs = []
    for source in sources:
        if source in evaluation:
            pairs += [(source, chat_inputs(tokenizer, source, p)) for p in evaluation[source][:per_source]]
        elif source == "sharegpt":
            held_out = sharegpt_benchmark_prompts()  # never training data
            pairs += [(source, chat_inputs(tokenizer, source, p)) for p in held_out[-per_source:]]
        else:
            for messages in prompt_file_messages(source, per_source):
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True)["input_ids"]
                pairs.append((Path(source).stem, ids))
    return pairs


def prompt_file_messages(source: str, per_source: int) -> list[list[dict]]:
    """The chat messages of the first ``per_source`` prompts of a JSONL file, one ``{"prompt": "..."}`` or
    ``{"messages": [{"role": ..., "content": ...}, ...]}`` per line; read and checked before any model loads, so
    a file that is not that fails naming its line (``ValueError``)."""
    try:
        lines = [line for line in Path(source).read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--prompts {source} cannot be read as text ({error}).") from None
    if not lines:
        raise ValueError(f"--prompts {source} holds no prompts (one JSON object per line).")
    return [_line_messages(source, number, line) for number, line in enumerate(lines[:per_source], 1)]


def _line_messages(source: str, number: int, line: str) -> list[dict]:
    """One prompt file line as chat messages, or a ValueError naming the line and what it should hold."""
    where = f"--prompts {source}, line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not JSON ({error.msg}).") from None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and record["prompt"]:
        return [{"role": "user", "content": record["prompt"]}]
    messages = record.get("messages") if isinstance(record, dict) else None
    if (isinstance(messages, list) and messages and all(
            isinstance(message, dict) and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str) for message in messages)):
        return messages
    raise ValueError(f'{where} holds neither a non-empty "prompt" string nor a "messages" list of '
                     '{"role": ..., "content": ...} objects.')


@dataclass
class AcceptanceResult:
    benchmark: str
    path: str
    temperature: float
    prompts: int
    cycles: int
    new_tokens: int
    mean_acceptance_length: float
    mean_verified_tokens: float  # drafted tokens sent to the target per cycle (a tree's nodes, its lookup branch)


def measure_acceptance(
    target,
    tokenizer,
    drafter: DFlashDraftModel,
    paths: list[str],
    temperatures: list[float],
    prompts_per_benchmark: int,
    max_new_tokens: int = 128,
    seed: int = 0,
    dflash_kwargs: dict | None = None,
) -> list[AcceptanceResult]:
    """Generate on the first ``prompts_per_benchmark`` prompts of each benchmark with every path and temperature
    (``dflash_kwargs``: more ``dflash_*`` options for every call, e.g. ``{"dflash_lookup_tokens": 8}``). Every cycle
    drafts: the plain-decoding guard, which speeds decoding up by skipping drafts that do not pay, would also choose
    which cycles get measured (a weak drafter's few); and at every width, since a machine whose kernels round a
    many-token forward unlike one-token steps would otherwise decode greedy float32 plainly (``exactness``)."""
    options = {"dflash_plain_fallback": False, "dflash_exactness": "rounding", **(dflash_kwargs or {})}
    results = []
    benchmarks = {name: prompts[:prompts_per_benchmark] for name, prompts in evaluation_prompts().items()}
    total = sum(len(p) for p in benchmarks.values()) * len(paths) * len(temperatures)
    with tqdm(total=total, desc="acceptance", unit="run") as progress:  # closed on an error too
        for benchmark, prompts in benchmarks.items():
            for temperature in temperatures:
                for path in paths:
                    lengths: list[int] = []
                    verified: list[int] = []
                    torch.manual_seed(seed)
                    for prompt in prompts:
                        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
                        output = target.generate(chat_inputs(tokenizer, benchmark, prompt), max_new_tokens=max_new_tokens,
                                                 assistant_model=drafter, dflash_path=path, return_dict_in_generate=True,
                                                 **sampling, **options)
                        lengths += output.dflash_stats.acceptance_lengths
                        verified += output.dflash_stats.verified_lengths
                        progress.update(1)
                    results.append(AcceptanceResult(benchmark, path, temperature, len(prompts), len(lengths), sum(lengths),
                                                    sum(lengths) / max(1, len(lengths)),
                                                    sum(verified) / max(1, len(verified))))
    return results


def results_table(results: list[AcceptanceResult]) -> str:
    """A markdown table: one row per benchmark and temperature, one column per path."""
    paths = list(dict.fromkeys(r.path for r in results))
    rows = {}
    for r in results:
        rows.setdefault((r.benchmark, r.temperature), {})[r.path] = r.mean_acceptance_length
    lines = ["| benchmark | temperature | " + " | ".join(paths) + " |", "|---|---|" + "---|" * len(paths)]
    for (benchmark, temperature), values in rows.items():
        lines.append(f"| {benchmark} | {temperature:g} | " + " | ".join(f"{values.get(p, float('nan')):.2f}" for p in paths) + " |")
    return "\n".join(lines)


def as_records(results: list[AcceptanceResult]) -> list[dict]:
    return [asdict(r) for r in results]
