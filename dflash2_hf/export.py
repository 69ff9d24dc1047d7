"""A Hub-ready copy of a drafter folder (``dflash2-hf export DRAFTER OUT``).

The exported folder holds

* ``model.safetensors`` (bf16 unless asked otherwise), ``config.json`` and the remote code, all written by the
  drafter's own ``save_pretrained``: the classes are registered for the Auto classes, so transformers copies
  ``configuration_dflash.py`` / ``modeling_dflash.py`` next to the weights and points ``auto_map`` at them;
* ``generation_config.json`` with the path strategy and block size ``generate`` uses when a call does not choose
  (``dflash_path``, ``dflash_block_size``). ``generate`` reads its defaults from the drafter config, not from this
  file, so a chosen path is also stored as the config's ``default_path_strategy`` and both files are derived from
  the same resolved :class:`~dflash2_hf.generation.config.DraftOptions`;
* ``custom_generate/generate.py`` and ``custom_generate/requirements.txt``, so that transformers' own remote-code
  generation runs DFlash 2 decoding with this drafter: ``target.generate(**inputs, custom_generate="<folder or repo
  id>", trust_remote_code=True)`` (:mod:`dflash2_hf.generation.exported`; the requirements name this package);
* ``README.md``, a model card: YAML metadata, usage, the training record (``training.json`` next to the drafter) and
  the measurements of a ``dflash2-hf bench`` report when one is given. Nothing is filled in that was not recorded.

With ``layout="published"`` (or ``"speculators"``) the config follows the published DFlash 2 checkpoints (or
speculators' format, what vLLM serves) instead, without remote code (:mod:`dflash2_hf.export_layouts`).

With ``draft_vocabulary`` (``--draft-vocab-size N --vocab-data DIR``), the exported drafter drafts from those target
tokens only, through a head of its own (:mod:`dflash2_hf.training.draft_vocabulary`): cheaper drafts, the same exact
verification.

Every check runs before anything is written, and the folder is assembled next to ``OUT`` and moved into place at
the end, so a failed export leaves nothing behind and ``overwrite`` replaces a folder only with a complete one.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from huggingface_hub import ModelCardData
from transformers import GenerationConfig

from . import __version__
from .export_layouts import (
    LAYOUTS,
    ExportError,
    check_publishable,
    check_speculators_expressible,
    verifier_entry,
    with_materialised_codebooks,
    write_published_config,
    write_speculators_config,
)
from .drafting.options import DraftOptions, with_recommended_plan
from .results_table import markdown_table
from .modeling import DFlashConfig, DFlashDraftModel
from .training.checkpoint import check_writable_folder
from .training.draft_vocabulary import with_draft_vocabulary, with_the_target_head

CARD_TAGS = ["speculative-decoding", "dflash", "dflash2"]

NO_MEASUREMENTS = (
    "No measurements are attached to this export: acceptance length and speedup have not been measured for it. "
    "Measure them with `dflash2-hf bench --drafter FOLDER` and export again with `--results BENCH/results.json`."
)

#: ``custom_generate/generate.py`` of an export: transformers loads it and calls its ``generate``.
CUSTOM_GENERATE_SCRIPT = '''"""DFlash 2 decoding with the drafter of this folder or Hub repo, through transformers' remote-code generation:

    out = target.generate(**inputs, custom_generate="<this folder or repo id>", trust_remote_code=True)

