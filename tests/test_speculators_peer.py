"""speculators 0.9.0 itself as the peer of its format, both ways, on tiny random models (``slow``).

speculators needs transformers <= 5.19, so it runs in a venv of its own (``$DFLASH2_HF_SPECULATORS_VENV``, else
``.venv-speculators`` at the repository root; ``.ci/run`` creates it, and these tests fail naming the commands that
create it when it is missing) through tests/speculators_worker.py. speculators builds and saves -> this package loads
-> at every block ``generate`` drafts, speculators' own block forward (on the target's hidden states taken by
speculators' layer count) gives the same hidden states, logits and selector scores; this package exports ->
speculators loads the same tensors and computes the same blocks. A layer id or an anchor off by one fails here, while
every decode-identity test stays green.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import PARITY_TOLERANCE, drafted_blocks, tiny_drafter, tiny_target
from dflash2_hf import DFlashDraftModel
from dflash2_hf.export import export_drafter

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("speculators_worker.py")
#: The commands that create the speculators venv (as .ci/run does): its own CPU torch first, what speculators 0.9.0
#: imports, then speculators itself without its requirements (torchvision and torchaudio would pull a CUDA torch).
INSTALL = ("python3 -m venv .venv-speculators && .venv-speculators/bin/pip install torch==2.13.0 && "
           ".venv-speculators/bin/pip install transformers==5.19.0 safetensors pydantic pydantic-settings "
           "'loguru>=0.7.2,<=0.7.3' huggingface-hub 'numpy>=2,<=2.5.4' 'tqdm>=4.66.3,<=4.70.1' rich typer click "
           "psutil protobuf httpx 'openai>=2' 'datasets>=4,<=5.1' aiohttp && "
           ".venv-speculators/bin/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0")
KINDS = ["dflash", "dflash2"]


@pytest.fixture(scope="module")
def speculators_python() -> str:
    venv = Path(os.environ.get("DFLASH2_HF_SPECULATORS_VENV", ROOT / ".venv-speculators"))
    python = venv / "bin" / "python"
    if not python.exists():
        pytest.fail(f"No speculators venv at {venv}: create it with\n{INSTALL}")
    return str(python)


def speculators(python: str, *args: object) -> str:
    """Run one command of the worker under speculators' venv; its stdout."""
    done = subprocess.run([python, str(WORKER), *map(str, args)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"speculators_worker {args[0]} failed:\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_target("qwen3", seed=1)


@pytest.fixture(scope="module")
def verifier(target, tmp_path_factory) -> Path:
    """The target saved for speculators (the verifier it computes hidden states with)."""
    folder = tmp_path_factory.mktemp("verifier")
    target.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=[*KINDS, "dflash, draft vocabulary"])
def speculators_saved(request, speculators_python, verifier, tmp_path_factory) -> Path:
    """A drafter built and saved by speculators for the target, reading its hidden states 1 and 3; the last drafts
    from 40 tokens (chosen by speculators' own vocabulary mapping from random counts) through a head of its own."""
    if request.param in KINDS:
        return speculators_build(speculators_python, verifier, tmp_path_factory, request.param)
    return speculators_build(speculators_python, verifier, tmp_path_factory, "dflash", "--draft-vocab-size", 40)


def speculators_build(python: str, verifier: Path, tmp_path_factory, kind: str, *options: object) -> Path:
    """A folder speculators' worker built a ``kind`` drafter into (random weights, seed 11)."""
    folder = tmp_path_factory.mktemp("speculators") / kind
    speculators(python, "build", kind, verifier, folder, "--aux-ids", 1, 3, "--seed", 11, *options)
    return folder


@pytest.fixture(scope="module", params=[*KINDS, "dflash, draft vocabulary"])
def exported(request, verifier, tmp_path_factory) -> tuple[DFlashDraftModel, Path]:
    """A drafter of this package and its ``--format speculators`` export (float32, the verifier named); the last
    drafts from every third token through a head of its own."""
    if request.param in KINDS:
        drafter = tiny_drafter(request.param, seed=12)
    else:
        drafter = tiny_drafter("dflash", seed=15, draft_vocab_size=32)
        drafter.draft_vocabulary.copy_(torch.arange(1, 96, 3))
    folder = tmp_path_factory.mktemp("ours")
    drafter.save_pretrained(folder / "drafter")
    out = export_drafter(folder / "drafter", folder / "export", layout="speculators", base_model=str(verifier),
                         dtype=torch.float32)
    return drafter, out


def speculators_blocks(python: str, folder: Path, verifier: Path, sequence: list[int], anchors: list[int],
                       tmp_path: Path) -> dict[str, torch.Tensor]:
    """speculators' own block forward at ``anchors`` of ``sequence``: hidden states, logits and selector scores."""
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"sequence": sequence, "anchors": anchors}))
    speculators(python, "forward", folder, verifier, request, tmp_path / "blocks.safetensors")
    return load_file(tmp_path / "blocks.safetensors")


