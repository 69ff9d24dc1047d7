"""The authors' reference implementation (PyPI ``dflash`` 0.1.0) as a peer of ``dflash2-hf bench``.

The fast tests need no reference venv: clear errors, and how the benchmark summarises a method that reports only
acceptance lengths. The ``slow`` tests run the real worker under the reference's venv (``$DFLASH2_HF_REFERENCE_VENV``,
else ``.venv-reference`` at the repository root; ``.ci/run`` creates it) and fail, naming the commands that create
it, when it is missing: on tiny random models built in code, then on SmolLM2-135M with the shipped drafter.
"""

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from conftest import PARITY_TOLERANCE, refusal, tiny_drafter, tiny_target
from dflash2_hf.cli import main
from dflash2_hf.measuring.benchmark import (
    Benchmark,
    Method,
    Run,
    acceptance_table,
    summarize,
    write_report,
)
from dflash2_hf.measuring.reference_peer import (
    INSTALL,
    ReferenceMethod,
    ReferencePeer,
    ReferencePeerError,
    check_reference_venv,
    sampling_settings,
)
from dflash2_hf.results_table import markdown_table

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [5, 17, 33, 2, 41, 8, 60, 12, 3, 27]


def test_a_missing_venv_fails_with_the_commands_that_create_it(tmp_path):
    with pytest.raises(ReferencePeerError, match="No Python at") as error:
        check_reference_venv(tmp_path / "absent")
    assert INSTALL in str(error.value)


def test_a_python_without_the_reference_fails_before_anything_is_started(tmp_path):
    # This test's own venv has dflash2_hf and transformers 5.24, not the reference.
    peer = ReferencePeer(sys.prefix, tmp_path, tmp_path)
    with pytest.raises(ReferencePeerError, match="cannot import the reference implementation .*No module named"):
        peer.start()
    assert peer._process is None and peer._folder is None


def test_bench_refuses_a_missing_reference_venv_before_loading_models(tmp_path):
    message = refusal(["bench", "--reference-venv", str(tmp_path / "absent"), "--out", str(tmp_path / "bench")])
    assert re.search("dflash2-hf bench: No Python at", message)
    assert not (tmp_path / "bench").exists()


def test_a_peer_that_is_not_started_refuses_requests(tmp_path):
    with pytest.raises(ReferencePeerError, match="not started"):
        ReferencePeer(tmp_path, tmp_path, tmp_path).generate(PROMPT, 4)


def test_sampling_settings_are_those_generate_applies():
    target = tiny_target()
    target.generation_config.eos_token_id = 7
    assert sampling_settings(target) == {"stop_token_ids": [7], "top_p": 1.0, "top_k": 50}
    target.generation_config.update(eos_token_id=[7, 9], top_k=20, top_p=0.9)
    assert sampling_settings(target) == {"stop_token_ids": [7, 9], "top_p": 0.9, "top_k": 20}


def test_a_method_reporting_only_acceptance_lengths_is_summarised(tmp_path):
    runs = []
    for prompt in range(2):
        runs.append(Run("plain", prompt, "code", 0.0, new_tokens=16, seconds=1.0))
        runs.append(Run("peer", prompt, "code", 0.0, new_tokens=16, seconds=0.5, acceptance_lengths=[3, 5, 7]))
    peer = [row for row in summarize(runs) if row["method"] == "peer"][0]
    assert peer["mean_acceptance_length"] == 5.0 and peer["speedup_median"] == 2.0
    assert peer["acceptance_histogram"] == {3: 2, 5: 2, 7: 2}
    assert not {"oracle_acceptance_length", "top1_recall_by_position", "select_share"} & set(peer)
    assert "| peer | 0 | 32.0 | 2.00 [2.00, 2.00] | – | – | – | 5.00 | – | – | – | – |" in markdown_table(summarize(runs))
    assert "| code | 0 | 5.00 |" in acceptance_table([{"benchmark": "code", **row} for row in summarize(runs)])
    write_report(runs, tmp_path, "test", {})
    assert (tmp_path / "drafts.png").is_file()


# --- with the reference venv ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_venv() -> Path:
    venv = Path(os.environ.get("DFLASH2_HF_REFERENCE_VENV", ROOT / ".venv-reference"))
    if not (venv / "bin" / "python").is_file():
        pytest.fail(f"The reference venv {venv} is missing; these tests need it. Create it at the repository root "
                    f"with `{INSTALL}` (or point $DFLASH2_HF_REFERENCE_VENV at one).", pytrace=False)
    return venv


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, reference_venv):
    """A tiny target and drafter saved as safetensors, and a started peer on them (one thread)."""
    folder = tmp_path_factory.mktemp("tiny")
    target, drafter = tiny_target("qwen3"), tiny_drafter("dflash2")
    target.save_pretrained(folder / "target")
    drafter.save_pretrained(folder / "drafter")
    with ReferencePeer(reference_venv, folder / "target", folder / "drafter", threads=1) as peer:
        yield target, drafter, peer


