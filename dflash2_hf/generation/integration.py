"""Where DFlash decoding meets transformers' ``generate``: two entries, one decoder.

* **The supported seam**: ``target.generate(**inputs, custom_generate=dflash2_hf.custom_generate, drafter=drafter)``.
  transformers prepares the generation config, logits processors, stopping criteria and cache as for any decoding
  method, hands :func:`custom_generate` the keyword arguments its signature names (``drafter`` and the ``dflash_*``
  options), and nothing of transformers is rewritten. transformers (5.24, 5.25) does not pass a ``custom_generate``
  callable the ``streamer`` or the ``tokenizer`` that stop strings need: with this entry pass stop strings as
  ``stopping_criteria=[StopStringCriteria(tokenizer, [...])]``; streaming needs the ``assistant_model`` entry.
* **The assistant route**: ``target.generate(**inputs, assistant_model=drafter)``. transformers sends every
  ``assistant_model`` to its assisted-generation loop, so importing ``dflash2_hf`` wraps three private
  ``GenerationMixin`` methods (:data:`PATCHED_METHODS`), and only on the transformers versions this release was tested
  with (:data:`SUPPORTED_TRANSFORMERS`): they take the ``dflash_*`` options out of the call, skip the checks meant for
  classic draft LMs, and send a DFlash drafter to :func:`decode` (every other call goes to the originals untouched).
  On any other version nothing private is touched: the public ``generate`` refuses a DFlash drafter as
  ``assistant_model`` with a message naming the supported seam, rather than guess at private methods.

Both entries end in :func:`decode`, which checks the whole request once, before any forward
(:mod:`~dflash2_hf.generation.request`), then runs :class:`~dflash2_hf.generation.loop.DFlashDecoder`.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager, nullcontext

import torch
import transformers
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GENERATION_MODES_MAPPING, GenerationMixin, GenerationMode

from ..cpu.grouped_attention import grouped_attention
from ..cpu.kernels import drafter_for_the_call, packed_for_the_call
from ..modeling import DFlashDraftModel
from ..drafting.options import DraftOptions
from .exact_widths import exact_options, plain_decoding_only
from .loop import DFlashDecoder
from .request import (
    OPTION_KWARGS,
    check_decoding_mode,
    check_request,
    decoding_cache,
    generation_config_options,
    is_drafter,
)

#: ``major.minor`` releases of transformers whose private generate methods the assistant route was tested against.
SUPPORTED_TRANSFORMERS = ((5, 24), (5, 25))
PATCHED_METHODS = ("_extract_generation_mode_kwargs", "_validate_generation_mode", "_assisted_decoding")


def custom_generate(
    model,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    *,
    drafter: DFlashDraftModel | None = None,
    dflash_path: str | None = None,
    dflash_block_size: int | None = None,
    dflash_top_k: int | None = None,
    dflash_record_drafts: bool | None = None,
    dflash_adaptive_block: object = None,
    dflash_tree_nodes: int | None = None,
    dflash_lookup_tokens: int | None = None,
    dflash_plain_fallback: object = None,
    dflash_packed_linears: bool | None = None,
    dflash_exactness: str | None = None,
    **model_kwargs,
):
    """DFlash 2 decoding through transformers' public seam:
    ``target.generate(**inputs, custom_generate=dflash2_hf.custom_generate, drafter=drafter, max_new_tokens=...)``.

    ``drafter`` is a DFlash / DFlash 2 drafter for ``model``; the ``dflash_*`` options are those of the
    ``assistant_model`` route (docs/generation.md). Returns what ``generate`` returns: the sequences, or with
    ``return_dict_in_generate=True`` a :class:`~dflash2_hf.generation.stats.DFlashGenerateOutput` with the call's statistics.
    """
    if drafter is None:
        raise ValueError("custom_generate=dflash2_hf.custom_generate needs the drafter: pass drafter=<a DFlash drafter "
                         "loaded with DFlashDraftModel.from_pretrained>.")
    check_nothing_withheld()
    options = {name: value for name, value in {
        "dflash_path": dflash_path, "dflash_block_size": dflash_block_size, "dflash_top_k": dflash_top_k,
        "dflash_record_drafts": dflash_record_drafts, "dflash_adaptive_block": dflash_adaptive_block,
        "dflash_tree_nodes": dflash_tree_nodes, "dflash_lookup_tokens": dflash_lookup_tokens,
        "dflash_plain_fallback": dflash_plain_fallback,
        "dflash_packed_linears": dflash_packed_linears, "dflash_exactness": dflash_exactness}.items()
        if value is not None}
    return decode(model, drafter, input_ids, logits_processor, stopping_criteria, generation_config,
                  model_kwargs=model_kwargs, options=options)


def decode(
    target,
    drafter,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    *,
    model_kwargs: dict,
    options: dict,
    streamer=None,
):
    """Check the request once (drafter, arguments, inputs, cache, options), then run one DFlash generation.

    ``options`` maps ``dflash_*`` keyword names to the call's values. Nothing runs on the target before every check
    has passed."""
    check_request(target, drafter, input_ids, generation_config, model_kwargs)
    options = {**generation_config_options(generation_config), **options}
    draft_options = DraftOptions.for_drafter(drafter, target=target, **{
        OPTION_KWARGS[name]: value for name, value in options.items()})
    do_sample = bool(generation_config.do_sample)
    drafting, kernels = drafter, nullcontext()  # plain decoding runs the models as they are
    if not plain_decoding_only(target, draft_options, do_sample):
        drafting = drafter_for_the_call(target, drafter, draft_options.packed_linears)
        kernels = kernels_for_the_call(target, drafting, draft_options.packed_linears)
    with kernels:
        exact, width = exact_options(target, draft_options, do_sample)
        decoder = DFlashDecoder(target, drafting, exact or draft_options, generation_config, logits_processor,
                                stopping_criteria, streamer, decoding_cache(model_kwargs["cache"], target),
                                drafts=exact is not None)
        decoder.stats.exact_width = width
        sequence = decoder.run(input_ids)
    drafter.last_generation_stats = decoder.stats
    return decoder.output(sequence, input_ids.shape[1], bool(generation_config.return_dict_in_generate))


@contextmanager
def kernels_for_the_call(target, drafting, packed_linears: bool):
    """What a drafted call runs under: verification forwards share the key/value heads instead of copying them, and
    linears run on packed weights (the drafter's in the target's dtype) where that is the faster exact setting."""
    with grouped_attention(target), packed_for_the_call(target, drafting, packed_linears):
        yield


def transformers_release(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of the installed transformers (or of ``version``)."""
    major, minor = (version or transformers.__version__).split(".")[:2]
    return int(major), int(minor)


