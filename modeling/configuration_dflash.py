"""Configuration of DFlash / DFlash 2 block drafters.

One config class reads every published layout:

* DFlash v1 drafters for Qwen3 (``model_type: qwen3``, ``architectures: [DFlashDraftModel]``, drafting fields in a
  nested ``dflash_config`` dict with ``block_size`` at the top level),
* DFlash 2 drafters (``architectures: [DFlash2DraftModel]``, ``dflash_config`` adds the convolution and selector
  fields),
* transformers' own ``MuseGlimmerAssistantModel`` (``model_type: muse_glimmer_assistant``, drafting fields flat).

Drafting fields are plain attributes on the config object wherever the file put them, and are written back nested
under ``dflash_config`` (the published DFlash 2 convention) so the saved file loads in the reference implementation
too. This file only imports torch/transformers so it can ship next to the weights as Hub remote code.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import PreTrainedConfig

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
)

#: ``model_type`` values of published drafter configs that this class reads.
KNOWN_SOURCE_MODEL_TYPES = ("dflash", "qwen3", "muse_glimmer_assistant")
KNOWN_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel", "MuseGlimmerAssistantModel")


class DFlashConfig(PreTrainedConfig):
    r"""Configuration of a DFlash (v1) or DFlash 2 block drafter.

    The drafter is a small bidirectional transformer that has no embedding or LM head of its own: it embeds the block
    with the target's input embeddings and reads logits out through the target's LM head.

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

    def __post_init__(self, **kwargs: Any) -> None:
        nested = kwargs.pop("dflash_config", None) or {}
        for name, value in nested.items():
            if name not in DFLASH_FIELDS:
                raise ValueError(f"Unknown field {name!r} in `dflash_config`; known fields: {', '.join(DFLASH_FIELDS)}.")
            setattr(self, name, value)
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

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path: Any, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """Read a config file and accept it only if it describes a drafter layout this class knows.

        A local folder that does not exist or holds no ``config.json`` is named as such (a Hub repo id is looked up
        as transformers does); a file without the drafting fields is refused with the one that is missing, before a
        model of the wrong shape is built from defaults.
        """
        _check_local_source(pretrained_model_name_or_path, kwargs.get("subfolder", ""))
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        model_type = config_dict.get("model_type", cls.model_type)
        architectures = config_dict.get("architectures") or []
        unknown = [name for name in architectures if name not in KNOWN_ARCHITECTURES]
        if model_type not in KNOWN_SOURCE_MODEL_TYPES or unknown:
            raise ValueError(
                f"{pretrained_model_name_or_path} is not a DFlash drafter config (model_type={model_type!r}, "
                f"architectures={architectures}); known architectures: {', '.join(KNOWN_ARCHITECTURES)}."
            )
        nested = config_dict.get("dflash_config")
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
        return {**config_dict, "model_type": cls.model_type}, kwargs

    @property
    def is_dflash2(self) -> bool:
        """True when the config describes a DFlash 2 drafter (convolutions and candidate selector)."""
        return self.selector_rank is not None

    def _check_consistency(self) -> None:
        problems = []
        if self.block_size is None or int(self.block_size) < 2:
            problems.append(f"block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            problems.append("target_layer_ids is missing (or num_target_layers to derive it)")
        elif any(int(i) < 0 for i in self.target_layer_ids):
            problems.append(f"target_layer_ids must be non-negative, got {self.target_layer_ids}")
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            problems.append(f"unsupported layer_types {sorted(unknown)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            problems.append("layer_types has sliding_attention layers but sliding_window is not set")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if (self.conv_kernel_size is None) != (self.conv_group_size is None):
            problems.append("conv_kernel_size and conv_group_size must be set together")
        if self.conv_group_size is not None and self.hidden_size % int(self.conv_group_size):
            problems.append(f"hidden_size {self.hidden_size} is not a multiple of conv_group_size {self.conv_group_size}")
        if self.selector_rank is not None:
            if self.vocab_size is None:
                problems.append("a candidate selector (selector_rank) needs vocab_size")
            if int(self.selector_top_k) < 1:
                problems.append(f"selector_top_k must be >= 1, got {self.selector_top_k}")
        if not isinstance(self.selector_factorised, bool):
            problems.append(f"selector_factorised must be true or false, got {self.selector_factorised!r}")
        elif self.selector_factorised and self.selector_rank is None:
            problems.append("selector_factorised needs a candidate selector (selector_rank)")
        if problems:
            raise ValueError("Invalid DFlash drafter config: " + "; ".join(problems) + ".")

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


def spread_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spread ``num_draft_layers`` feature taps over a target, from layer 1 to three layers before the end."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, max(1, num_target_layers - 3)
    return [round(first + i * (last - first) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


__all__ = ["DFlashConfig", "DFLASH_FIELDS", "spread_target_layer_ids"]
