"""speculators' DFlash / DFlash 2 checkpoint format (what vLLM serves): read into this package's config, and
written out of it.

A speculators drafter folder holds a ``config.json`` with ``speculators_model_type`` ("dflash" or "dflash2"), the
draft transformer's shape under ``transformer_layer_config``, the drafting fields at the top level and a
``speculators_config`` naming the verifier; its tensors carry the same names as this package's (both follow the
z-lab reference), plus tensors the verifier owns. The fields map by meaning, not by name:

* ``aux_hidden_state_layer_ids`` count the verifier's hidden states from the embedding output (id ``k`` is the
  output of decoder layer ``k - 1``, what vLLM captures before layer ``k`` runs); ``target_layer_ids`` here count
  decoder layers (id ``i`` reads ``hidden_states[i + 1]``), so ``target_layer_ids = aux ids - 1``.
* ``sample_from_anchor: false`` is this package's convention: the anchor sits in slot 0 and slot ``i`` predicts the
  token ``i`` places after it. ``true`` (slot ``i`` predicts ``i + 1`` places after) has no counterpart and is refused.
* ``sliding_window_non_causal`` only concerns sliding-window layers; full-attention layers attend bidirectionally
  inside the block in both packages. speculators windows the context from the block's anchor and this package from
  each query, so sliding-window drafters are refused in both directions rather than run with another attention.
* ``draft_vocab_size`` below the verifier's vocabulary is a draft vocabulary: the drafter's own ``lm_head`` (one row
  per draft token) and ``d2t``, each draft token's offset to its target id (target id = draft index + ``d2t``), become
  this package's ``draft_head`` and ``draft_vocabulary`` (the target ids themselves); ``t2d``, the same set as a mask
  over the verifier's vocabulary, is written for speculators and not read. speculators' DFlash 2 drafts over the whole
  vocabulary only, so a reduced ``dflash2`` config is refused.
* Otherwise ``embed_tokens``, ``lm_head``, ``verifier_lm_head``, ``verifier_norm``, ``t2d`` and ``d2t`` belong to the
  verifier (or to training): drafting here reads the target's own embeddings and head, so they are not loaded.

Only the standard library is imported: this file ships as Hub remote code next to the drafter's other modules.
"""

from __future__ import annotations

import os
from typing import Any

