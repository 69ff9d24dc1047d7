"""How ``target.generate(assistant_model=drafter)`` reaches the DFlash decoder.

transformers picks the assisted-generation loop whenever ``assistant_model`` is given, looking the method up on the
model's class (``GENERATION_MODES_MAPPING[ASSISTED_GENERATION] == "_assisted_decoding"``). Importing ``dflash2_hf``
wraps three ``GenerationMixin`` methods so that, when the assistant is a DFlash drafter (and the caller did not ask
for transformers' own ``speculation_type="dflash"``):

* ``_extract_generation_mode_kwargs`` also takes the per-call options ``dflash_path``, ``dflash_block_size``,
  ``dflash_top_k``, ``dflash_record_drafts``, ``dflash_adaptive_block``, ``dflash_tree_nodes``,
  ``dflash_lookup_tokens`` and ``dflash_plain_fallback`` out of the
  ``generate`` kwargs;
* ``_validate_generation_mode`` checks the drafter fits the target and the arguments are supported, before any work,
  and skips the checks meant for classic draft LMs (vocabulary size, tokenizers);
* ``_assisted_decoding`` runs :class:`~dflash2_hf.decoding.DFlashDecoder` instead of the classic loop.

Every other call goes to the original methods untouched. ``tests/test_hooks.py`` fails if a transformers upgrade
renames or re-routes any of them.
"""

from __future__ import annotations

import functools
import warnings

import torch

from transformers.generation.utils import GENERATION_MODES_MAPPING, GenerationMixin, GenerationMode

from .cpu_kernels import native_bf16_matmuls
from .decoding import DFlashDecoder, check_generation_arguments
from .drafting import DraftOptions
from .grouped_attention import grouped_attention
from .modeling import DFlashDraftModel
from .tree_decoding import TreeDecoder

OPTION_KWARGS = {
    "dflash_path": "path",
    "dflash_block_size": "block_size",
    "dflash_top_k": "top_k",
    "dflash_record_drafts": "record_drafts",
    "dflash_adaptive_block": "adaptive_block",
    "dflash_tree_nodes": "tree_nodes",
    "dflash_lookup_tokens": "lookup_tokens",
    "dflash_plain_fallback": "plain_fallback",
}
BF16_WITHOUT_HARDWARE = (
    "This CPU has no bf16 matmul instructions (AVX512-BF16 or AMX), so a bf16 target verifies a drafted block at "
    "several times the cost of one token here, and plain bf16 decoding is slow too. Load the target and drafter with "
    "dtype=torch.float32: exact and faster on this CPU. (Decoding with the drafter falls back to plain steps wherever "
    "drafting does not pay.)"
)
PATCHED_METHODS = ("_extract_generation_mode_kwargs", "_validate_generation_mode", "_assisted_decoding")


