"""The folder layouts ``dflash2-hf export`` writes besides this package's own, and what each can describe.

* ``published``: the published DFlash 2 checkpoints' config (``model_type: qwen3``, only the published
  ``dflash_config`` fields, no ``auto_map`` and no remote code). Tensor names need no change: the drafter already uses
  the published names.
* ``speculators``: speculators' ``dflash`` / ``dflash2`` config (what vLLM serves; mapped by
  ``modeling.speculators_format``), the same tensor names, no remote code.

Neither has a form of its own for a factorised selector, so its codebooks are materialised from the target's input
embeddings (``P = E @ A``, ``S = E @ B``): such an export needs the target.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .modeling import DFLASH_FIELDS, DFlashConfig, DFlashDraftModel
from .modeling.speculators_format import speculators_config, unexpressible_fields

#: The layouts an export writes: this package's (remote code, every field), the published DFlash 2 one, speculators'.
LAYOUTS = ("package", "published", "speculators")

#: ``model_type`` and ``dflash_config`` fields of the published DFlash 2 configs.
PUBLISHED_MODEL_TYPE = "qwen3"
PUBLISHED_DFLASH2_FIELDS = (
    "block_size",
    "conv_group_size",
    "conv_kernel_size",
    "final_logit_softcapping",
    "mask_token_id",
    "output_multiplier",
    "selector_rank",
    "selector_top_k",
    "target_layer_ids",
)

#: Drafting fields speculators' format states (the others are checked by ``unexpressible_fields``).
SPECULATORS_DRAFTING_FIELDS = ("block_size", "mask_token_id", "target_layer_ids", "conv_kernel_size",
                               "conv_group_size", "selector_rank", "selector_top_k", "selector_factorised",
                               "output_multiplier", "final_logit_softcapping", "input_embedding_scale",
                               "draft_vocab_size")


class ExportError(ValueError):
    """An export was refused before anything was written; the message says why."""


def with_materialised_codebooks(drafter: DFlashDraftModel, target: torch.nn.Module | None,
                                layout: str = "published") -> DFlashDraftModel:
    """The drafter with a full-codebook selector that scores exactly as its factorised one does for ``target``.

    The codebooks are ``E @ A`` and ``E @ B`` (``CandidateSelector.codebooks``, computed in float32 from the target's
    input embedding matrix ``E``) in the drafter's dtype; every other weight is kept. A drafter without a factorised
    selector is returned unchanged.
    """
    selector = drafter.candidate_selector
    if selector is None or not selector.factorised:
        return drafter
    if target is None:
        raise ExportError(f"This drafter's candidate selector is factorised: the {layout} layout stores full codebooks "
                          "computed from the target's input embeddings; pass the target (--target).")
    try:
        drafter.config.check_fits_target(target.config, target.get_output_embeddings().weight.shape[0])
    except ValueError as error:
        raise ExportError(str(error)) from None
    table = target.get_input_embeddings().weight.detach()
    if table.shape[0] != drafter.config.vocab_size:
        raise ExportError(f"The target's input embeddings have {table.shape[0]} rows; the drafter's vocabulary is "
                          f"{drafter.config.vocab_size}.")
    config = copy.deepcopy(drafter.config)
    config.selector_factorised = False
    full = DFlashDraftModel.class_for_config(config)(config).to(drafter.dtype).eval()
    weights = {name: tensor for name, tensor in drafter.state_dict().items()
               if not name.startswith(("candidate_selector.predecessor_", "candidate_selector.successor_"))}
    with torch.no_grad():
        predecessors, successors = selector.codebooks(table)
    weights["candidate_selector.predecessor_codebook"] = predecessors
    weights["candidate_selector.successor_codebook"] = successors
    full.load_state_dict(weights, strict=True)
    return full


def settings_without_place(config: DFlashConfig, kept: tuple[str, ...]) -> str:
    """The drafting fields outside ``kept`` set to anything but the value a loader assumes when they are absent, as
    ``name=value`` text (empty when there are none)."""
    return ", ".join(f"{name}={getattr(config, name)!r}" for name in DFLASH_FIELDS
                     if name not in kept and getattr(config, name) != getattr(DFlashConfig, name))


def check_publishable(config: DFlashConfig) -> None:
    """Refuse a drafter the published DFlash 2 layout cannot describe: a v1 drafter, or drafting fields the published
    ``dflash_config`` has no place for set to anything but the value a loader assumes when they are absent."""
    if not config.is_dflash2:
        raise ExportError("The published DFlash 2 layout needs a DFlash 2 drafter; this one is DFlash v1.")
    unsupported = settings_without_place(config, PUBLISHED_DFLASH2_FIELDS)
    if unsupported:
        whole_head = (" Or export it with --whole-head: the target's whole head again, without the draft vocabulary."
                      if config.draft_vocab_size else "")
        raise ExportError(f"The published DFlash 2 layout has no field for {unsupported}; export without "
                          "--format published (and without --path) to keep it." + whole_head)


def write_published_config(folder: Path) -> None:
    """Rewrite a saved folder's config in the published DFlash 2 layout and drop the remote code it no longer maps."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.pop("auto_map", None)
    config["model_type"] = PUBLISHED_MODEL_TYPE
    config["dflash_config"] = {k: v for k, v in config["dflash_config"].items() if k in PUBLISHED_DFLASH2_FIELDS}
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for code in folder.glob("*.py"):
        code.unlink()


