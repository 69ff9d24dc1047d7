"""Shared builders of tiny random targets and drafters (built in code, seconds to create)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from pathlib import Path

import pytest
import torch

from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
from transformers.generation.utils import GenerationMixin

from dflash2_hf import DFlashConfig, DFlashDraftModel
from dflash2_hf.cost.cycle_cost import CycleCost
from dflash2_hf.cpu.kernels import exact_bf16_supported, packed_linears_supported
from dflash2_hf.drafting.block import BlockDrafter
from dflash2_hf.generation import exact_widths, integration
from dflash2_hf.measuring.exactness import randomize

FIXTURES = Path(__file__).parent / "fixtures"
PUBLISHED = FIXTURES / "published"
REFERENCE = FIXTURES / "reference"
#: How close our outputs must be to the reference's golden outputs, and those to a fresh run of the reference on
#: another CPU: float32 sums in another order (other SIMD widths, thread counts) differ by ~1e-5 on values up to ~30.
PARITY_TOLERANCE = dict(atol=1e-4, rtol=1e-4)

TINY_VOCAB, TINY_HIDDEN, TINY_TARGET_LAYERS = 96, 64, 4

TARGET_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


needs_onednn_bf16 = pytest.mark.skipif(not packed_linears_supported(),
                                       reason="this CPU has no oneDNN bf16 matmuls (AVX512-BF16 or AMX)")
# The tiny models' layers are too narrow for the blocks of an AVX512-BF16 EPYC to round differently; SmolLM2's are not.
needs_exact_bf16 = pytest.mark.skipif(not exact_bf16_supported(), reason="this CPU's bf16 matmuls round a block's "
                                      "rows differently from single rows (cpu_kernels.bf16_rows_independent)")


def tiny_target(arch: str = "qwen3", seed: int = 0, vocab_size: int = TINY_VOCAB, **overrides) -> torch.nn.Module:
    """A tiny random causal LM of a real transformers architecture (``overrides``: more config fields)."""
    fields = dict(
        vocab_size=vocab_size, hidden_size=TINY_HIDDEN, intermediate_size=128, num_hidden_layers=TINY_TARGET_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    config = TARGET_CONFIGS[arch](**fields | overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return randomize(model, seed)


def tiny_drafter_config(kind: str = "dflash2", **overrides) -> DFlashConfig:
    """A tiny drafter config for the tiny targets: ``kind`` is ``dflash`` (v1) or ``dflash2``. It drafts every cycle
    (``default_plain_fallback=False``), so what a test sees of drafting does not hang on the machine's timing; the
    fallback to plain decoding has tests of its own."""
    fields = dict(
        vocab_size=TINY_VOCAB, hidden_size=TINY_HIDDEN, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        num_target_layers=TINY_TARGET_LAYERS, target_layer_ids=[0, 2], block_size=8, mask_token_id=TINY_VOCAB - 1,
        default_plain_fallback=False,
    )
    if kind == "dflash2":
        fields |= dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    fields |= overrides
    return DFlashConfig(**fields)


def tiny_drafter(kind: str = "dflash2", seed: int = 0, **overrides) -> DFlashDraftModel:
    """A tiny drafter with every parameter random (convolutions included, so no component is the identity)."""
    config = tiny_drafter_config(kind, **overrides)
    return randomize(DFlashDraftModel.class_for_config(config)(config).eval(), seed)


def new_drafter(kind: str = "dflash2", **overrides) -> DFlashDraftModel:
    """An untrained tiny drafter as training starts one: default initialisation, seeded."""
    config = tiny_drafter_config(kind, **overrides)
    torch.manual_seed(0)
    return DFlashDraftModel.class_for_config(config)(config)


def drafted_blocks(target, drafter, prompt, monkeypatch, **options) -> tuple[list[int], list[tuple[int, torch.Tensor]]]:
    """Greedy decoding of ``prompt`` with ``drafter`` (fp32, unpacked: its features differ from one full forward's
    by rounding only): the sequence it emitted and, for every block it drafted, the anchor position and the drafter's
    hidden states of the drafted positions."""
    drafts = []
    draft = BlockDrafter.draft

    def recording_draft(self, context, anchor_id, anchor_position, length):
        lattice, hidden = draft(self, context, anchor_id, anchor_position, length)
        drafts.append((anchor_position, hidden[0].clone()))
        return lattice, hidden

    monkeypatch.setattr(BlockDrafter, "draft", recording_draft)
    output = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter,
                             dflash_packed_linears=False, dflash_plain_fallback=False, **options)
    return output[0].tolist(), drafts


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    """A tiny random Qwen3 target that decodes with :func:`drafter`, built once per test module (a module defining
    its own ``target`` fixture uses that one)."""
    return tiny_target("qwen3", seed=1)


@pytest.fixture(scope="module")
def drafter() -> DFlashDraftModel:
    """A tiny random drafter for :func:`target`, built once per test module."""
    return tiny_drafter("dflash2", seed=4)


@pytest.fixture
def public_seam_only():
    """The assistant route taken out: every GenerationMixin method as transformers defines it."""
    integration.uninstall()
    assert not any(getattr(GenerationMixin.__dict__.get(name), "__dflash2_hf__", False)
                   for name in (*integration.PATCHED_METHODS, "generate"))
    yield
    integration.install()


def steep_cost(widths: int) -> CycleCost:
    """A cost model over forwards of 1..``widths`` tokens in which each verified token costs 0.3 of a one-token
    forward: cost-sized trees and paths come out of different sizes from cycle to cycle."""
    return CycleCost(fixed_seconds=0.0, verify_seconds=tuple(1.0 + 0.3 * m for m in range(widths)))


def random_records(count: int = 8, seed: int = 0) -> list[dict]:
    """Training records of random tokens (6 prompt, 30 response tokens each), for runs that only need data."""
    generator = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(count):
        prompt = torch.randint(0, 90, (6,), generator=generator)
        response = torch.randint(0, 90, (30,), generator=generator)
        records.append({"prompt_ids": prompt.tolist(), "response_ids": response.tolist()})
    return records


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread. Bit-for-bit comparisons need a fixed reduction order (with several threads, a busy machine
    can change how CPU kernels split a sum), and thousands of tiny forward passes run faster without thread start-up."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.manual_seed(0)
    yield


MEASURED_EXACT_WIDTH = exact_widths.exact_verify_width


@pytest.fixture(scope="session", autouse=True)
def _rows_verified_alike():
    """Tests of the drafted cycle run it at every width, as on a machine whose kernels give a many-token forward's
    rows what one-token forwards give (dflash2_hf.generation.exact_widths); module fixtures included."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(exact_widths, "exact_verify_width", lambda target, widest: widest)
        yield