Written by `dflash2-hf export`; the decoding is the dflash2-hf package's (see requirements.txt next to this file).
"""

from dflash2_hf.generation.exported import generate  # noqa: F401  (the function transformers calls)
'''


def describe_drafter(folder: str) -> dict:
    """Summarise a drafter folder: its kind, shape and drafting settings, read without loading the weights."""
    return describe_config(DFlashConfig.from_pretrained(folder))


def describe_config(config: DFlashConfig) -> dict:
    """Summarise the drafter a config describes: kind, shape, drafting settings and parameter counts (counted on a
    meta-device model, so nothing is allocated). ``selector`` is ``codebooks`` (two ``[vocab, rank]`` tables, as
    published), ``factorised`` (projections of the target's input embeddings) or ``None``."""
    with torch.device("meta"):
        model = DFlashDraftModel.class_for_config(config)(config)
    selector = model.candidate_selector
    return {
        "kind": "DFlash 2" if config.is_dflash2 else "DFlash v1",
        "class": type(model).__name__,
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "parameters": sum(p.numel() for p in model.parameters()),
        "selector": None if selector is None else "factorised" if selector.factorised else "codebooks",
        "selector_parameters": sum(p.numel() for p in selector.parameters()) if selector is not None else 0,
        "selector_top_k": config.selector_top_k if selector is not None else None,
        "draft_vocab_size": config.draft_vocab_size,
    }


def check_destination(out: Path, drafter_folder: Path, overwrite: bool) -> None:
    """Refuse an output folder that cannot be written (a file, a path under a file, a place where no folder can be
    made: :func:`~dflash2_hf.training.checkpoint.check_writable_folder`) or that holds anything (unless ``overwrite``), and
    never replace the source itself, nor the current folder or one above it (a folder the process stands in cannot be
    swapped for the finished export)."""
    try:
        check_writable_folder(out)
    except ValueError as error:
        raise ExportError(str(error)) from None
    here = Path.cwd().resolve()
    if out.resolve() == here or out.resolve() in here.parents:
        raise ExportError(f"{out} is the current folder or holds it, which the finished export cannot replace; name a "
                          "new folder beside it (e.g. ../my-drafter-hub) or run the command from elsewhere.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} exists and is not empty; choose a new folder or pass --overwrite to replace it.")
    source = drafter_folder.resolve()
    if overwrite and (source == out.resolve() or out.resolve() in source.parents):
        raise ExportError(f"{out} holds the drafter being exported; --overwrite would delete it.")


def load_drafter(folder: Path, dtype: torch.dtype) -> DFlashDraftModel:
    """The drafter saved in ``folder``, cast to ``dtype``; refuses a folder that holds no loadable drafter."""
    if not (folder / "config.json").is_file():
        raise ExportError(f"{folder} is not a drafter folder: it has no config.json.")
    try:
        return DFlashDraftModel.from_pretrained(folder, dtype=dtype).eval()
    except (OSError, ValueError) as error:
        raise ExportError(f"{folder} is not a drafter folder: {error}") from None


def cut_to_vocabulary(drafter: DFlashDraftModel, target: torch.nn.Module | None, token_ids: torch.Tensor,
                      layout: str = "package") -> DFlashDraftModel:
    """The drafter drafting from ``token_ids`` through rows of ``target``'s LM head, for an export in ``layout``;
    refused without a target that fits the drafter, and where the layout cannot store the cut."""
    check_cut_fits_layout(drafter, layout)
    if target is None:
        raise ExportError("a draft vocabulary copies rows of the target's LM head: name the target (--target).")
    try:
        drafter.config.check_fits_target(target.config, target.get_output_embeddings().weight.shape[0])
        return with_draft_vocabulary(drafter, target.get_output_embeddings().weight, token_ids)
    except ValueError as error:
        raise ExportError(f"cannot give this drafter a draft vocabulary: {error}") from None


def recommended_options(drafter: DFlashDraftModel, path: str | None) -> DraftOptions:
    """Make ``path`` (when given) the drafter's default path strategy, and resolve the options ``generate`` will use
    when a call sets none, exactly as ``generate`` resolves them."""
    if path is not None:
        drafter.config.default_path_strategy = path
    with_recommended_plan(drafter.config)  # a drafter with no plan of its own decodes with the measured one
    try:
        return DraftOptions.for_drafter(drafter)
    except ValueError as error:
        raise ExportError(str(error)) from None


def read_training_record(folder: Path) -> dict | None:
    """The ``training.json`` that ``dflash2-hf train`` writes next to an exported drafter, if there is one; one that
    is not a JSON object (cut short, edited, another file) is an :class:`ExportError` naming it."""
    path = Path(folder) / "training.json"
    if not path.is_file():
        return None
    record = _read_json(path, "training.json")
    if not isinstance(record, dict):
        raise ExportError(f"{path} is not a training record (a JSON object written by `dflash2-hf train`); move it "
                          "away to export without one.")
    return record


def _read_json(path: Path, what: str) -> object:
    """A JSON file's content, or an :class:`ExportError` naming the file when it is not UTF-8 JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ExportError(f"{path} is not the JSON {what} should be ({error}).") from None


def _format(value: object) -> str:
    """A recorded value for the card: floats to four significant digits, everything else as written."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def training_section(record: dict | None) -> str:
    """How the drafter was trained, in the words of its training record only."""
    if record is None:
        return "No training record (`training.json`) was found next to the drafter; how it was trained is not recorded."
    lines = [f"* Target: `{record['target']}`" if "target" in record else "* Target: not recorded in `training.json`.",
             f"* Data: {record['data']}" if "data" in record else "* Data: not recorded in `training.json`."]
    if "budget" in record:
        lines.append("* Budget: " + ", ".join(f"{name} {_format(value)}" for name, value in record["budget"].items()))
    # output_dir is a path on the training machine, meaningless to a reader of the card.
    settings = {name: value for name, value in record.get("config", {}).items() if name != "output_dir"}
    if settings:
        lines.append("* Settings: " + ", ".join(f"`{name}={_format(value)}`" for name, value in settings.items()))
    if "draft_vocabulary" in record:
        lines.append(f"* Draft vocabulary: {record['draft_vocabulary']}")
    earlier = record.get("started_from")
    if earlier:  # a continued run: the earlier stages' own records, oldest last
        lines.append("* Continued from a drafter trained earlier:")
        while earlier:
            budget = ", ".join(f"{name} {_format(value)}" for name, value in earlier.get("budget", {}).items())
            lines.append(f"  * {earlier.get('data', 'data not recorded')}" + (f"; budget: {budget}" if budget else ""))
            earlier = earlier.get("started_from")
    return "Recorded in `training.json` by `dflash2-hf train`:\n\n" + "\n".join(lines)


def measurements_section(results: Path | None) -> str:
    """The acceptance / speedup table of a ``dflash2-hf bench`` report (``results.json`` or ``results.md``)."""
    if results is None:
        return NO_MEASUREMENTS
    if not results.is_file():
        raise ExportError(f"Results file {results} not found.")
    if results.suffix == ".md":
        try:
            return results.read_text(encoding="utf-8").strip()
        except UnicodeDecodeError:
            raise ExportError(f"{results} is not text; pass the results.md `dflash2-hf bench` wrote.") from None
    if results.suffix != ".json":
        raise ExportError(f"--results takes the results.json or results.md of `dflash2-hf bench`, not {results.name}.")
    report = _read_json(results, "a results.json of `dflash2-hf bench`")
    if not isinstance(report, dict) or not isinstance(report.get("summary"), list):
        raise ExportError(f"{results} has no `summary`; it is not a results.json written by `dflash2-hf bench`.")
    parts = [f"Command: `{report['command']}`"] if "command" in report else []
    if report.get("settings"):
        parts.append("Settings: " + ", ".join(f"{name} {_format(value)}" for name, value in report["settings"].items()))
    parts.append(markdown_table(report["summary"]))
    return "\n\n".join(parts)


def card_metadata(base_model: str | None, license_id: str) -> str:
    """The card's YAML front matter (``base_model`` only when it is known)."""
    data = ModelCardData(base_model=base_model, library_name="transformers", license=license_id, tags=CARD_TAGS)
    return f"---\n{data.to_yaml()}\n---\n"


def model_card(name: str, drafter: DFlashDraftModel, options: DraftOptions, base_model: str | None, license_id: str,
               training: str, measurements: str, layout: str = "package") -> str:
    """README.md for the exported folder ``name`` holding ``drafter`` in ``layout``: metadata, summary, usage,
    training and measurements."""
    info = describe_config(drafter.config)
    factorised = ", factorised over the target's input embeddings" if info["selector"] == "factorised" else ""
    target = f"`{base_model}`" if base_model else "its target model (not recorded)"
    vocabulary = (f"; it drafts from {info['draft_vocab_size']:,} of the target's tokens, through a head of its own "
                  "(the target verifies against its whole vocabulary)" if info["draft_vocab_size"] else "")
    loading = layout_note(name, layout, base_model, options.block_size - 1)
    return f"""{card_metadata(base_model, license_id)}
# {name}

A {info["kind"]} block drafter for speculative decoding of {target} with the `dflash2-hf` package.
{info["layers"]} layers, hidden size {info["hidden_size"]}, blocks of {info["block_size"]} tokens, reading target
layers {info["target_layer_ids"]}; {info["parameters"]:,} parameters ({info["selector_parameters"]:,} in the
candidate selector{factorised}){vocabulary}. Greedy output is identical to the target's own; sampled output has the
target's distribution.

## Usage

```python
out = target.generate(**inputs, custom_generate="{name}", trust_remote_code=True, max_new_tokens=256)
```

`target` is {target} loaded with `AutoModelForCausalLM`; `"{name}"` is this folder or its Hub repo id.
transformers runs `custom_generate/generate.py` of this folder, which decodes with this drafter through the
`dflash2-hf` package (`pip install dflash2-hf`; transformers names it when it is missing). With the package
imported, the drafter also works as an assistant model:

```python
import dflash2_hf
drafter = dflash2_hf.DFlashDraftModel.from_pretrained("{name}")
out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256)
```

By default `generate` drafts blocks of
{options.block_size} tokens and picks the `{options.path.value}` path through the candidate lattice
(`generation_config.json`); pass `dflash_block_size=` or `dflash_path=` to `generate` to choose per call.
{loading}

## Training

{training}

## Measurements

{measurements}
"""


def layout_note(name: str, layout: str, base_model: str | None, drafted_tokens: int) -> str:
    """The model card's paragraph on what reads the folder's layout (for speculators': how vLLM serves it, drafting
    ``drafted_tokens`` per block)."""
    if layout == "published":
        return "The config and weights follow the published DFlash 2 layout (`model_type: qwen3`, no remote code)."
    if layout == "speculators":
        verifier = f"`{base_model}`" if base_model else "the target (not recorded: name it on the command line)"
        return f"""The config and weights follow speculators' format (`speculators_model_type`, no remote code), which
vLLM serves; the verifier named in `config.json` is {verifier}:

```bash
vllm serve {name}
```

or, naming the target first: `vllm serve TARGET --speculative-config '{{"model": "{name}", "num_speculative_tokens":
{drafted_tokens}}}'`. speculators' `from_pretrained` loads it too."""
    return ("`AutoModel.from_pretrained(..., trust_remote_code=True)` also loads the drafter from the code in this "
            "folder, without the package; decoding with it needs `dflash2_hf`.")


def write_folder(
    folder: Path, drafter: DFlashDraftModel, options: DraftOptions, card: str, layout: str = "package",
    verifier: dict | None = None,
) -> None:
    """Weights, config and remote code (``save_pretrained``), generation config and model card into ``folder``, the
    config rewritten in ``layout`` (``verifier``: speculators' entry naming the target)."""
    drafter.save_pretrained(folder)
    if layout == "published":
        write_published_config(folder)
    elif layout == "speculators":
        write_speculators_config(folder, verifier)
    GenerationConfig(dflash_path=options.path.value, dflash_block_size=options.block_size).save_pretrained(folder)
    write_custom_generate(folder / "custom_generate")
    (folder / "README.md").write_text(card)


def write_custom_generate(folder: Path) -> None:
    """The ``custom_generate`` folder transformers loads for ``generate(custom_generate=<export>)``."""
    folder.mkdir()
    (folder / "generate.py").write_text(CUSTOM_GENERATE_SCRIPT)
    (folder / "requirements.txt").write_text(f"dflash2-hf>={__version__}\n")


def move_into_place(staging: Path, out: Path) -> None:
    """Replace ``out`` (absent, empty, or checked to be overwritable) with the finished ``staging`` folder: the old
    folder is moved aside, the new one moved in, and only then is the old one deleted, so a stop at any moment
    leaves a whole folder at ``out`` or beside it, never neither."""
    staging.chmod(0o755)  # mkdtemp makes it private to the user
    if not out.exists():
        staging.rename(out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}-replaced-", dir=out.parent)) / out.name
    out.rename(aside)
    try:
        staging.rename(out)
    except OSError:
        aside.rename(out)  # put the old folder back
        aside.parent.rmdir()
        raise
    shutil.rmtree(aside.parent)


def check_cut_fits_layout(drafter: DFlashDraftModel, layout: str) -> None:
    """Refuse cutting a DFlash 2 drafter to a draft vocabulary for a layout that keeps DFlash 2 drafters whole
    (speculators' and the published one), with advice that works: the same export without the cut, or the cut in
    the package's layout."""
    if layout != "package" and drafter.config.is_dflash2:
        raise ExportError(f"the {layout} layout has no draft vocabulary for a DFlash 2 drafter; drop --draft-vocab-size "
                          "and --vocab-data to export it with the target's whole head, or drop --format to cut it in "
                          "this package's layout.")


def chosen_layout(layout: str, published_layout: bool) -> str:
    """The layout an export writes: ``layout``, or ``published`` for the 0.1 flag; refuses an unknown name or the
    flag beside another layout."""
    if layout not in LAYOUTS:
        raise ExportError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}.")
    if published_layout and layout not in ("package", "published"):
        raise ExportError(f"--published-layout asks for the published layout; --format {layout} for another: give one.")
    return "published" if published_layout else layout


