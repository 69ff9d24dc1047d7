"""Configuration of DFlash / DFlash 2 block drafters.

One config class reads every published layout:

* DFlash v1 drafters for Qwen3 (``model_type: qwen3``, ``architectures: [DFlashDraftModel]``, drafting fields in a
  nested ``dflash_config`` dict with ``block_size`` at the top level),
* DFlash 2 drafters (``architectures: [DFlash2DraftModel]``, ``dflash_config`` adds the convolution and selector
  fields),
* transformers' own ``MuseGlimmerAssistantModel`` (``model_type: muse_glimmer_assistant``, drafting fields flat),
* speculators' ``dflash`` / ``dflash2`` format (``speculators_model_type``; mapped by :mod:`.speculators_format`).

Drafting fields are plain attributes on the config object wherever the file put them, and are written back nested
under ``dflash_config`` (the published DFlash 2 convention) so the saved file loads in the reference implementation
too. This file only imports torch/transformers so it can ship next to the weights as Hub remote code.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from transformers import PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .speculators_format import config_from_speculators, is_speculators_config

#: Fields that configure drafting (as opposed to the transformer body); serialised under ``dflash_config``.
DFLASH_FIELDS = (
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "selector_factorised",
    "output_multiplier",
    "final_logit_softcapping",
    "input_embedding_scale",
    "default_path_strategy",
    "draft_vocab_size",
)

#: ``model_type`` values of published drafter configs that this class reads.
KNOWN_SOURCE_MODEL_TYPES = ("dflash", "qwen3", "muse_glimmer_assistant")
KNOWN_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel", "MuseGlimmerAssistantModel")

#: Largest ``block_size`` accepted: a block is drafted in one drafter forward and verified in one target forward.
MAX_BLOCK_SIZE = 256
#: Most drafter layers accepted (drafters have a few; ``layer_types`` is built with one entry per layer at load).
MAX_DRAFTER_LAYERS = 1024
#: ``PathStrategy`` values of ``dflash2_hf.lattice`` (copied: this file ships alone as Hub remote code).
PATH_STRATEGIES = ("argmax", "greedy", "viterbi", "expected")
#: Attention kinds a drafter layer has; ``attention`` is transformers' legacy name of ``full_attention``.
LAYER_TYPES = ("full_attention", "sliding_attention", "attention")
#: Attention implementations the drafter runs (``paged|`` for transformers' continuous batching).
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "paged|eager", "paged|sdpa")
#: Most classification labels a config may name: a drafter has none, transformers builds a dict of this many.
MAX_LABELS = 65536
#: What a JSON document's top level is, by the Python type ``json`` reads it as.
JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}
#: Fields that reach ``__post_init__`` as keyword arguments, not attributes: the nested drafting fields and a config
#: file's legacy keys.
KWARG_FIELDS = ("dflash_config", "rope_scaling", "rope_theta", "torch_dtype", "use_sliding_window")


@dataclass(frozen=True)
class FieldRule:
    """The values one config field accepts, so that every field is checked by the same few rules.

    ``kind`` is the sort of value (``int`` never accepts a bool; ``number`` is a finite int or float); ``low`` and
    ``high`` bound a number or each entry of an ``int_list`` (excluded when ``strict_low`` / ``strict_high``);
    ``names`` are the strings a ``name`` or ``name_list`` accepts, or the keys a ``dict`` must have; ``labels`` is an
    object from integer ids (JSON keys are strings) to names; ``optional`` accepts null; ``note`` says why.
    """

    kind: Literal["int", "number", "bool", "name", "int_list", "name_list", "token_ids", "dict", "labels", "dtype"]
    low: float | None = None
    high: float | None = None
    strict_low: bool = False
    strict_high: bool = False
    names: tuple[str, ...] = ()
    optional: bool = False
    note: str = ""

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` is of this rule's kind and within its bounds."""
        if value is None:
            return self.optional
        if self.kind == "int":
            return _is_int(value) and self._in_range(value)
        if self.kind == "number":
            return _is_number(value) and math.isfinite(value) and self._in_range(value)
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "name":
            return isinstance(value, str) and value in self.names
        if self.kind == "int_list":
            return _is_list(value) and len(value) > 0 and all(_is_int(v) and self._in_range(v) for v in value)
        if self.kind == "name_list":
            return _is_list(value) and all(isinstance(v, str) and v in self.names for v in value)
        if self.kind == "token_ids":
            return _is_int(value) or (_is_list(value) and all(_is_int(v) for v in value))
        if self.kind == "dict":
            return isinstance(value, dict) and all(name in value for name in self.names)
        if self.kind == "labels":
            return isinstance(value, dict) and all(_is_int_key(key) and isinstance(name, str)
                                                   for key, name in value.items())
        named = isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)
        return named or isinstance(value, torch.dtype)

    def describe(self) -> str:
        """What the rule accepts, in words, for the error message."""
        bounds = " and ".join(part for part in (
            None if self.low is None else f"{'>' if self.strict_low else '>='} {self.low}",
            None if self.high is None else f"{'<' if self.strict_high else '<='} {self.high}",
        ) if part)
        names = ", ".join(repr(name) for name in self.names)
        text = {
            "int": f"an integer {bounds}", "number": f"a finite number {bounds}", "bool": "true or false",
            "name": f"one of {names}", "int_list": f"a non-empty list of integers {bounds}",
            "name_list": f"a list of names among {names}", "token_ids": "a token id or a list of token ids",
            "dict": "an object" + (f" with {names}" if names else ""),
            "labels": "an object from integer ids to label names", "dtype": "the name of a torch dtype (such as 'bfloat16')",
        }[self.kind].rstrip()
        return text + (" or null" if self.optional else "") + (f" ({self.note})" if self.note else "")

    def _in_range(self, value: float) -> bool:
        """Whether ``value`` lies within ``low`` and ``high``."""
        above = self.low is None or (value > self.low if self.strict_low else value >= self.low)
        below = self.high is None or (value < self.high if self.strict_high else value <= self.high)
        return above and below