#: speculators' model types this package reads, and the class each becomes.
SPECULATORS_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
#: ``transformer_layer_config`` fields that shape the draft transformer, copied as they are.
BODY_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "rope_parameters", "rope_theta", "rope_scaling", "attention_bias", "attention_dropout", "pad_token_id",
    "bos_token_id", "eos_token_id",
)
#: Drafting fields of a DFlash 2 config with the same name and meaning in both packages.
SELECTOR_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
#: Every top-level field of a speculators 0.9 DFlash / DFlash 2 config; any other is refused, naming it, because a
#: field this package does not know may change what the drafter computes.
KNOWN_FIELDS = frozenset({
    "architectures", "auto_map", "aux_hidden_state_layer_ids", "block_size", "draft_vocab_size", "dtype",
    "mask_token_id", "sample_from_anchor", "sliding_window_non_causal", "speculators_config",
    "speculators_model_type", "speculators_version", "target_hidden_size", "tie_word_embeddings",
    "torch_dtype", "transformer_layer_config", "transformers_version", "_name_or_path", *SELECTOR_FIELDS,
})
#: Tensors of a speculators checkpoint that the verifier (or training) owns: never part of the drafter here.
VERIFIER_TENSORS = frozenset({"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                              "verifier_norm.weight", "t2d", "d2t"})
#: A draft vocabulary's tensors in speculators' names, and the drafter's here (``d2t`` holds offsets, not ids).
DRAFT_VOCABULARY_TENSORS = {"lm_head.weight": "draft_head.weight", "d2t": "draft_vocabulary"}
#: The value of ``DFlashConfig.checkpoint_format`` for a config read from this format (not saved with the config).
CHECKPOINT_FORMAT = "speculators"


def _integer(low: int, optional: bool = False) -> tuple:
    """A field rule: an integer (never a bool, a float or a string of digits) of at least ``low``."""
    return (lambda value: (optional and value is None) or (type(value) is int and value >= low),
            f"an integer >= {low}" + (" or null" if optional else ""))


_FLAG = (lambda value: isinstance(value, bool), "true or false")
_OBJECT = (lambda value: isinstance(value, dict), "an object")
#: The fields a speculators config is read by, each as (accepts, what it accepts in words): checked, all of them,
#: before any is used, so a value of the wrong JSON type is named instead of failing where it is read.
FIELD_RULES = {
    "speculators_model_type": (lambda value: isinstance(value, str) and value in SPECULATORS_ARCHITECTURES,
                               "one of " + ", ".join(repr(kind) for kind in SPECULATORS_ARCHITECTURES)),
    "transformer_layer_config": (_OBJECT[0], "an object of the draft transformer's fields"),
    "aux_hidden_state_layer_ids": (lambda value: isinstance(value, list) and bool(value)
                                   and all(type(i) is int for i in value), "a non-empty list of integers"),
    "block_size": _integer(2),
    "mask_token_id": _integer(0),
    "draft_vocab_size": _integer(1, optional=True),
    "target_hidden_size": _integer(1, optional=True),
    "sample_from_anchor": _FLAG,
    "sliding_window_non_causal": _FLAG,
    "tie_word_embeddings": _FLAG,
    "speculators_config": _OBJECT,
    **{name: _integer(1) for name in SELECTOR_FIELDS},
}
#: The ``transformer_layer_config`` fields this module compares with top-level fields, by the same rules.
LAYER_FIELD_RULES = {
    "vocab_size": _integer(1), "hidden_size": _integer(1),
    "layer_types": (lambda value: isinstance(value, list) and all(isinstance(v, str) for v in value),
                    "a list of layer kinds (strings)"),
}


def _json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words."""
    kinds = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def mistyped_fields(config_dict: dict) -> list[str]:
    """One message per field of a speculators config (and of its ``transformer_layer_config``) whose value its rule
    refuses: the field, what was found and what was expected. Absent fields are left to the checks that need them."""
    layer = config_dict.get("transformer_layer_config")
    places = [(config_dict, FIELD_RULES, "")] + ([(layer, LAYER_FIELD_RULES, "transformer_layer_config.")]
                                                 if isinstance(layer, dict) else [])
    return [f"{prefix}{name}: found the {_json_kind(values[name])} {values[name]!r}, expected {expected}"
            for values, rules, prefix in places for name, (accepts, expected) in rules.items()
            if name in values and not accepts(values[name])]


def is_speculators_config(config_dict: dict) -> bool:
    """True when a ``config.json`` is in speculators' format (it names its ``speculators_model_type``)."""
    return "speculators_model_type" in config_dict


def _layer_config(config_dict: dict) -> dict:
    layer = config_dict.get("transformer_layer_config")
    return layer if isinstance(layer, dict) else {}


def _aux_ids(config_dict: dict) -> Any:
    return config_dict.get("aux_hidden_state_layer_ids")


def draft_vocab_size(config_dict: dict) -> int | None:
    """The size of a speculators config's draft vocabulary, or ``None`` when it drafts over the whole vocabulary."""
    size, vocab = config_dict.get("draft_vocab_size"), _layer_config(config_dict).get("vocab_size")
    return None if size in (None, vocab) else size


def _draft_vocabulary_problems(config_dict: dict, kind: Any, vocab: Any) -> list[str]:
    """What is wrong with a speculators config's ``draft_vocab_size``: not a size within the verifier's vocabulary,
    or a reduced one on a DFlash 2 drafter (speculators' own DFlash 2 refuses it too)."""
    size = config_dict.get("draft_vocab_size", vocab)
    if size == vocab:
        return []
    if type(size) is not int or type(vocab) is not int or not 1 <= size < vocab:
        return [f"draft_vocab_size {size!r} must be an integer from 1 to the verifier's vocabulary {vocab!r}"]
    if kind == "dflash2":
        return [f"draft_vocab_size {size} is below the verifier's vocabulary {vocab} on a dflash2 drafter: "
                "speculators' DFlash 2 drafts over the whole vocabulary"]
    return []


def unhonoured_fields(config_dict: dict) -> list[str]:
    """One message per field of a speculators config that this package cannot run exactly as trained: first every
    field of the wrong type or range (:func:`mistyped_fields`), then what the values mean."""
    problems = [f"unknown field {name!r}" for name in sorted(set(config_dict) - KNOWN_FIELDS)]
    problems += mistyped_fields(config_dict)
    if problems:
        return problems
    kind, layer, aux = config_dict.get("speculators_model_type"), _layer_config(config_dict), _aux_ids(config_dict)
    if kind == "dflash2" and not set(SELECTOR_FIELDS) <= set(config_dict):
        missing = ", ".join(name for name in SELECTOR_FIELDS if name not in config_dict)
        problems.append(f"speculators_model_type 'dflash2' declares a DFlash 2 drafter but the config lacks {missing}: "
                        "it would load here as a DFlash v1 drafter; write all of conv_kernel_size, conv_group_size, "
                        "selector_rank and selector_top_k (speculators' DFlash 2 config saves them)")
    if kind not in SPECULATORS_ARCHITECTURES:
        problems.append(f"speculators_model_type {kind!r} (this package reads {', '.join(SPECULATORS_ARCHITECTURES)})")
    if not isinstance(config_dict.get("transformer_layer_config"), dict):
        problems.append("transformer_layer_config must be an object of the draft transformer's fields")
    if not (isinstance(aux, list) and aux and all(type(i) is int for i in aux)):
        problems.append(f"aux_hidden_state_layer_ids must be a non-empty list of integers, got {aux!r}")
    elif min(aux) < 1:
        problems.append(f"aux_hidden_state_layer_ids {aux} holds {min(aux)}: id 0 is the verifier's embedding output, "
                        "and this package taps decoder layer outputs only (ids >= 1)")
    problems.extend(_draft_vocabulary_problems(config_dict, kind, layer.get("vocab_size")))
    if config_dict.get("sample_from_anchor", False) is not False:
        problems.append("sample_from_anchor is true (the anchor slot predicts the next token): this package's drafters "
                        "predict from the slots after the anchor")
    if "sliding_attention" in (layer.get("layer_types") or []):
        problems.append(f"transformer_layer_config.layer_types {layer.get('layer_types')} has sliding-window layers: "
                        "speculators windows the context from each block's anchor, this package from each query")
    if config_dict.get("target_hidden_size") not in (None, layer.get("hidden_size")):
        problems.append(f"target_hidden_size {config_dict.get('target_hidden_size')} differs from hidden_size "
                        f"{layer.get('hidden_size')}: this package reads target features of the drafter's width")
    return problems


def config_from_speculators(config_dict: dict, source: str | os.PathLike) -> dict:
    """This package's config dict for a speculators ``config.json`` (see the module docstring for the mapping).

    Raises ``ValueError`` naming every field that cannot be honoured, before any weight is read.
    """
    problems = unhonoured_fields(config_dict)
    if problems:
        raise ValueError(f"The speculators drafter at {source} cannot be run exactly as it was trained: "
                         + "; ".join(problems) + ".")
    layer, kind = _layer_config(config_dict), config_dict["speculators_model_type"]
    converted = {name: layer[name] for name in BODY_FIELDS if name in layer}
    converted.update(
        model_type="dflash",
        architectures=[SPECULATORS_ARCHITECTURES[kind]],
        dtype=config_dict.get("dtype", layer.get("dtype")),
        block_size=config_dict.get("block_size"),
        mask_token_id=config_dict.get("mask_token_id"),
        target_layer_ids=[layer_id - 1 for layer_id in _aux_ids(config_dict)],
        checkpoint_format=CHECKPOINT_FORMAT,
    )
    if draft_vocab_size(config_dict) is not None:
        converted["draft_vocab_size"] = draft_vocab_size(config_dict)
    if kind == "dflash2":
        converted.update({name: config_dict[name] for name in SELECTOR_FIELDS if name in config_dict})
    return converted


def speculators_config(config: dict, verifier: dict | None) -> dict:
    """A speculators 0.9 ``config.json`` for this package's saved config dict ``config`` (as ``to_dict`` writes it,
    drafting fields under ``dflash_config``); ``verifier``: ``{"name_or_path": ..., "architectures": [...]}`` of the
    target when known. The caller has checked that the drafter is expressible (:func:`unexpressible_fields`)."""
    drafting = config["dflash_config"]
    kind = "dflash2" if drafting.get("selector_rank") is not None else "dflash"
    layer = {name: config[name] for name in BODY_FIELDS if config.get(name) is not None}
    layer.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], layer_types=config["layer_types"],
                 tie_word_embeddings=False, dtype=config.get("dtype"))
    written = {
        "speculators_model_type": kind,
        "architectures": [SPECULATORS_ARCHITECTURES[kind]],
        "transformer_layer_config": layer,
        "draft_vocab_size": drafting.get("draft_vocab_size") or config["vocab_size"],
        "block_size": drafting["block_size"],
        "aux_hidden_state_layer_ids": [layer_id + 1 for layer_id in drafting["target_layer_ids"]],
        "mask_token_id": drafting["mask_token_id"],
        "sample_from_anchor": False,
        "sliding_window_non_causal": kind == "dflash2",
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "dtype": config.get("dtype"),
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafting["block_size"] - 1,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": verifier or {"name_or_path": None, "architectures": []},
        },
    }
    if kind == "dflash2":
        written.update({name: drafting[name] for name in SELECTOR_FIELDS})
    return written


