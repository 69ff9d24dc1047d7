"""A ``generate`` request to DFlash decoding, checked once before any forward: the drafter (a DFlash drafter, its
tensors on the target's device and floating point, finite, fitting the target), the decoding mode, the model inputs,
the cache, and the ``dflash_*`` options a generation config carries. Both entries of
:mod:`~dflash2_hf.generation.integration` run :func:`check_request` first."""

from __future__ import annotations

import warnings

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer
from transformers.generation.utils import GenerationMode

from ..cpu.kernels import bf16_rows_independent, native_bf16_matmuls
from ..modeling import DFlashDraftModel
from .config import check_generation_arguments

OPTION_KWARGS = {
    "dflash_path": "path",
    "dflash_block_size": "block_size",
    "dflash_top_k": "top_k",
    "dflash_record_drafts": "record_drafts",
    "dflash_adaptive_block": "adaptive_block",
    "dflash_tree_nodes": "tree_nodes",
    "dflash_lookup_tokens": "lookup_tokens",
    "dflash_plain_fallback": "plain_fallback",
    "dflash_packed_linears": "packed_linears",
    "dflash_exactness": "exactness",
}
BF16_WITHOUT_HARDWARE = (
    "This CPU has no bf16 matmul instructions (AVX512-BF16 or AMX), so a bf16 target verifies a drafted block at "
    "several times the cost of one token here, and plain bf16 decoding is slow too. Load the target and drafter with "
    "dtype=torch.float32: exact and faster on this CPU. (Decoding with the drafter falls back to plain steps wherever "
    "drafting does not pay.)"
)
BF16_BLOCKS_ROUND_UNLIKE_ROWS = (
    "This CPU's bf16 matmuls round some values of a many-token block differently from the same token alone, so with "
    "a drafter, greedy bf16 output may differ from plain bf16 decoding here (a verification forward holds many "
    "tokens, plain decoding one). The exact choice, and the faster one here: load the target and drafter with "
    "dtype=torch.float32 (their linears run on packed oneDNN weights during the call)."
)
#: The cache layers whose rows DFlash decoding can crop and compact: transformers' dynamic full and sliding layers.
CROPPABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)
#: Static layers hold the same keys and values in buffers of a fixed length (for torch.compile); DFlash decoding
#: fills a DynamicCache in their place, which attends alike.
STATIC_LAYERS = (StaticLayer, StaticSlidingWindowLayer)