def _is_int(value: Any) -> bool:
    """An integer that is not a bool (``True`` is an ``int`` to Python, never a count or an id in a config)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int_key(key: Any) -> bool:
    """An integer, or a JSON object key that spells one (``"0"``, ``"-1"``)."""
    return _is_int(key) or (isinstance(key, str) and key.lstrip("-").isdigit())


def _is_number(value: Any) -> bool:
    """An int or a float that is not a bool (a JSON number, written with or without a decimal point)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_list(value: Any) -> bool:
    """A JSON array (a tuple, too, from Python callers)."""
    return isinstance(value, (list, tuple))


_COUNT = FieldRule("int", low=1)
_OPTIONAL_COUNT = FieldRule("int", low=1, optional=True)
_TOKEN_ID = FieldRule("int", optional=True)
_FLAG = FieldRule("bool")
_POSITIVE = FieldRule("number", low=0, strict_low=True)

#: One rule per field the drafter code, ``generate`` or transformers reads from a drafter config.
FIELD_RULES: dict[str, FieldRule] = {
    "dflash_config": FieldRule("dict", optional=True, note="the drafting fields"),
    "architectures": FieldRule("name_list", names=KNOWN_ARCHITECTURES, optional=True),
    "dtype": FieldRule("dtype", optional=True),
    "torch_dtype": FieldRule("dtype", optional=True),
    "vocab_size": _OPTIONAL_COUNT,
    "hidden_size": _COUNT,
    "intermediate_size": _COUNT,
    "num_hidden_layers": FieldRule("int", low=1, high=MAX_DRAFTER_LAYERS, note="layers of the drafter"),
    "num_attention_heads": _COUNT,
    "num_key_value_heads": _OPTIONAL_COUNT,
    "head_dim": _OPTIONAL_COUNT,
    "hidden_act": FieldRule("name", names=tuple(sorted(ACT2FN))),
    "max_position_embeddings": _COUNT,
    "initializer_range": FieldRule("number", low=0),
    "rms_norm_eps": _POSITIVE,
    "rope_parameters": FieldRule("dict", optional=True),
    "rope_scaling": FieldRule("dict", optional=True),
    "rope_theta": replace(_POSITIVE, optional=True),
    "attention_bias": _FLAG,
    "attention_dropout": FieldRule("number", low=0, high=1, strict_high=True),
    "sliding_window": _OPTIONAL_COUNT,
    "use_sliding_window": FieldRule("bool", optional=True),
    "layer_types": FieldRule("name_list", names=LAYER_TYPES, optional=True),
    "is_causal": _FLAG,
    "tie_word_embeddings": _FLAG,
    "num_target_layers": _OPTIONAL_COUNT,
    "pad_token_id": _TOKEN_ID,
    "bos_token_id": _TOKEN_ID,
    "eos_token_id": FieldRule("token_ids", optional=True),
    "block_size": FieldRule("int", low=2, high=MAX_BLOCK_SIZE,
                            note="tokens per block, the anchor included; a block is drafted in one forward and "
                                 "verified in one"),
    "mask_token_id": FieldRule("int", low=0, optional=True),
    "target_layer_ids": FieldRule("int_list", low=0, optional=True),
    "conv_kernel_size": _OPTIONAL_COUNT,
    "conv_group_size": _OPTIONAL_COUNT,
    "selector_rank": _OPTIONAL_COUNT,
    "selector_top_k": _COUNT,
    "selector_factorised": _FLAG,
    "output_multiplier": FieldRule("number"),
    "final_logit_softcapping": replace(_POSITIVE, optional=True),
    "input_embedding_scale": FieldRule("number"),
    "default_path_strategy": FieldRule("name", names=PATH_STRATEGIES, optional=True),
    "default_tree_nodes": FieldRule("int", low=0),
    "default_adaptive_block": _FLAG,
    "default_lookup_tokens": FieldRule("int", low=0),
    "default_plain_fallback": _FLAG,
    "draft_vocab_size": FieldRule("int", low=1, optional=True, note="tokens the drafter's own head drafts from"),
}

