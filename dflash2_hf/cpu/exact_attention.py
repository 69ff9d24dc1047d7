"""Exact greedy decoding in bf16: an attention whose result does not depend on how many tokens a forward holds.

Speculative decoding verifies many tokens in one target forward; plain decoding runs one token per forward. In
fp32 both give the same logits closely enough that greedy output is identical. In bf16 they need not: the stock
attention kernels (sdpa, eager) reduce over keys in an order that depends on the block's shape, and a rounding
difference in bf16 can flip a near-tie, after which the two decodings go separate ways.

The attention registered here, :data:`EXACT_ATTENTION`, computes the scores, the softmax and the weighted sum of
values in float64 and rounds once, at the end, to the model's dtype. Differences of summation order then sit near
1e-16, far below bf16's resolution (~4e-3), so each query row gets the same bf16 result in a block as alone (except
for a value lying within ~1e-16 of a bf16 rounding boundary, which at ~1e-14 per value is not seen in practice).
The other layers of a Llama/Qwen2-style model are row-wise already: norms, rotary embeddings and, on CPUs whose
bf16 matmuls give a block's rows what they give each row alone (:func:`~dflash2_hf.cpu.kernels.bf16_rows_independent`
measures it: true of oneDNN on the AMX Xeon measured, not of oneDNN on an AVX512-BF16 AMD EPYC, whose wide layers
round a few values of taller blocks differently), the linear layers, bit for bit. With this attention on the target
of such a CPU, greedy decoding with a drafter gives exactly the tokens plain ``generate`` gives with the same
attention (``tests/test_exact_attention.py``); elsewhere :meth:`ExactAttention.enable` warns that it cannot.

It is an explicit opt-in, for the target only (the drafter's numerics only decide what is proposed): the target
then runs a different, more precise attention than its default, so its output can differ from plain decoding with
sdpa, like any change of attention implementation. It costs float64 work that grows with the context length.

```python
with ExactAttention(target):
    out = target.generate(**inputs, assistant_model=drafter, do_sample=False)  # == target.generate(**inputs, ...)
```
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from .kernels import bf16_rows_independent

EXACT_ATTENTION = "exact_float64"  # no "flash" in it: transformers reads such names as flash-attention kernels
ROWS_ROUND_DIFFERENTLY = (
    "This CPU's bf16 matmuls round some values of a many-token block differently from the same token alone, so the "
    "float64 attention cannot make bf16 decoding with a drafter give plain decoding's tokens here. Load the target "
    "and drafter with dtype=torch.float32, which is exact."
)


def float64_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention in float64, rounded once to the query's dtype (transformers' attention-function signature).

    ``query`` is ``[batch, heads, queries, dim]``, ``key`` / ``value`` ``[batch, kv_heads, keys, dim]``;
    ``attention_mask`` is an additive float mask or a boolean one (``True``: may attend), ``[batch, 1 or heads,
    queries, keys or more]``. Returns ``[batch, queries, heads, dim]`` and no attention weights. The query heads that
    share a key/value head are stacked as rows of one matmul rather than the keys copied once per head (the float64
    copy of the cache is the cost that grows with the context). Inference only: dropout is refused.
    """
    if dropout:
        raise ValueError(f"exact_float64 attention is for inference; it takes no dropout (got {dropout}).")
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads  # query head h reads key/value head h // groups, as transformers' repeat_kv has it
    scale = scaling if scaling is not None else dim**-0.5
    stacked = query.double().reshape(batch, kv_heads, groups * queries, dim)
    scores = torch.matmul(stacked, key.double().transpose(2, 3)).mul_(scale)
    scores = scores.view(batch, kv_heads, groups, queries, keys)
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :keys]
        mask = mask[:, :, None] if mask.shape[1] == 1 else mask.view(mask.shape[0], kv_heads, groups, queries, keys)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    weights = torch.softmax(scores, dim=-1).view(batch, kv_heads, groups * queries, keys)
    output = torch.matmul(weights, value.double()).view(batch, heads, queries, dim).to(query.dtype)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(EXACT_ATTENTION, float64_attention)
AttentionMaskInterface.register(EXACT_ATTENTION, eager_mask)  # an additive float mask, as eager attention takes


class ExactAttention:
    """A model's attention switched to :data:`EXACT_ATTENTION` (``enable``) and back to what it was (``disable``);
    a context manager too. Put it on the target, for ours and the plain baseline alike."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.previous = model.config._attn_implementation

    def enable(self) -> ExactAttention:
        """Make every attention layer of the model run :func:`float64_attention` (remembering the one it ran).
        Warns where a bf16 model on the CPU stays inexact for its linear layers (:data:`ROWS_ROUND_DIFFERENTLY`)."""
        if self.model.device.type == "cpu" and self.model.dtype == torch.bfloat16 and not bf16_rows_independent():
            warnings.warn(ROWS_ROUND_DIFFERENTLY, stacklevel=2)
        current = self.model.config._attn_implementation
        if current != EXACT_ATTENTION:
            self.previous = current
        self.model.set_attn_implementation(EXACT_ATTENTION)
        return self

    def disable(self) -> None:
        """Give the model back the attention it ran before :meth:`enable`."""
        self.model.set_attn_implementation(self.previous)

    def __enter__(self) -> ExactAttention:
        return self.enable()

    def __exit__(self, *exc_info) -> None:
        self.disable()