def unexpressible_fields(config: Any) -> list[str]:
    """One message per setting of a drafter config (a ``DFlashConfig``) that speculators' format cannot state, so
    that speculators or vLLM would run a different drafter from it."""
    problems = []
    if config.is_causal:
        problems.append("is_causal: speculators' full-attention layers attend bidirectionally inside the block")
    if "sliding_attention" in config.layer_types:
        problems.append("sliding-window layers (layer_types): speculators windows the context from each block's "
                        "anchor, this package from each query")
    if float(config.output_multiplier) != 1.0:
        problems.append(f"output_multiplier {config.output_multiplier}: speculators reads logits unscaled")
    if config.final_logit_softcapping:
        problems.append(f"final_logit_softcapping {config.final_logit_softcapping}: speculators does not cap logits")
    if float(config.input_embedding_scale) != 1.0:
        problems.append(f"input_embedding_scale {config.input_embedding_scale}: speculators embeds the block unscaled")
    last = None if config.num_target_layers is None else config.num_target_layers - 1
    if last is not None and last in config.target_layer_ids:
        problems.append(f"target_layer_ids taps the target's last layer ({last}): speculators' id {last + 1} is that "
                        "layer's output before the final norm, this package reads it after")
    if config.selector_factorised:
        problems.append("selector_factorised: speculators keeps full codebooks (materialise them from the target)")
    if config.draft_vocab_size is not None and config.is_dflash2:
        problems.append(f"draft_vocab_size {config.draft_vocab_size} on a DFlash 2 drafter: speculators' DFlash 2 drafts "
                        "over the whole vocabulary (export it with the target's whole head: --whole-head)")
    return problems


__all__ = [
    "CHECKPOINT_FORMAT",
    "DRAFT_VOCABULARY_TENSORS",
    "VERIFIER_TENSORS",
    "config_from_speculators",
    "draft_vocab_size",
    "is_speculators_config",
    "speculators_config",
    "unexpressible_fields",
    "unhonoured_fields",
]