#: Fields of a config file that transformers' own ``PreTrainedConfig`` reads (checked in the file, where a wrong type
#: would otherwise end in an exception from inside transformers that names neither field nor file).
FILE_FIELD_RULES: dict[str, FieldRule] = {
    **FIELD_RULES,
    "id2label": FieldRule("labels", optional=True),
    "label2id": FieldRule("dict", optional=True),
    "num_labels": FieldRule("int", low=0, high=MAX_LABELS),
    "attn_implementation": FieldRule("name", names=ATTENTION_IMPLEMENTATIONS, optional=True),
    "_attn_implementation": FieldRule("name", names=ATTENTION_IMPLEMENTATIONS, optional=True),
    "quantization_config": FieldRule("dict", names=("quant_method",), optional=True),
}


def field_problems(values: Mapping[str, Any], rules: Mapping[str, FieldRule] = FIELD_RULES) -> list[str]:
    """One message per field of ``values`` that its rule in ``rules`` refuses, naming field and value."""
    return [f"{name} must be {rule.describe()}, got {values[name]!r}"
            for name, rule in rules.items() if name in values and not rule.accepts(values[name])]


def raise_if_invalid(problems: list[str], source: str | os.PathLike = "") -> None:
    """Raise one ``ValueError`` listing every problem found (``source``: the file they were found in), if any."""
    if problems:
        where = f" at {source}" if source else ""
        raise ValueError(f"Invalid DFlash drafter config{where}: " + "; ".join(problems) + ".")


