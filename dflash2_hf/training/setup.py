"""A drafter to train: its config derived from the target, its starting weights, PEFT's LoRA wrapping.

:func:`drafter_config_for` sizes a fresh drafter after the target (width, heads, RoPE, special tokens, taps spread
evenly over the target's layers); :func:`initialize_from_target` starts it from the target's top layers;
:func:`drafter_to_continue` loads a trained one to continue (upgrading a DFlash v1 drafter to DFlash 2, or giving a
drafter a fresh selector); :func:`with_lora` wraps one for adapter fine-tuning; :func:`fastest_dtype` says in which
dtype the data and training steps compute on this machine.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..cpu.kernels import native_bf16_matmuls
from ..modeling import DFlashConfig, DFlashDraftModel, GroupedDynamicConv, spread_target_layer_ids
from ..drafting.options import with_recommended_plan

#: The ``--dtype`` choices of the data and training commands: ``auto`` is :func:`fastest_dtype`.
DTYPE_CHOICES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def fastest_dtype(choice: str = "auto") -> torch.dtype:
    """The dtype ``choice`` names; ``auto``: bfloat16 on a CUDA GPU or a CPU that computes bf16 matmuls in hardware,
    float32 elsewhere (a CPU without bf16 instructions emulates them, several times slower than float32)."""
    if DTYPE_CHOICES[choice] is not None:
        return DTYPE_CHOICES[choice]
    return torch.bfloat16 if torch.cuda.is_available() or native_bf16_matmuls() else torch.float32


def training_device() -> torch.device:
    """Where the data and training steps run: the first CUDA GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def drafter_config_for(
    target_config,
    mask_token_id: int,
    num_layers: int = 2,
    num_taps: int = 3,
    block_size: int = 16,
    selector_rank: int | None = 64,
    selector_top_k: int = 16,
    intermediate_size: int | None = None,
    selector_factorised: bool = False,
) -> DFlashConfig:
    """A drafter config derived from the target: its width, heads, RoPE and special tokens, taps spread evenly.

    ``selector_factorised`` derives the selector's token codes from the target's input embeddings instead of keeping
    two vocabulary-sized codebooks (``DFlashConfig.selector_factorised``).
    """
    text = target_config.get_text_config()
    dflash2 = selector_rank is not None
    taps = spread_target_layer_ids(text.num_hidden_layers, num_taps)
    if len(set(taps)) < num_taps:
        raise ValueError(f"--taps {num_taps}: the target's {text.num_hidden_layers} layers give {len(set(taps))} "
                         "distinct layers to read (from layer 1 to three before the end); ask for at most that many.")
    config = DFlashConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=intermediate_size or text.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        rms_norm_eps=text.rms_norm_eps,
        rope_parameters=dict(text.rope_parameters),
        max_position_embeddings=text.max_position_embeddings,
        num_target_layers=text.num_hidden_layers,
        target_layer_ids=taps,
        block_size=block_size,
        mask_token_id=mask_token_id,
        conv_kernel_size=2 if dflash2 else None,
        conv_group_size=16 if dflash2 else None,
        selector_rank=selector_rank,
        selector_top_k=selector_top_k,
        selector_factorised=selector_factorised,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
    )
    with_recommended_plan(config)  # what generate runs by default with the drafter trained from it
    return config


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def with_lora(drafter: DFlashDraftModel, rank: int = 8, alpha: int = 16, train_selector: bool = True):
    """Wrap a drafter for PEFT fine-tuning: LoRA on its attention and MLP projections, the selector fully trainable
    (``modules_to_save``), everything else frozen. Save with ``save_pretrained``; load with
    ``PeftModel.from_pretrained(drafter, folder)``."""
    from peft import LoraConfig, get_peft_model

    modules_to_save = ["candidate_selector"] if train_selector and drafter.candidate_selector is not None else None
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=LORA_TARGETS, modules_to_save=modules_to_save)
    return get_peft_model(drafter, config)