def is_drafter(model) -> bool:
    """A DFlash drafter: bare, with adapters injected in place (``inject_adapter_in_model``, ``add_adapter``), or
    wrapped in a ``PeftModel``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return isinstance(base, DFlashDraftModel)



def generation_config_options(generation_config: GenerationConfig) -> dict:
    """The ``dflash_*`` options a generation config carries (one passed as ``generation_config=``, or the target's own
    ``generation_config.json``, which transformers keeps unknown attributes of), honoured under the call's own
    keywords; a ``dflash_*`` name that is no option is refused, naming it, instead of being ignored."""
    found = {name: value for name, value in vars(generation_config).items() if name.startswith("dflash_")}
    unknown = sorted(set(found) - set(OPTION_KWARGS))
    if unknown:
        raise ValueError(f"The generation config sets {', '.join(unknown)}, which is no DFlash option; the options are "
                         f"{', '.join(OPTION_KWARGS)}.")
    return {name: value for name, value in found.items() if value is not None}


def check_request(target, drafter, input_ids: torch.Tensor, generation_config: GenerationConfig,
                  model_kwargs: dict) -> None:
    """Refuse, with one clear error and before any forward, a request DFlash decoding cannot honour exactly."""
    if not is_drafter(drafter):
        raise ValueError(f"The drafter must be a DFlash drafter (DFlashDraftModel.from_pretrained); got "
                         f"{type(drafter).__name__}.")
    check_decoding_mode(generation_config.get_generation_mode(), (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE))
    if generation_config.use_cache is False:
        raise ValueError("DFlash decoding needs the target's KV cache: each cycle verifies a draft against the "
                         "cached context and rolls back what was rejected; got use_cache=False (from the call or "
                         "the target's generation_config). Pass use_cache=True.")
    drafter.config.check_fits_target(target.config, target.get_output_embeddings().weight.shape[0])
    check_drafter_tensors(drafter, target.device)
    check_finite_weights(drafter)
    context_length = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    check_model_inputs(model_kwargs, input_ids, generation_config.pad_token_id)
    check_generation_arguments(generation_config, input_ids, context_length)
    check_cache(model_kwargs.get("cache"))
    warn_of_inexact_bf16(target)


def warn_of_inexact_bf16(target) -> None:
    """Warn (once per process and reason) where a bf16 target on this CPU is neither fast nor exact with a drafter,
    naming the exact, faster choice: no bf16 instructions (emulated, slow), or bf16 blocks rounded unlike single
    rows (greedy output may differ from plain bf16 decoding)."""
    if target.device.type != "cpu" or target.dtype != torch.bfloat16:
        return
    if not native_bf16_matmuls():
        warnings.warn(BF16_WITHOUT_HARDWARE, stacklevel=6)
    elif not bf16_rows_independent():
        warnings.warn(BF16_BLOCKS_ROUND_UNLIKE_ROWS, stacklevel=6)


def check_drafter_tensors(drafter, device: torch.device) -> None:
    """Refuse a drafter with a tensor off the target's device (the meta device included: no values to draft with)
    or a weight that is not floating point, naming the first such tensor."""
    for name, tensor in (*drafter.named_parameters(), *drafter.named_buffers()):
        if tensor.device.type == "meta":
            raise ValueError(f"The drafter's {name} is on the meta device (no values); load the drafter on the "
                             f"target's device ({device}).")
        if tensor.device != device:
            raise ValueError(f"The drafter's {name} is on {tensor.device} and the target on {device}; put both on one "
                             "device (drafter.to(target.device)).")
        if not tensor.is_floating_point() and isinstance(tensor, torch.nn.Parameter):
            raise ValueError(f"The drafter's weight {name} holds {tensor.dtype}, not floating point; load or train "
                             "the drafter again.")


def check_finite_weights(drafter) -> None:
    """Refuse a drafter with NaN or Inf weights (a diverged training run, a bad cast): its drafts would be NaN
    probabilities that no verifier can weigh."""
    weights = [weight for weight in drafter.parameters() if weight.is_floating_point()]
    if not weights or bool(torch.stack([torch.isfinite(weight).all() for weight in weights]).all()):
        return
    broken = [name for name, weight in drafter.named_parameters()
              if weight.is_floating_point() and not bool(torch.isfinite(weight).all())]
    raise ValueError(f"The drafter has NaN or Inf weights in {', '.join(broken[:4])}"
                     f"{' and more' if len(broken) > 4 else ''}; load or train it again.")


def check_decoding_mode(mode: GenerationMode, allowed: tuple[GenerationMode, ...]) -> None:
    """Refuse generation settings that select another decoding method (beam search, contrastive search, prompt
    lookup, ...): it would ignore the drafter, or fight it for the cycle."""
    if mode not in allowed:
        raise ValueError(f"A DFlash drafter drafts for greedy decoding and sampling only; these settings select "
                         f"{mode.value} (e.g. num_beams > 1 or prompt_lookup_num_tokens), which would ignore the "
                         "drafter.")


def check_model_inputs(model_kwargs: dict, input_ids: torch.Tensor, pad_token_id: object = None) -> None:
    """Refuse model inputs that ``generate`` accepts but the DFlash decoder would misread: it prefills the target
    itself with the prompt's token ids, unpadded, into an empty cache."""
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("DFlash decoding needs input_ids: the drafter drafts from token ids and the target is "
                         "prefilled with them, so inputs_embeds is not supported (alone or next to input_ids). Pass "
                         "the prompt as input_ids.")
    check_attention_mask(model_kwargs.get("attention_mask"), input_ids, pad_token_id)
    check_positions(model_kwargs.get("position_ids"), input_ids)