def in_layout(drafter: DFlashDraftModel, layout: str, target: torch.nn.Module | None) -> DFlashDraftModel:
    """The drafter as ``layout`` stores it (a factorised selector materialised as codebooks), refused when the
    layout cannot describe it."""
    if layout == "package":
        return drafter
    drafter = with_materialised_codebooks(drafter, target, layout)
    if layout == "published":
        check_publishable(drafter.config)
    else:
        check_speculators_expressible(drafter.config)
    return drafter


def export_drafter(
    drafter_folder: str | Path,
    out: str | Path,
    *,
    base_model: str | None = None,
    license_id: str = "apache-2.0",
    results: str | Path | None = None,
    path: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "package",
    published_layout: bool = False,
    target: torch.nn.Module | None = None,
    overwrite: bool = False,
    draft_vocabulary: torch.Tensor | None = None,
    whole_head: bool = False,
) -> Path:
    """Write a Hub-ready copy of the drafter in ``drafter_folder`` to ``out`` (see the module docstring).

    Args:
        base_model: Hub id of the target model for the card (default: the ``target`` recorded in training.json).
        license_id: the card's license identifier.
        results: ``results.json`` or ``results.md`` of ``dflash2-hf bench`` for the card's measurements.
        path: path strategy to make ``generate``'s default (default: the drafter's own default).
        dtype: dtype of the exported weights.
        layout: ``package`` (this package's config and remote code), ``published`` (the published DFlash 2 layout)
            or ``speculators`` (speculators' format, which vLLM serves); the last two carry no remote code.
        published_layout: the same as ``layout="published"`` (kept from 0.1).
        target: the target model the drafter drafts for; needed only to export a factorised selector in the
            published or speculators layout (its codebooks are computed from the target's input embeddings), and
            read for the target's architectures in speculators' ``verifier`` entry.
        overwrite: replace ``out`` when it exists and is not empty.
        draft_vocabulary: target ids to draft from, through a head of the drafter's own (rows of ``target``'s head).
        whole_head: a drafter with a draft vocabulary is exported reading the target's whole head instead.

    Raises:
        ExportError: before anything is written, when the export cannot be done as asked.
    """
    drafter_folder, out = Path(drafter_folder), Path(out)
    layout = chosen_layout(layout, published_layout)
    check_destination(out, drafter_folder, overwrite)
    drafter = load_drafter(drafter_folder, dtype)
    if whole_head:
        drafter = with_the_target_head(drafter)
    if draft_vocabulary is not None:
        drafter = cut_to_vocabulary(drafter, target, draft_vocabulary, layout)
    options = recommended_options(drafter, path)
    drafter = in_layout(drafter, layout, target)
    record = read_training_record(drafter_folder)
    base_model = base_model or (record or {}).get("target")
    measurements = measurements_section(Path(results) if results is not None else None)
    card = model_card(out.name, drafter, options, base_model, license_id, training_section(record), measurements,
                      layout)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write_folder(staging, drafter, options, card, layout, verifier_entry(base_model, target))
        move_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