class DFlashConfig(PreTrainedConfig):
    r"""Configuration of a DFlash (v1) or DFlash 2 block drafter.

    The drafter is a small bidirectional transformer that has no embedding of its own: it embeds the block with the
    target's input embeddings and reads logits out through the target's LM head, or through a head of its own over a
    draft vocabulary (``draft_vocab_size``).

    Args:
        block_size: Tokens per drafted block, the anchor (last verified token) included.
        mask_token_id: Token id filling the ``block_size - 1`` positions to be drafted.
        target_layer_ids: Target layers whose outputs (``hidden_states[id + 1]``) are concatenated as context.
        num_target_layers: Number of decoder layers of the target the drafter was trained for.
        conv_kernel_size / conv_group_size: DFlash 2 grouped dynamic convolution around attention and MLP
            (``None`` for DFlash v1).
        selector_rank / selector_top_k: DFlash 2 candidate selector: rank of the pair-scoring term and number of
            candidates kept per block position (``selector_rank=None`` for DFlash v1).
        selector_factorised: derive the selector's token codes from the target's frozen input embeddings through
            two learned ``[hidden, rank]`` projections instead of keeping two ``[vocab, rank]`` codebooks, so the
            selector's size does not grow with the vocabulary (see :class:`CandidateSelector`).
        output_multiplier / final_logit_softcapping: applied to the target's LM-head logits of drafted positions.
        input_embedding_scale: multiplies the target's input embeddings of the block.
        default_path_strategy: the path strategy ``generate`` uses when the call does not choose one (``None``:
            ``greedy`` for DFlash 2, ``argmax`` for DFlash v1).
        default_tree_nodes / default_adaptive_block: what ``generate`` uses when the call sets neither
            ``dflash_tree_nodes`` nor ``dflash_adaptive_block`` (0 / False: verify one whole path).
        default_lookup_tokens: how many tokens copied from the context (``dflash_lookup_tokens``) a token tree adds
            as one more branch when the call does not say (0: none).
        default_plain_fallback: whether ``generate`` decodes plainly wherever drafting is measured slower than plain
            decoding on the machine at hand, when the call does not set ``dflash_plain_fallback`` (True: never much
            slower than plain ``generate``; False: draft every cycle).
        draft_vocab_size: draft from this many of the target's tokens only, through the drafter's own head (rows of the
            target's head over those tokens, ``draft_head``) and their target ids (``draft_vocabulary``): a draft
            costs less where the LM head is most of it; verification stays on the target's whole vocabulary, so the
            output is as exact as with the full head (``None``: the target's head, every token).
        is_causal: attend causally inside the block instead of bidirectionally (the published drafters use
            bidirectional attention).
    """

    model_type = "dflash"
    default_theta = 10000.0

    vocab_size: int | None = None
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 1
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    is_causal: bool = False
    tie_word_embeddings: bool = False
    num_target_layers: int | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    block_size: int = 16
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int = 16
    selector_factorised: bool = False
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    default_path_strategy: str | None = None
    default_tree_nodes: int = 0
    default_adaptive_block: bool = False
    default_lookup_tokens: int = 0
    default_plain_fallback: bool = True
    draft_vocab_size: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        """Check every field before anything is derived from it, derive the missing ones, then check them together.

        A value of the wrong kind or out of range is named here, at load, instead of failing (or hanging) later in
        the model or in ``generate``.
        """
        self._apply_nested(kwargs.pop("dflash_config", None))
        values = {name: getattr(self, name) for name in FIELD_RULES if name not in KWARG_FIELDS}
        raise_if_invalid(field_problems(values | {name: kwargs[name] for name in KWARG_FIELDS if name in kwargs}))
        if kwargs.pop("use_sliding_window", True) is False:
            self.sliding_window = None
        for legacy in ("max_window_layers", "use_cache"):
            kwargs.pop(legacy, None)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        if self.target_layer_ids is None and self.num_target_layers is not None:
            self.target_layer_ids = spread_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        super().__post_init__(**kwargs)
        self._check_consistency()

    def _apply_nested(self, nested: Any) -> None:
        """Set the fields of a ``dflash_config`` object as attributes; refuse one that is not an object of them."""
        raise_if_invalid(field_problems({"dflash_config": nested}))
        for name, value in (nested or {}).items():
            if name not in DFLASH_FIELDS:
                raise ValueError(f"Unknown field {name!r} in `dflash_config`; known fields: {', '.join(DFLASH_FIELDS)}.")
            setattr(self, name, value)

    @classmethod
    def _dict_from_json_file(cls, json_file: str | os.PathLike) -> dict[str, Any]:
        """Read a config file, refusing one whose top level is not a JSON object (a list, a string, a number).

        transformers reads such a file without complaint and then fails on it with an ``AttributeError`` or a
        ``TypeError`` that does not name the file.
        """
        config_dict = super()._dict_from_json_file(json_file)
        if not isinstance(config_dict, dict):
            kind = JSON_KINDS.get(type(config_dict), type(config_dict).__name__)
            raise ValueError(f"{json_file} holds a JSON {kind}, not an object: a drafter's config.json is one object "
                             "of fields, as save_pretrained writes it.")
        return config_dict

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path: Any, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """Read a config file and accept it only if it describes a drafter layout this class knows (speculators'
        format is converted first, :mod:`.speculators_format`).

        A local folder that does not exist or holds no ``config.json`` is named as such (a Hub repo id is looked up
        as transformers does); a file without the drafting fields is refused with the one that is missing, before a
        model of the wrong shape is built from defaults.
        """
        _check_local_source(pretrained_model_name_or_path, kwargs.get("subfolder", ""))
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if is_speculators_config(config_dict):
            config_dict = config_from_speculators(config_dict, pretrained_model_name_or_path)
        model_type = config_dict.get("model_type", cls.model_type)
        architectures = config_dict.get("architectures") or []
        unknown = [name for name in (architectures if _is_list(architectures) else [architectures])
                   if name not in KNOWN_ARCHITECTURES]
        if model_type not in KNOWN_SOURCE_MODEL_TYPES or unknown:
            raise ValueError(
                f"{pretrained_model_name_or_path} is not a DFlash drafter config (model_type={model_type!r}, "
                f"architectures={architectures}); known architectures: {', '.join(KNOWN_ARCHITECTURES)}."
            )
        nested = config_dict.get("dflash_config")
        raise_if_invalid(field_problems({"dflash_config": nested}), pretrained_model_name_or_path)
        if nested is None and "target_layer_ids" not in config_dict:
            raise ValueError(
                f"The config.json at {pretrained_model_name_or_path} has no `dflash_config`: the drafting fields "
                "(block_size, mask_token_id, target_layer_ids and, for DFlash 2, the conv_* and selector_* fields) "
                "live there. Use the config.json saved with the drafter's weights."
            )
        if "target_layer_ids" not in (nested or config_dict):
            raise ValueError(
                f"The config.json at {pretrained_model_name_or_path} has no target_layer_ids (the target layers whose "
                "hidden states the drafter reads). Use the config.json saved with the drafter's weights."
            )
        raise_if_invalid(field_problems({**config_dict, **(nested or {})}, FILE_FIELD_RULES),
                         pretrained_model_name_or_path)
        return {**config_dict, "model_type": cls.model_type}, kwargs

    @property
    def is_dflash2(self) -> bool:
        """True when the config describes a DFlash 2 drafter (convolutions and candidate selector)."""
        return self.selector_rank is not None

    def _check_consistency(self) -> None:
        """Raise one ``ValueError`` naming every field that does not fit the others (each is valid on its own)."""
        raise_if_invalid(self._layout_problems() + self._drafting_problems() + self._rope_problems())

    def _layout_problems(self) -> list[str]:
        """Problems of the transformer body: derived head size, layer types, head grouping, convolution groups."""
        problems = []
        if self.head_dim < 1 or self.head_dim % 2:
            problems.append(f"head_dim (hidden_size // num_attention_heads when not given) must be an even integer "
                            f">= 2 (rotary embeddings rotate pairs of channels), got {self.head_dim}")
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers, "
                            f"got {self.layer_types!r}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            problems.append("layer_types has sliding_attention layers but sliding_window is not set")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads must be a multiple of num_key_value_heads, got "
                            f"{self.num_attention_heads} and {self.num_key_value_heads}")
        if (self.conv_kernel_size is None) != (self.conv_group_size is None):
            problems.append(f"conv_kernel_size and conv_group_size must be set together, got "
                            f"{self.conv_kernel_size!r} and {self.conv_group_size!r}")
        if self.conv_group_size is not None and self.hidden_size % self.conv_group_size:
            problems.append(f"hidden_size {self.hidden_size} is not a multiple of conv_group_size {self.conv_group_size}")
        return problems

    def _drafting_problems(self) -> list[str]:
        """Problems of the drafting fields: target taps, token ids within the vocabulary, selector, ``generate``
        defaults that a call would refuse."""
        problems = []
        if not self.target_layer_ids:
            problems.append("target_layer_ids is missing (or num_target_layers to derive it)")
        vocab = self.vocab_size
        if vocab is not None and self.mask_token_id is not None and self.mask_token_id >= vocab:
            problems.append(f"mask_token_id must be < vocab_size {vocab}, got {self.mask_token_id}")
        if vocab is not None and self.selector_top_k > vocab:
            problems.append(f"selector_top_k must be <= vocab_size {vocab}, got {self.selector_top_k}")
        draft_vocab = self.draft_vocab_size
        if draft_vocab is not None and (vocab is None or draft_vocab > vocab):
            problems.append(f"draft_vocab_size must be <= vocab_size {vocab}, got {draft_vocab}")
        if draft_vocab is not None and self.selector_top_k > draft_vocab:
            problems.append(f"selector_top_k must be <= draft_vocab_size {draft_vocab}, got {self.selector_top_k}")
        if self.selector_rank is not None and vocab is None:
            problems.append("a candidate selector (selector_rank) needs vocab_size")
        if self.selector_factorised and self.selector_rank is None:
            problems.append("selector_factorised needs a candidate selector (selector_rank)")
        if self.default_path_strategy not in (None, "argmax") and self.selector_rank is None:
            problems.append(f"default_path_strategy {self.default_path_strategy!r} needs a DFlash 2 drafter (a "
                            "candidate selector, selector_rank); DFlash v1 drafts with 'argmax'")
        branches = _lattice_branches(self.block_size, self.selector_top_k, enough=self.default_tree_nodes)
        if self.default_tree_nodes > branches:
            problems.append(f"default_tree_nodes must be at most {branches}, the branches a lattice of "
                            f"{self.block_size - 1} drafted positions by {self.selector_top_k} candidates holds, "
                            f"got {self.default_tree_nodes}")
        return problems

    def _rope_problems(self) -> list[str]:
        """Problems of ``rope_parameters`` as transformers standardised them: a rotary type the drafter's rotary
        embedding knows, a positive base, and the keys that type needs (checked by transformers)."""
        rope = self.rope_parameters
        rope_types = ("default", *ROPE_INIT_FUNCTIONS)
        if not isinstance(rope, dict) or rope.get("rope_type") not in rope_types:
            return [f"rope_parameters must be an object whose rope_type is one of {', '.join(map(repr, rope_types))}, "
                    f"got {rope!r}"]
        theta = rope.get("rope_theta")
        problems = [] if _POSITIVE.accepts(theta) else [
            f"rope_parameters' rope_theta must be {_POSITIVE.describe()}, got {theta!r}"]
        try:
            self.validate_rope()
        except (KeyError, TypeError, ValueError) as error:
            problems.append(f"rope_parameters {rope!r}: {error}")
        return problems

    def check_fits_target(self, target_config: PreTrainedConfig, target_vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming every reason this drafter cannot draft for a target with ``target_config``.

        ``target_vocab_size`` is the number of rows of the target's LM head when known (it can exceed the tokenizer's
        vocabulary); it defaults to ``target_config.vocab_size``.
        """
        text_config = target_config.get_text_config()
        target_layers = text_config.num_hidden_layers
        target_vocab = target_vocab_size or text_config.vocab_size
        problems = []
        if text_config.hidden_size != self.hidden_size:
            problems.append(f"hidden size: drafter {self.hidden_size}, target {text_config.hidden_size}")
        if max(self.target_layer_ids) >= target_layers:
            problems.append(f"target_layer_ids {list(self.target_layer_ids)} need more than the target's {target_layers} layers")
        if self.num_target_layers is not None and self.num_target_layers != target_layers:
            problems.append(f"drafter was built for a {self.num_target_layers}-layer target, the target has {target_layers}")
        if self.mask_token_id is None:
            problems.append("the drafter config has no mask_token_id")
        elif not 0 <= self.mask_token_id < target_vocab:
            problems.append(f"mask_token_id {self.mask_token_id} is outside the target vocabulary of {target_vocab}")
        if self.vocab_size is not None and self.vocab_size != target_vocab:
            problems.append(f"vocabulary: drafter {self.vocab_size}, target {target_vocab}")
        if problems:
            raise ValueError("This drafter does not fit the target model: " + "; ".join(problems) + ".")

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output.pop("checkpoint_format", None)  # where the weights came from, not a property of the drafter
        output["dflash_config"] = {name: output.pop(name) for name in DFLASH_FIELDS if output.get(name) is not None}
        for name in DFLASH_FIELDS:
            output.pop(name, None)
        return output


def _check_local_source(path: Any, subfolder: str = "") -> None:
    """Refuse a local drafter location that does not exist or holds no ``config.json``, naming it.

    A path counts as local when it exists, is absolute, starts with ``.`` or ``~``, is deeper than a Hub repo id's
    ``namespace/name``, or lies in an existing folder; anything else is left to transformers as a Hub repo id, so
    Hub downloads and the Hub cache work as before.
    """
    location = os.path.join(path, subfolder) if subfolder else str(path)
    if os.path.isfile(location):
        return  # a config file given directly
    if os.path.isdir(location):
        if not os.path.isfile(os.path.join(location, "config.json")):
            raise FileNotFoundError(f"There is no config.json in {location}: a drafter folder holds the config.json "
                                    "and model.safetensors that save_pretrained writes. Pass that folder.")
        return
    given = os.path.normpath(str(path))
    parts = given.split(os.sep)
    if (os.path.isabs(given) or str(path).startswith((".", "~")) or len(parts) > 2
            or (len(parts) == 2 and os.path.isdir(parts[0]))):
        raise FileNotFoundError(f"{location} does not exist. Pass a drafter folder (with the config.json and "
                                "model.safetensors that save_pretrained writes) or a Hub repo id.")


def _lattice_branches(block_size: int, top_k: int, enough: int) -> int:
    """The branches a lattice of ``block_size - 1`` drafted positions by ``top_k`` candidates holds (what bounds a
    token tree's nodes), counted only until they exceed ``enough`` so that a huge lattice costs nothing."""
    branches, level = 0, 1
    for _ in range(block_size - 1):
        level *= top_k
        branches += level
        if branches > enough:
            break
    return branches


def spread_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spread ``num_draft_layers`` feature taps over a target, from layer 1 to three layers before the end."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, max(1, num_target_layers - 3)
    return [round(first + i * (last - first) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


__all__ = ["DFlashConfig", "DFLASH_FIELDS", "spread_target_layer_ids"]