def check_positions(position_ids: torch.Tensor | None, input_ids: torch.Tensor) -> None:
    """The decoder places the prompt at positions ``0 .. n - 1``. ``generate`` derives ``position_ids`` from the
    attention mask (then drops a mask of ones), so a mask of another length shows here; so do positions of the
    user's own, which the decoder would otherwise ignore."""
    if position_ids is None:
        return
    if tuple(position_ids.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask (or position_ids) has shape {tuple(position_ids.shape)}; input_ids has "
                         f"{tuple(input_ids.shape)}. Pass one mask value per prompt token, or no mask.")
    if not torch.equal(position_ids[0].cpu(), torch.arange(input_ids.shape[1])):
        raise ValueError("DFlash decoding places the prompt at positions 0 .. n-1; pass no position_ids (or "
                         "those).")


def check_attention_mask(attention_mask: torch.Tensor | None, input_ids: torch.Tensor, pad_token_id: object) -> None:
    """Accept an attention mask that attends to every prompt token (the decoder attends to all of them); refuse one
    of another shape (as the target's forward would), a padded prompt, or prompt tokens hidden because they equal
    the pad token (what ``generate`` infers when no mask is passed and the pad token differs from EOS), naming why."""
    if attention_mask is None:
        return
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; input_ids has "
                         f"{tuple(input_ids.shape)}. Pass one mask value per prompt token, or no mask.")
    hidden = [int(i) for i in torch.nonzero(attention_mask[0] == 0).flatten()]
    if not hidden:
        return
    if hidden == list(range(len(hidden))):
        raise ValueError(f"The prompt is left-padded ({len(hidden)} masked tokens): DFlash decoding takes one prompt "
                         "per call; pass it without padding.")
    if all(int(input_ids[0, i]) == pad_token_id for i in hidden):
        raise ValueError(f"Prompt tokens at positions {hidden[:8]} equal pad_token_id {pad_token_id}, which "
                         "generate masks out when no attention_mask is passed and the pad token differs from "
                         "eos_token_id. Pass attention_mask=torch.ones_like(input_ids) to attend to them, or set "
                         "pad_token_id to a token the prompt lacks.")
    raise ValueError(f"attention_mask hides prompt tokens at positions {hidden[:8]}; DFlash decoding attends to "
                     "every prompt token: drop those tokens from the prompt, or pass no attention_mask.")


def is_static(cache) -> bool:
    """Whether every layer of ``cache`` is a static one, kept on the device (``cache_implementation="static"``, a
    ``StaticCache``)."""
    layers = getattr(cache, "layers", [])
    return (bool(layers) and all(type(layer) in STATIC_LAYERS for layer in layers)
            and not getattr(cache, "offloading", False))


def decoding_cache(cache, target):
    """The cache the decoder fills: the one ``generate`` built or was given, or, for an empty static cache, a new
    ``DynamicCache`` (the same attention over the same keys, so the same tokens; verification's varying widths
    would defeat a static cache's fixed shapes anyway)."""
    return DynamicCache(config=target.config) if is_static(cache) else cache


def check_cache(cache) -> None:
    """Accept only an empty cache DFlash decoding can roll back exactly: a ``DynamicCache`` (not offloaded) of full
    or sliding-window dynamic layers, which ``generate`` builds by default, or a static cache, in whose place a
    ``DynamicCache`` is filled. Any other cache is refused by rule, naming it and what to pass instead."""
    name = type(cache).__name__
    layer_types = {type(layer) for layer in getattr(cache, "layers", [])}
    replicated = getattr(cache, "layer_class_to_replicate", None)
    croppable = (isinstance(cache, DynamicCache) and not getattr(cache, "offloading", False)
                 and all(kind in CROPPABLE_LAYERS for kind in layer_types)
                 and replicated in (None, *CROPPABLE_LAYERS))
    if not (croppable or is_static(cache)):
        kinds = ", ".join(sorted(kind.__name__ for kind in layer_types)) or "none yet"
        raise ValueError(f"DFlash decoding rolls rejected draft tokens back out of the target's cache, which a {name} "
                         f"(layers: {kinds}) cannot do exactly. Pass no cache and no cache_implementation (or "
                         "cache_implementation='dynamic'): generate then builds a DynamicCache.")
    cached = cache.get_seq_length()
    if cached:
        raise ValueError(f"The cache passed to generate already holds {cached} tokens; DFlash decoding prefills the "
                         "whole prompt into an empty cache. Pass a new cache, or none.")