@torch.no_grad()
def initialize_from_target(drafter: DFlashDraftModel, target: torch.nn.Module) -> list[str]:
    """Start the drafter from the target's last decoder layers and final norm wherever names and shapes match.

    The drafter reads logits through the target's LM head, so starting from the target's final norm puts its outputs
    on the scale the head expects (a fresh norm makes logits ~10x too large and the first steps are wasted), and the
    target's top layers are a better start for predicting the next tokens than random weights. The context fusion
    starts as the identity on the deepest tap. Returns the names of the drafter parameters that were set.
    """
    decoder = target.get_decoder()
    sources = list(decoder.layers)[-len(drafter.layers) :]
    copied = []
    own = dict(drafter.named_parameters())
    pairs = [(f"layers.{i}.{name}", tensor) for i, layer in enumerate(sources) for name, tensor in layer.state_dict().items()]
    pairs += [(f"norm.{name}", tensor) for name, tensor in decoder.norm.state_dict().items()]
    for name, tensor in pairs:
        if name in own and own[name].shape == tensor.shape:
            own[name].copy_(tensor.to(own[name].dtype))
            copied.append(name)
    # Fuse the context as "the deepest tapped layer's output, normalised the way the first copied layer normalises
    # its input": the copied layers then start out reading the kind of hidden state they were trained on.
    hidden = drafter.config.hidden_size
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, -hidden:] = torch.eye(hidden)
    drafter.hidden_norm.weight.copy_(sources[0].input_layernorm.weight.to(drafter.hidden_norm.weight.dtype))
    return copied + ["fc.weight", "hidden_norm.weight"]


def drafter_to_continue(
    folder: str | Path, selector_rank: int | None = None, selector_top_k: int = 16, new_selector: bool = False,
    selector_factorised: bool = False,
) -> DFlashDraftModel:
    """The drafter a run starts from when it continues a trained one (fp32, strictly loaded).

    A DFlash 2 drafter, or any drafter when ``selector_rank`` is None, is returned as saved. A DFlash v1 drafter with a
    ``selector_rank`` is upgraded to DFlash 2: its weights are kept, the block convolutions start as the identity (so it
    drafts exactly as before) and a fresh candidate selector is added, ready for selector-only training. With
    ``new_selector``, a DFlash 2 drafter's selector is replaced by a fresh one (of ``selector_rank``, factorised or
    not), the rest kept: how two selectors are compared on the same drafter. A drafter that sets no decoding plan of
    its own gets the recommended one (:func:`~dflash2_hf.drafting.options.with_recommended_plan`).
    """
    drafter = DFlashDraftModel.from_pretrained(folder, dtype=torch.float32)
    with_recommended_plan(drafter.config)
    upgrade = not drafter.config.is_dflash2 and selector_rank is not None
    if not (upgrade or new_selector):
        return drafter
    if selector_rank is None:
        raise ValueError("A new candidate selector needs a selector rank (--selector-rank).")
    changes = {"selector_rank": selector_rank, "selector_top_k": selector_top_k,
               "selector_factorised": selector_factorised}
    if upgrade:
        changes |= {"conv_kernel_size": 2, "conv_group_size": 16}
    saved = drafter.config.to_dict()
    saved.update(changes)
    saved.get("dflash_config", {}).update(changes)  # the saved nested copy of the DFlash fields wins over the top level
    config = DFlashConfig.from_dict(saved)
    rebuilt = DFlashDraftModel.class_for_config(config)(config)
    kept = {name: tensor for name, tensor in drafter.state_dict().items() if not name.startswith("candidate_selector.")}
    missing, unexpected = rebuilt.load_state_dict(kept, strict=False)
    not_new = [name for name in missing if not (name.startswith("candidate_selector.") or (upgrade and "_conv." in name))]
    if unexpected or not_new:
        raise ValueError(f"cannot continue {folder} with a new selector: unexpected {unexpected}, missing {not_new}")
    if upgrade:
        with torch.no_grad():
            for module in rebuilt.modules():
                if isinstance(module, GroupedDynamicConv):
                    module.kernel_projection.weight.zero_()  # no dynamic kernel: with the identity base, a no-op
    return rebuilt
