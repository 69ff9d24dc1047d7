"""Grouped-query attention over many query rows without copying the cache once per query head.

A target with grouped-query attention (SmolLM2, Qwen2.5: several query heads share each key/value head) runs
transformers' ``sdpa`` attention. For one query row, plain decoding's step, it lets PyTorch's kernel share the
key/value heads. For a masked forward over many rows, which is what every verification is, it first copies every
layer's cached keys and values once per query head (``repeat_kv``), a copy that grows with the context and that a
CPU pays on each of the target's layers at every cycle.

:data:`GROUPED_SDPA` is the same attention with that copy left out: many-row masked forwards on the CPU call
PyTorch's ``scaled_dot_product_attention`` with ``enable_gqa=True`` (the kernel indexes the shared head instead);
everything else (one row, no mask, other devices, options the shortcut does not cover) goes through transformers'
own ``sdpa`` function unchanged, and the masks are ``sdpa``'s. On the CPU both compute each row the same way: the
results are equal bit for bit (``tests/test_grouped_attention.py``), so greedy decoding stays token-identical to
plain ``generate``.

The DFlash decoder switches a target that runs ``sdpa`` on the CPU to it for the length of one ``generate`` call
(:func:`grouped_attention`) and gives the target its ``sdpa`` back afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_SDPA = "sdpa_grouped"  # no "flash" in it: transformers reads such names as flash-attention kernels


def _shares_heads_directly(module: nn.Module, query: torch.Tensor, attention_mask, kwargs: dict) -> bool:
    """Whether this call is one the shortcut covers: a masked CPU forward over several query rows of a
    grouped-query layer, with no option beyond transformers' plain ``sdpa`` call."""
    return (query.shape[2] > 1 and getattr(module, "num_key_value_groups", 1) > 1 and attention_mask is not None
            and query.device.type == "cpu" and kwargs.get("softcap") is None
            and kwargs.get("position_bias") is None and not kwargs.get("output_attentions", False))


def grouped_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention (same signature and output, ``[batch, queries, heads, dim]``), with the
    key/value heads shared by the kernel rather than copied when a masked CPU forward holds several query rows."""
    if not _shares_heads_directly(module, query, attention_mask, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    mask = attention_mask[:, :, :, : key.shape[-2]]
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


@contextmanager
def grouped_attention(model: nn.Module) -> Iterator[None]:
    """Run ``model`` on :data:`GROUPED_SDPA` inside the block if it runs ``sdpa`` on the CPU (any other attention or
    device is left as it is); its ``sdpa`` is given back on leaving, also after an error."""
    if model.config._attn_implementation != "sdpa" or model.device.type != "cpu":
        yield
        return
    model.set_attn_implementation(GROUPED_SDPA)
    try:
        yield
    finally:
        model.set_attn_implementation("sdpa")