@pytest.mark.slow
def test_the_worker_answers_a_request_with_tokens_timing_and_cycles(tiny):
    _, _, peer = tiny
    assert peer.ready["drafter"] == "DFlash2DraftModel" and peer.ready["block_size"] == 8
    assert peer.versions["dflash"] == "0.1.0" and peer.versions["transformers"] == "5.15.0"
    reply = peer.generate(PROMPT, max_new_tokens=20)
    assert reply["output_ids"][: len(PROMPT)] == PROMPT and len(reply["output_ids"]) == len(PROMPT) + 20
    assert reply["seconds"] > 0
    lengths = reply["acceptance_lengths"]
    assert all(1 <= n <= 8 for n in lengths) and sum(lengths) + 1 == 20  # the prefill's token is no cycle's


@pytest.mark.slow
def test_a_failed_request_is_reported_and_the_worker_keeps_serving(tiny):
    _, _, peer = tiny
    with pytest.raises(ReferencePeerError, match="The reference implementation failed: .*temperature"):
        peer.generate(PROMPT, max_new_tokens=4, temperature=-1.0)
    assert len(peer.generate(PROMPT, max_new_tokens=4)["output_ids"]) == len(PROMPT) + 4


@pytest.mark.slow
def test_reference_greedy_output_equals_plain_greedy_decoding(tiny):
    target, _, peer = tiny
    plain = target.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False)
    assert peer.generate(PROMPT, max_new_tokens=24)["output_ids"] == plain[0].tolist()


def full_block_cycles(lengths: list[int], max_new_tokens: int, block_size: int) -> list[int]:
    """The cycles that drafted a whole block. Near the end of the token budget the reference drafts the
    ``max_length - start`` positions left (one more than it can keep) and we draft only those we can keep, so the
    drafter sees blocks of other lengths there and the last cycles may accept differently (the tokens do not)."""
    emitted, full = 1, []  # the prefill's token comes first
    for length in lengths:
        if emitted + block_size > max_new_tokens:
            break
        full.append(length)
        emitted += length
    return full


@pytest.mark.slow
@pytest.mark.parametrize("max_new_tokens", [24, 40])
def test_reference_and_our_greedy_path_accept_the_same_tokens_in_every_full_block(tiny, max_new_tokens):
    target, drafter, peer = tiny
    target.generate(torch.tensor([PROMPT]), max_new_tokens=max_new_tokens, do_sample=False, assistant_model=drafter,
                    dflash_path="greedy")
    ours = list(drafter.last_generation_stats.acceptance_lengths)
    theirs = peer.generate(PROMPT, max_new_tokens=max_new_tokens)["acceptance_lengths"]
    full = full_block_cycles(ours, max_new_tokens, block_size=8)
    assert len(full) >= 10 and theirs[: len(full)] == full


@pytest.mark.slow
def test_sampling_is_reproducible_by_seed(tiny):
    _, _, peer = tiny
    first, again, other = (peer.generate(PROMPT, 16, temperature=1.0, seed=s)["output_ids"] for s in (3, 3, 4))
    assert first == again and first != other


@pytest.mark.slow
def test_benchmark_interleaves_the_reference_with_in_process_methods(tiny, tmp_path):
    target, drafter, peer = tiny
    methods = [Method("plain"), Method("dflash2 greedy", {"assistant_model": drafter, "dflash_path": "greedy",
                                                          "dflash_record_drafts": True}), ReferenceMethod(peer)]
    prompts = [("code", torch.tensor([PROMPT])), ("chat", torch.tensor([PROMPT[::-1]]))]
    runs = Benchmark(target, methods, max_new_tokens=12).run(prompts, [0.0, 1.0])
    assert [r.method for r in runs[:3]] == ["plain", "dflash2 greedy", "reference dflash"]
    assert [r.method for r in runs[6:9]] == ["dflash2 greedy", "reference dflash", "plain"]  # rotated per prompt
    reference = [r for r in runs if r.method == "reference dflash"]
    assert len(reference) == 4 and all(r.new_tokens == 12 and sum(r.acceptance_lengths) == 11 for r in reference)
    report = write_report(runs, tmp_path, "test", {})
    rows = {(row["method"], row["temperature"]): row for row in report["summary"]}
    greedy = {(r.prompt, r.method): r.acceptance_lengths for r in runs if r.temperature == 0}
    for p in range(2):
        full = full_block_cycles(greedy[(p, "dflash2 greedy")], 12, block_size=8)
        assert greedy[(p, "reference dflash")][: len(full)] == full
    sampled = rows[("reference dflash", 1.0)]
    assert sampled["runs"] == 2 and sampled["mean_acceptance_length"] >= 1 and "select_share" not in sampled
    assert "| reference dflash | 1 |" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