def check_speculators_expressible(config: DFlashConfig) -> None:
    """Refuse a drafter whose settings speculators' format cannot state (speculators and vLLM would run another
    drafter from the folder), naming each."""
    problems = unexpressible_fields(config)
    unsupported = settings_without_place(config, SPECULATORS_DRAFTING_FIELDS)
    if unsupported:
        problems.append(f"no field for {unsupported} (export without --path, or in the package layout, to keep it)")
    if problems:
        raise ExportError("speculators' format cannot describe this drafter: " + "; ".join(problems) + ".")


def verifier_entry(base_model: str | None, target: torch.nn.Module | None) -> dict | None:
    """speculators' ``verifier`` entry (the target's Hub id or folder and architectures), or ``None`` when no target
    is known: vLLM then needs the target named on its command line."""
    if base_model is None:
        return None
    if target is None:
        return {"name_or_path": base_model, "architectures": []}
    architectures = list(getattr(target.config, "architectures", None) or [type(target).__name__])
    return {"name_or_path": base_model, "architectures": architectures}


def write_speculators_config(folder: Path, verifier: dict | None) -> None:
    """Rewrite a saved folder's config in speculators' format and drop the remote code it no longer maps; a draft
    vocabulary's tensors are renamed as speculators stores them."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(speculators_config(config, verifier), indent=2, sort_keys=True) + "\n")
    for code in folder.glob("*.py"):
        code.unlink()
    if config["dflash_config"].get("draft_vocab_size") is not None:
        write_speculators_vocabulary(folder / "model.safetensors", config["vocab_size"])


def write_speculators_vocabulary(weights: Path, vocab_size: int) -> None:
    """Store a saved drafter's draft vocabulary as speculators does: its head as ``lm_head.weight``, each draft
    token's offset to its target id as ``d2t`` (target id = row + offset), and the same set as the ``t2d`` mask
    over the target's vocabulary. speculators draws its draft tokens in rising id order, so rows follow it."""
    tensors = load_file(weights)
    token_ids = tensors.pop("draft_vocabulary")
    order = token_ids.argsort()
    head = tensors.pop("draft_head.weight")[order]
    token_ids = token_ids[order]
    in_draft = torch.zeros(vocab_size, dtype=torch.bool)
    in_draft[token_ids] = True
    tensors.update({"lm_head.weight": head.contiguous(), "d2t": token_ids - torch.arange(token_ids.numel()),
                    "t2d": in_draft})
    save_file(tensors, weights, metadata={"format": "pt"})