def is_drafter(model) -> bool:
    """A DFlash drafter, bare or wrapped by PEFT (adapters active)."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    return isinstance(base, DFlashDraftModel)


def _uses_dflash(assistant_model, generation_config=None) -> bool:
    if not is_drafter(assistant_model):
        return False
    return generation_config is None or getattr(generation_config, "speculation_type", None) != "dflash"


def _wrap_extract(original):
    @functools.wraps(original)
    def extract(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer):
        options = {OPTION_KWARGS[k]: kwargs.pop(k) for k in list(kwargs) if k in OPTION_KWARGS}
        mode_kwargs = original(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer)
        if options and not is_drafter(assistant_model):
            raise ValueError(f"{sorted(options)} options need a DFlash drafter as assistant_model.")
        if options:
            mode_kwargs["dflash_options"] = options
        return mode_kwargs

    return extract


def _wrap_validate(original):
    @functools.wraps(original)
    def validate(self, generation_mode, generation_config, generation_mode_kwargs):
        drafter = generation_mode_kwargs.get("assistant_model")
        if not _uses_dflash(drafter, generation_config):
            return original(self, generation_mode, generation_config, generation_mode_kwargs)
        if generation_mode != GenerationMode.ASSISTED_GENERATION:
            raise ValueError(
                f"A DFlash drafter drafts for greedy decoding and sampling only; these settings select {generation_mode}"
                " (e.g. num_beams > 1), which would ignore the drafter."
            )
        if generation_mode_kwargs.get("assistant_tokenizer") is not None:
            raise ValueError("A DFlash drafter shares the target's tokenizer; do not pass `assistant_tokenizer`.")
        if generation_config.use_cache is False:
            raise ValueError("DFlash decoding needs the target's KV cache: each cycle verifies a draft against the "
                             "cached context and rolls back what was rejected; got use_cache=False (from the call or "
                             "the target's generation_config). Pass use_cache=True.")
        drafter.config.check_fits_target(self.config, self.get_output_embeddings().weight.shape[0])
        if drafter.device != self.device:
            raise ValueError(f"The drafter is on {drafter.device} and the target on {self.device}; put both on one device.")
        DraftOptions.for_drafter(drafter, target=self, **generation_mode_kwargs.get("dflash_options", {}))
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and not native_bf16_matmuls():
            warnings.warn(BF16_WITHOUT_HARDWARE, stacklevel=4)
        without_assistant = {k: v for k, v in generation_mode_kwargs.items() if k not in ("assistant_model", "dflash_options")}
        return original(self, generation_mode, generation_config, without_assistant)

    return validate


def _wrap_assisted_decoding(original):
    @functools.wraps(original)
    def assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        drafter = kwargs.get("assistant_model")
        if not _uses_dflash(drafter, generation_config):
            kwargs.pop("dflash_options", None)
            return original(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs)
        _check_model_inputs(kwargs)
        check_generation_arguments(generation_config, input_ids, getattr(self.config.get_text_config(), "max_position_embeddings", None))
        options = DraftOptions.for_drafter(drafter, target=self, **kwargs.get("dflash_options", {}))
        decoder_class = TreeDecoder if options.tree_nodes else DFlashDecoder
        with grouped_attention(self):  # verification forwards share the key/value heads instead of copying them
            decoder = decoder_class(
                self, drafter, options, generation_config, logits_processor, stopping_criteria,
                kwargs.get("streamer"), kwargs["cache"],
            )
            sequence = decoder.run(input_ids)
        drafter.last_generation_stats = decoder.stats
        return decoder.output(sequence, input_ids.shape[1], bool(generation_config.return_dict_in_generate))

    return assisted_decoding


def _check_model_inputs(model_kwargs: dict) -> None:
    """Refuse, before any work, model inputs that ``generate`` accepts but the DFlash decoder would misread: it
    prefills the target itself with the prompt's token ids, unpadded, into an empty cache."""
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("DFlash decoding needs input_ids: the drafter drafts from token ids and the target is "
                         "prefilled with them, so inputs_embeds is not supported (alone or next to input_ids). Pass "
                         "the prompt as input_ids.")
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("DFlash decoding does not support padded prompts (attention_mask with zeros).")
    cached = model_kwargs["cache"].get_seq_length()
    if cached:
        raise ValueError(f"The cache passed to generate already holds {cached} tokens; DFlash decoding prefills the "
                         "whole prompt into an empty cache. Pass a new cache, or none.")


def install() -> None:
    """Wrap the ``GenerationMixin`` methods (idempotent)."""
    if GENERATION_MODES_MAPPING.get(GenerationMode.ASSISTED_GENERATION) != "_assisted_decoding":
        raise RuntimeError("transformers no longer routes assisted generation through `_assisted_decoding`; "
                           "dflash2-hf needs an update for this transformers version.")
    wrappers = {
        "_extract_generation_mode_kwargs": _wrap_extract,
        "_validate_generation_mode": _wrap_validate,
        "_assisted_decoding": _wrap_assisted_decoding,
    }
    for name, wrap in wrappers.items():
        current = getattr(GenerationMixin, name)
        if getattr(current, "__dflash2_hf__", False):
            continue
        wrapped = wrap(current)
        wrapped.__dflash2_hf__ = True
        setattr(GenerationMixin, name, wrapped)