def test_a_dflash_v1_drafter_is_refused_before_the_worker_starts(reference_venv, tmp_path):
    tiny_drafter("dflash").save_pretrained(tmp_path / "v1")
    peer = ReferencePeer(reference_venv, tmp_path, tmp_path / "v1")
    with pytest.raises(ReferencePeerError, match="cannot load this drafter: .*needs a DFlash 2 drafter"):
        peer.start()
    assert peer._process is None and peer._folder is None


@pytest.mark.slow
def test_a_worker_that_cannot_load_the_target_reports_why(reference_venv, tmp_path):
    tiny_drafter("dflash2").save_pretrained(tmp_path / "drafter")
    peer = ReferencePeer(reference_venv, tmp_path / "no-target", tmp_path / "drafter")
    with pytest.raises(ReferencePeerError, match="The reference implementation failed: .*no-target"):
        peer.start()
    assert peer._process is None and peer._folder is None


# --- SmolLM2-135M with the shipped drafter -------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_bench_runs_the_reference_as_a_peer(reference_venv, tmp_path):
    main(["bench", "--prompts", "humaneval", "mtbench", "--per-source", "1", "--temperatures", "0",
          "--max-new-tokens", "16", "--paths", "greedy", "--dtype", "float32", "--threads", "1",
          "--reference-venv", str(reference_venv), "--out", str(tmp_path)])
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["settings"]["reference"]["dflash"] == "0.1.0"
    methods = {row["method"]: row for row in report["summary"]}
    assert methods["reference dflash"]["runs"] == 2 and methods["reference dflash"]["mean_acceptance_length"] >= 1


@pytest.mark.slow
def test_smollm2_reference_greedy_tokens_equal_plain_greedy_in_fp32(reference_venv):
    """Our shipped drafter, exported to the published layout and decoded by the reference on the same GGUF
    checkpoint, gives plain decoding's tokens, as our greedy path does (the two prompts bench takes first)."""
    from dflash2_hf import DFlashDraftModel
    from dflash2_hf.measuring.evaluation import benchmark_prompts
    from dflash2_hf.presets import SHIPPED_DRAFTERS, checkpoint_location, load_target

    target, tokenizer = load_target("smollm2-135m", dtype=torch.float32)
    drafter_folder = SHIPPED_DRAFTERS["smollm2-135m"]
    drafter = DFlashDraftModel.from_pretrained(drafter_folder, dtype=torch.float32).eval()
    folder, gguf_file = checkpoint_location("smollm2-135m")
    with ReferencePeer(reference_venv, folder, drafter_folder, gguf_file=gguf_file, threads=1) as peer:
        for _, inputs in benchmark_prompts(tokenizer, ["humaneval", "mtbench"], 1):
            plain = target.generate(inputs, max_new_tokens=16, do_sample=False)
            ours = target.generate(inputs, max_new_tokens=16, do_sample=False, assistant_model=drafter,
                                   dflash_path="greedy")
            reply = peer.generate(inputs[0].tolist(), 16, **sampling_settings(target))
            assert reply["output_ids"] == plain[0].tolist() == ours[0].tolist()


@pytest.mark.slow
def test_the_committed_parity_fixtures_are_what_the_reference_writes(reference_venv, tmp_path):
    """docs/drafter.md's fixture command, run again: the files the parity tests read are the reference's own output."""
    import subprocess

    from safetensors.torch import load_file

    subprocess.run([str(reference_venv / "bin" / "python"), str(ROOT / "scripts" / "make_reference_fixtures.py"),
                    str(tmp_path)], check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    committed = ROOT / "tests" / "fixtures" / "reference"
    names = sorted(str(p.relative_to(committed)) for p in committed.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    for name in names:
        if name.endswith(".safetensors"):
            ours, fresh = load_file(committed / name), load_file(tmp_path / name)
            assert ours.keys() == fresh.keys(), name
            # Weights (seeded) and token ids exactly; computed outputs to the tolerance the parity tests compare at
            computed = name == "golden.safetensors"
            for key in ours:
                tolerance = PARITY_TOLERANCE if computed and ours[key].is_floating_point() else {"atol": 0, "rtol": 0}
                torch.testing.assert_close(fresh[key], ours[key], **tolerance, msg=f"{name}: {key}")
        else:
            assert json.loads((committed / name).read_text()) == json.loads((tmp_path / name).read_text()), name