def assert_same_blocks(drafter, target, drafts, sequence, blocks) -> None:
    """Every drafted block equals speculators' block at the same anchor: slot ``1 + i`` there is drafted position
    ``i`` here (slot 0 holds the anchor in both), and so are its logits and, for DFlash 2, its selector scores."""
    head = target.get_output_embeddings()
    for row, (anchor, hidden) in enumerate(drafts):
        theirs = blocks[f"hidden.{row}"][1 : 1 + hidden.shape[0]]
        torch.testing.assert_close(hidden, theirs, **PARITY_TOLERANCE, msg=lambda m, a=anchor: f"anchor {a}: {m}")
        logits = drafter.compute_logits(hidden, head)
        torch.testing.assert_close(logits, blocks[f"logits.{row}"][1 : 1 + hidden.shape[0]], **PARITY_TOLERANCE)
        if drafter.candidate_selector is not None:
            candidates = blocks[f"candidates.{row}"][1 : 1 + hidden.shape[0]]
            predecessors = torch.tensor(sequence[anchor : anchor + hidden.shape[0]])
            scores = drafter.candidate_selector.pair_scores(
                hidden[None], predecessors[None, :, None], candidates[None], logits.gather(-1, candidates)[None])
            torch.testing.assert_close(scores[0, :, 0], blocks[f"scores.{row}"][1 : 1 + hidden.shape[0]],
                                       **PARITY_TOLERANCE)


PROMPT = torch.randint(0, 90, (1, 7), generator=torch.Generator().manual_seed(3))


def test_a_drafter_speculators_saved_drafts_here_what_speculators_computes(
        speculators_saved, speculators_python, target, verifier, monkeypatch, tmp_path, one_thread):
    drafter = DFlashDraftModel.from_pretrained(speculators_saved)
    sequence, drafts = drafted_blocks(target, drafter, PROMPT, monkeypatch)
    assert len(drafts) >= 3, "decoding drafted too few blocks to compare"
    blocks = speculators_blocks(speculators_python, speculators_saved, verifier, sequence, [a for a, _ in drafts],
                                tmp_path)
    assert_same_blocks(drafter, target, drafts, sequence, blocks)


def test_greedy_decoding_with_a_drafter_speculators_saved_is_plain_generate(speculators_saved, target, one_thread):
    drafter = DFlashDraftModel.from_pretrained(speculators_saved)
    plain = target.generate(PROMPT, max_new_tokens=40, do_sample=False)
    assert torch.equal(target.generate(PROMPT, max_new_tokens=40, do_sample=False, assistant_model=drafter), plain)


def test_speculators_loads_an_export_with_the_same_weights(exported, speculators_python, tmp_path):
    drafter, folder = exported
    report = json.loads(speculators(speculators_python, "state", folder, tmp_path / "state.safetensors"))
    assert report["class"] == type(drafter).__name__
    loaded, ours = load_file(tmp_path / "state.safetensors"), in_speculators_names(drafter)
    assert set(loaded) == set(ours)
    for name, tensor in ours.items():
        assert torch.equal(loaded[name], tensor), name


