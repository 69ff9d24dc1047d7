"""The benchmark harness on tiny random models: every figure is produced, with sane values."""

import json

import pytest
import torch

from conftest import tiny_drafter, tiny_target
from dflash2_hf.cost import cycle_cost
from dflash2_hf.generation.stats import DraftRecord
from dflash2_hf.measuring.benchmark import (
    Benchmark,
    Method,
    Run,
    draft_recall,
    oracle_acceptance,
    standard_methods,
    summarize,
    write_report,
)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    target, drafter = tiny_target("qwen3"), tiny_drafter("dflash2")
    prompts = [(source, torch.randint(0, 90, (1, 10), generator=torch.Generator().manual_seed(i)))
               for i, source in enumerate(["code", "code", "chat"])]
    runs = Benchmark(target, standard_methods(drafter), max_new_tokens=16).run(prompts, [0.0, 1.0])
    folder = tmp_path_factory.mktemp("bench")
    return write_report(runs, folder, "dflash2-hf bench (test)", {"prompts": 3}), folder


def test_every_method_runs_at_every_temperature(report):
    summary = report[0]["summary"]
    methods = {row["method"] for row in summary}
    assert {"plain", "prompt lookup", "dflash2 default", "transformers dflash", "dflash2 argmax", "dflash2 greedy",
            "dflash2 viterbi", "dflash2 expected"} == methods
    assert {row["temperature"] for row in summary} == {0.0, 1.0}
    assert all(row["runs"] == 3 and row["tokens_per_second"] > 0 for row in summary)


def test_the_report_names_the_cpu_and_gives_the_speedup_by_prompt_source(report):
    from dflash2_hf.cpu.kernels import cpu_description

    results, folder = report
    markdown = (folder / "results.md").read_text()
    assert results["environment"]["cpu"] == cpu_description() and f"CPU: {cpu_description()}." in markdown
    header = "| method | code T=0 | code T=1 | chat T=0 | chat T=1 |"
    assert header in markdown
    table = markdown.split(header)[1].split("\n\n")[0]
    row = next(line for line in table.splitlines() if line.startswith("| dflash2 default |"))
    by_source = {(r["benchmark"], r["temperature"]): r["speedup_median"]
                 for r in results["summary_by_benchmark"] if r["method"] == "dflash2 default"}
    assert row == "| dflash2 default | " + " | ".join(f"{by_source[(b, t)]:.2f}" for b in ("code", "chat")
                                                      for t in (0.0, 1.0)) + " |"


def test_plain_decoding_is_the_unit_of_speed(report):
    for row in report[0]["summary"]:
        if row["method"] == "plain":
            assert row["speedup_median"] == row["speedup_q1"] == row["speedup_q3"] == 1.0
        assert row["speedup_q1"] <= row["speedup_median"] <= row["speedup_q3"]


def test_draft_figures_are_consistent(report):
    for row in report[0]["summary"]:
        if not row["method"].startswith("dflash2"):
            continue
        assert 1.0 <= row["mean_acceptance_length"] <= row["oracle_acceptance_length"]
        assert all(k >= one for k, one in zip(row["topk_recall_by_position"], row["top1_recall_by_position"]))
        assert row["draft_share"] + row["select_share"] + row["verify_share"] == pytest.approx(1.0)
        assert sum(row["acceptance_histogram"].values()) > 0


def test_report_files_are_written(report):
    folder = report[1]
    data = json.loads((folder / "results.json").read_text())
    assert data["command"] == "dflash2-hf bench (test)" and data["environment"]["torch"] and data["environment"]["cpu"]
    assert len(data["runs"]) == 3 * 2 * 8
    assert "| dflash2 greedy |" in (folder / "results.md").read_text()
    assert (folder / "speedup.png").stat().st_size > 1000 and (folder / "drafts.png").stat().st_size > 1000


def test_figures_are_also_given_per_prompt_source(report):
    data, folder = report
    counts = {(r["benchmark"], r["method"], r["temperature"]): r["runs"] for r in data["summary_by_benchmark"]}
    assert counts[("code", "plain", 0.0)] == 2 and counts[("chat", "dflash2 expected", 1.0)] == 1
    assert "| chat | 1 |" in (folder / "results.md").read_text()


def test_greedy_rows_count_the_prompts_that_give_plain_decodings_tokens(report):
    rows = {(row["method"], row["temperature"]): row for row in report[0]["summary"]}
    assert rows[("plain", 0.0)]["same_tokens_as_plain"] == 3
    assert rows[("dflash2 greedy", 0.0)]["same_tokens_as_plain"] == 3  # fp32: exact
    assert all("same_tokens_as_plain" not in row for (_, temperature), row in rows.items() if temperature > 0)
    assert "| dflash2 greedy | 0 |" in (report[1] / "results.md").read_text()


def test_a_greedy_run_with_other_tokens_than_plain_decoding_is_counted_as_such():
    tokens = {("plain", 0): [1, 2, 3], ("plain", 1): [4, 5, 6], ("other", 0): [1, 2, 3], ("other", 1): [4, 5, 7]}
    runs = [Run(method, prompt, "code", 0.0, 3, 1.0, token_ids=ids) for (method, prompt), ids in tokens.items()]
    assert {row["method"]: row["same_tokens_as_plain"] for row in summarize(runs)} == {"plain": 2, "other": 1}