def _uses_dflash(assistant_model, generation_config=None) -> bool:
    if not is_drafter(assistant_model):
        return False
    return generation_config is None or getattr(generation_config, "speculation_type", None) != "dflash"


def _wrap_extract(original):
    @functools.wraps(original)
    def extract(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer):
        if custom_generate is not None:  # its own keyword arguments (dflash_* for ours) are passed on to it
            return original(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer)
        options = {name: kwargs.pop(name) for name in list(kwargs) if name in OPTION_KWARGS}
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
        if not _uses_dflash(generation_mode_kwargs.get("assistant_model"), generation_config):
            return original(self, generation_mode, generation_config, generation_mode_kwargs)
        check_decoding_mode(generation_mode, (GenerationMode.ASSISTED_GENERATION,))
        if generation_mode_kwargs.get("assistant_tokenizer") is not None:
            raise ValueError("A DFlash drafter shares the target's tokenizer; do not pass `assistant_tokenizer`.")
        without_assistant = {key: value for key, value in generation_mode_kwargs.items()
                             if key not in ("assistant_model", "dflash_options")}
        return original(self, generation_mode, generation_config, without_assistant)

    return validate


def _wrap_assisted_decoding(original):
    @functools.wraps(original)
    def assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        drafter = kwargs.get("assistant_model")
        if not _uses_dflash(drafter, generation_config):
            kwargs.pop("dflash_options", None)
            return original(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs)
        options = kwargs.pop("dflash_options", {})
        streamer = kwargs.pop("streamer", None)
        return decode(self, kwargs.pop("assistant_model"), input_ids, logits_processor, stopping_criteria,
                      generation_config, model_kwargs=kwargs, options=options, streamer=streamer)

    return assisted_decoding