def in_speculators_names(drafter: DFlashDraftModel) -> dict[str, torch.Tensor]:
    """The drafter's tensors as speculators names them: a draft vocabulary's head is ``lm_head.weight`` and its
    target ids are ``d2t`` offsets (target id = row + offset)."""
    state = dict(drafter.state_dict())
    if drafter.draft_vocabulary is not None:
        state["lm_head.weight"] = state.pop("draft_head.weight")
        ids = state.pop("draft_vocabulary")
        state["d2t"] = ids - torch.arange(ids.numel())
    return state


def test_an_export_computes_in_speculators_what_it_drafts_here(
        exported, speculators_python, target, verifier, monkeypatch, tmp_path, one_thread):
    drafter, folder = exported
    sequence, drafts = drafted_blocks(target, drafter, PROMPT, monkeypatch)
    blocks = speculators_blocks(speculators_python, folder, verifier, sequence, [a for a, _ in drafts], tmp_path)
    assert_same_blocks(drafter, target, drafts, sequence, blocks)


def test_blocks_one_position_off_are_told_apart(exported, speculators_python, target, verifier, monkeypatch,
                                                tmp_path, one_thread):
    """The negative control: the comparison fails when speculators drafts at anchors shifted by one."""
    drafter, folder = exported
    sequence, drafts = drafted_blocks(target, drafter, PROMPT, monkeypatch)
    blocks = speculators_blocks(speculators_python, folder, verifier, sequence, [a + 1 for a, _ in drafts], tmp_path)
    with pytest.raises(AssertionError):
        assert_same_blocks(drafter, target, drafts, sequence, blocks)


def test_a_draft_vocabulary_speculators_saved_loads_as_its_t2d_set(speculators_python, verifier, tmp_path_factory):
    folder = speculators_build(speculators_python, verifier, tmp_path_factory, "dflash", "--draft-vocab-size", 40)
    drafter = DFlashDraftModel.from_pretrained(folder)
    assert torch.equal(drafter.draft_vocabulary, load_file(folder / "model.safetensors")["t2d"].nonzero().flatten())


def zlab_v1_layout(folder: Path) -> None:
    """Rewrite a saved DFlash v1 drafter's config in the z-lab published layout speculators' converter reads
    (``model_type: qwen3``, ``block_size`` at the top, ``dflash_config`` holding the mask token and layer ids)."""
    config = json.loads((folder / "config.json").read_text())
    drafting = config.pop("dflash_config")
    config.pop("auto_map", None)
    config.update(model_type="qwen3", architectures=["DFlashDraftModel"], block_size=drafting["block_size"],
                  dflash_config={"mask_token_id": drafting["mask_token_id"],
                                 "target_layer_ids": drafting["target_layer_ids"]})
    (folder / "config.json").write_text(json.dumps(config))
    for code in folder.glob("*.py"):
        code.unlink()


def test_speculators_converter_counts_layers_as_the_export_does(speculators_python, verifier, tmp_path):
    drafter = tiny_drafter("dflash", seed=13)
    drafter.save_pretrained(tmp_path / "drafter")
    ours = export_drafter(tmp_path / "drafter", tmp_path / "export", layout="speculators", base_model=str(verifier))
    drafter.save_pretrained(tmp_path / "zlab")
    zlab_v1_layout(tmp_path / "zlab")
    speculators(speculators_python, "convert", tmp_path / "zlab", verifier, tmp_path / "converted")
    converted = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert converted["aux_hidden_state_layer_ids"] == json.loads((ours / "config.json").read_text())[
        "aux_hidden_state_layer_ids"]
    assert DFlashDraftModel.from_pretrained(tmp_path / "converted").target_layer_ids == drafter.target_layer_ids