def test_oracle_acceptance_on_a_hand_built_lattice():
    candidates = [[5, 6], [7, 8], [9, 10], [11, 12]]
    assert oracle_acceptance(candidates, [6, 7, 3, 11]) == 3  # positions 1-2 hit (6 in #1, 7 in #2), 3 misses
    assert oracle_acceptance(candidates, [1, 7, 9, 11]) == 1
    assert oracle_acceptance(candidates, [5, 8, 10, 12]) == 5  # a perfect pick accepts all 4 plus the target's token


def test_recall_compares_each_position_with_the_emitted_token():
    record = DraftRecord(anchor_position=2, candidate_ids=torch.tensor([[4, 5], [6, 7]]), path=[4, 6])
    recall = draft_recall([record], sequence=[0, 0, 0, 5, 6])
    assert recall == {"top1": [[False, True]], "topk": [[True, True]], "oracle": [3]}


def test_several_block_sizes_give_one_method_per_path_and_size():
    methods = standard_methods(tiny_drafter("dflash2"), paths=("argmax", "greedy"), block_sizes=[2, 8])
    sized = {m.name: m.generate_kwargs.get("dflash_block_size") for m in methods
             if m.name.startswith("dflash2") and m.name != "dflash2 default"}
    assert sized == {"dflash2 argmax b2": 2, "dflash2 argmax b8": 8, "dflash2 greedy b2": 2, "dflash2 greedy b8": 8}


def test_a_verified_block_size_caps_every_cycle():
    target, drafter = tiny_target("qwen3"), tiny_drafter("dflash2")
    method = next(m for m in standard_methods(drafter, paths=("greedy",), block_sizes=[3, 8]) if m.name.endswith("b3"))
    prompt = torch.randint(0, 90, (1, 10), generator=torch.Generator().manual_seed(0))
    run = Benchmark(target, [method], max_new_tokens=16).run([("code", prompt)], [0.0])[0]
    assert run.acceptance_lengths and max(run.acceptance_lengths) <= 3


def test_without_a_drafter_only_the_drafter_free_methods_run():
    names = [m.name for m in standard_methods(None, assistant=tiny_target("qwen3", seed=1))]
    assert names == ["plain", "prompt lookup", "assisted (draft LM)"]


def test_speedup_quartiles_stay_within_the_observed_ratios():
    from dflash2_hf.measuring.benchmark import Run, summarize

    runs = [Run("plain", i, "code", 0.0, 10, 1.0) for i in range(2)]
    runs += [Run("fast", 0, "code", 0.0, 10, 0.25), Run("fast", 1, "code", 0.0, 10, 1.0)]
    row = next(r for r in summarize(runs) if r["method"] == "fast")
    assert (row["speedup_q1"], row["speedup_median"], row["speedup_q3"]) == (1.75, 2.5, 3.25)


def test_a_report_without_drafting_methods_has_no_empty_acceptance_table(tmp_path):
    from dflash2_hf.measuring.benchmark import Run

    runs = [Run(m, i, "code", 0.0, 10, 1.0) for m in ("plain", "prompt lookup") for i in range(2)]
    write_report(runs, tmp_path, "dflash2-hf bench (test)", {})
    assert "Mean acceptance length" not in (tmp_path / "results.md").read_text()


def test_packed_linears_give_each_generate_method_a_packed_twin():
    from dflash2_hf.cpu.kernels import PackedLinears, packed_linears_supported
    from dflash2_hf.measuring.benchmark import Method, with_packed_linears

    if not packed_linears_supported():
        pytest.skip("this CPU has no oneDNN bf16 matmuls")
    target, drafter = tiny_target("qwen3").to(torch.bfloat16), tiny_drafter("dflash2").to(torch.bfloat16)

    class Peer(Method):  # decodes outside the target's generate, as the llama.cpp and reference peers do
        pass

    methods = with_packed_linears(standard_methods(drafter, paths=("greedy",)) + [Peer("peer")],
                                  PackedLinears(target, drafter))
    names = [m.name for m in methods]
    assert names[:4] == ["plain", "plain packed", "prompt lookup", "prompt lookup packed"]
    assert "peer" in names and "peer packed" not in names
    prompt = torch.randint(0, 90, (1, 10), generator=torch.Generator().manual_seed(0))
    runs = Benchmark(target, [m for m in methods if m.name.startswith("dflash2 greedy")], max_new_tokens=16).run(
        [("code", prompt)], [0.0])
    assert [r.method for r in runs] == ["dflash2 greedy", "dflash2 greedy packed"]
    assert runs[0].acceptance_lengths == runs[1].acceptance_lengths, "the same tokens, cycle by cycle"
    assert not any("forward" in vars(layer) for layer in methods[1].linears.layers), "switched off after each call"


def test_one_time_set_up_happens_in_the_warm_up_not_in_a_timed_run(target, drafter, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_HF_CACHE", str(tmp_path))
    benchmark = Benchmark(target, [Method("plain"), Method("cost-sized", {
        "assistant_model": drafter, "dflash_path": "greedy", "dflash_adaptive_block": True})], max_new_tokens=8)
    measured_after_runs = []
    measure = cycle_cost.measure_cycle_cost

    def recording_measure(*args, **kwargs):
        measured_after_runs.append(len(benchmark.runs))
        return measure(*args, **kwargs)

    monkeypatch.setattr(cycle_cost, "measure_cycle_cost", recording_measure)
    prompt = torch.randint(0, 90, (1, 10), generator=torch.Generator().manual_seed(0))
    benchmark.run([("code", prompt), ("chat", prompt + 1)], [0.0])
    assert measured_after_runs == [0], "the cost is measured once, before the first timed run"
    assert len(benchmark.runs) == 4