def _wrap_generate_refusing_drafters(original, release: tuple[int, int]):
    """On a transformers release the private route was not tested with: refuse a DFlash drafter as
    ``assistant_model`` (never guess), leave every other call alone."""
    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if _uses_dflash(kwargs.get("assistant_model"), kwargs.get("generation_config")):
            supported = ", ".join(f"{major}.{minor}" for major, minor in SUPPORTED_TRANSFORMERS)
            raise ValueError(f"dflash2-hf routes assistant_model=<DFlash drafter> through transformers internals it "
                             f"was tested with on transformers {supported}; this is {release[0]}.{release[1]}. Use "
                             "the public seam instead: generate(..., custom_generate=dflash2_hf.custom_generate, "
                             "drafter=drafter), or install a supported transformers.")
        return original(self, *args, **kwargs)

    return generate


def assistant_route_installed() -> bool:
    """Whether ``generate(assistant_model=<DFlash drafter>)`` runs DFlash decoding in this process."""
    return getattr(GenerationMixin.__dict__.get("_assisted_decoding"), "__dflash2_hf__", False)


def custom_generate_source() -> str | None:
    """The folder or Hub repo id the running ``generate(custom_generate="...")`` call named, or None.

    transformers hands the function it loads from ``custom_generate/generate.py`` the call's arguments but not the
    repository they came from; it is read from the calling ``generate`` frame (the local ``custom_generate`` of
    ``transformers.generation.utils``). Any other shape of the stack gives None, and the caller asks for ``drafter=``.
    """
    named = calling_generate_argument("custom_generate")
    return named if isinstance(named, str) else None


def calling_generate_argument(name: str) -> object:
    """The argument ``name`` of the innermost running transformers ``generate`` call, read from its frame (what
    transformers keeps from a ``custom_generate`` callable), or None outside such a call."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "generate" and frame.f_globals.get("__name__") == "transformers.generation.utils":
                return frame.f_locals.get(name)
            frame = frame.f_back
        return None
    finally:
        del frame  # no reference cycle through the stack


#: ``generate`` arguments transformers keeps from a ``custom_generate`` callable, with what to do instead.
WITHHELD_FROM_THE_SEAM = {
    "streamer": "stream with generate(..., assistant_model=drafter, streamer=...), which hands the streamer over",
    "assistant_model": "pass the drafter once: drafter= with custom_generate, or assistant_model= alone",
    "synced_gpus": "DFlash decoding runs one process per generation; leave synced_gpus unset",
}


def check_nothing_withheld() -> None:
    """Refuse, before decoding, a ``generate`` argument transformers did not forward to the seam (a streamer that
    would never hear a token, nor ``end()``), naming it and what to do instead."""
    for name, instead in WITHHELD_FROM_THE_SEAM.items():
        if calling_generate_argument(name) not in (None, False):
            raise ValueError(f"transformers does not hand `{name}` to custom_generate=dflash2_hf.custom_generate, so "
                             f"it would be ignored: {instead}.")


def install(release: tuple[int, int] | None = None) -> None:
    """Set up the ``assistant_model`` route for the installed transformers (idempotent; ``release`` overrides the
    detected version, for tests)."""
    release = release or transformers_release()
    if release not in SUPPORTED_TRANSFORMERS:
        wrappers = {"generate": functools.partial(_wrap_generate_refusing_drafters, release=release)}
    elif GENERATION_MODES_MAPPING.get(GenerationMode.ASSISTED_GENERATION) != "_assisted_decoding":
        raise RuntimeError("transformers no longer routes assisted generation through `_assisted_decoding`; "
                           "use generate(..., custom_generate=dflash2_hf.custom_generate, drafter=drafter).")
    else:
        wrappers = {"_extract_generation_mode_kwargs": _wrap_extract, "_validate_generation_mode": _wrap_validate,
                    "_assisted_decoding": _wrap_assisted_decoding}
    for name, wrap in wrappers.items():
        current = getattr(GenerationMixin, name)
        if not getattr(current, "__dflash2_hf__", False):
            wrapped = wrap(current)
            wrapped.__dflash2_hf__ = True
            setattr(GenerationMixin, name, wrapped)


def uninstall() -> None:
    """Put every wrapped ``GenerationMixin`` method back as transformers defined it (the public seam keeps working)."""
    for name in (*PATCHED_METHODS, "generate"):
        current = GenerationMixin.__dict__.get(name)
        if getattr(current, "__dflash2_hf__", False):
            setattr(GenerationMixin, name, current.__wrapped__)