@pytest.fixture(autouse=True)
def _measured_widths_where_marked(request, monkeypatch):
    """Tests marked ``measured_widths`` see what this machine measures (float32 on the CPUs measured so far: no
    width, plain decoding)."""
    if "measured_widths" in request.keywords:
        monkeypatch.setattr(exact_widths, "exact_verify_width", MEASURED_EXACT_WIDTH)


def assert_plain_decodings_output(target, inputs, ours: torch.Tensor, plain: torch.Tensor) -> None:
    """The identity check of greedy output with a drafter: ``ours`` is plain decoding's output ``plain`` (both
    ``[1, prompt + new]``), or parts from it only at a near-tie of plain decoding's logits within the rounding measured
    on this machine (:mod:`dflash2_hf.measuring.greedy_difference`); a difference where the target's choice was clear
    fails, saying where and by how much."""
    from dflash2_hf.measuring.greedy_difference import compare_greedy

    prompt = (inputs if isinstance(inputs, torch.Tensor) else inputs["input_ids"]).shape[1]  # a BatchEncoding too
    difference = compare_greedy(target, inputs, ours[0, prompt:].tolist(), plain[0, prompt:].tolist())
    assert difference.explained, difference.describe()


def smollm2_tiny_target_folder(folder: Path, **overrides) -> str:
    """A tiny random Llama with SmolLM2's vocabulary, special tokens and tokenizer (``overrides``: more config
    fields), saved as a checkpoint folder the commands load like any other."""
    from dflash2_hf.presets import SMOLLM2_135M

    tokenizer = SMOLLM2_135M.load_tokenizer()
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    model = tiny_target("llama", vocab_size=len(tokenizer), **special | overrides)
    model.generation_config.update(**special)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def weightless_target(tmp_path) -> str:
    """A checkpoint folder with a config.json and no weights: a command that got as far as loading it would stop
    with transformers' OSError, so a one-line refusal from it proves the check ran before any model loaded."""
    folder = tmp_path / "target"
    tiny_target("llama").config.save_pretrained(folder)
    return str(folder)


def refusal(argv: list[str]) -> str:
    """The line `dflash2-hf ARGV` stops with: exit status 2, one line naming the command, no traceback."""
    from dflash2_hf.cli import main

    stderr = io.StringIO()
    with redirect_stderr(stderr), pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2, stopped.value.code
    assert "Traceback" not in stderr.getvalue()
    message = stderr.getvalue().strip().splitlines()[-1]
    assert message.startswith(f"dflash2-hf {argv[0]}: "), message
    return message
