"""DFlash / DFlash 2 block drafters as transformers ``PreTrainedModel`` classes.

A drafter predicts a whole block of tokens in one forward pass. Its inputs are

* the target's hidden states at ``config.target_layer_ids`` for every verified token not yet seen by the drafter
  (the *context*), fused by ``fc`` + ``hidden_norm`` and injected as extra keys/values into every drafter layer, and
* the *block*: the target's input embeddings of ``[anchor, mask, ..., mask]`` (anchor = last verified token).

Block queries attend to all context and bidirectionally to each other. The drafter has no embedding or LM head of
its own: callers read logits out with the target's LM head through :meth:`DFlashDraftModel.compute_logits`.

DFlash 2 adds a two-tap grouped dynamic convolution around attention and MLP in each layer, and a candidate selector
head that scores every pair of top-K candidates at adjacent block positions (:class:`CandidateSelector`).

This file only imports torch, transformers and its sibling config module so it can ship as Hub remote code.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)
from transformers.utils import cached_file

from .configuration_dflash import DFlashConfig
from .speculators_format import CHECKPOINT_FORMAT, DRAFT_VOCABULARY_TENSORS, VERIFIER_TENSORS

#: Checkpoint names of transformers' ``MuseGlimmerAssistantModel`` layout -> names used here.
ASSISTANT_KEY_MAPPING = {r"^encoder\.fc\.": "fc.", r"^encoder\.output_norm_enc\.": "hidden_norm."}


class DrafterLoadError(ValueError):
    """A checkpoint does not match the drafter its config describes (missing, unexpected or mis-shaped tensors)."""


def apply_rotary_to_block(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate keys at every context + block position and queries at the trailing block positions only."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_len = query.shape[-2]
    query = query * cos[..., -q_len:, :] + rotate_half(query) * sin[..., -q_len:, :]
    key = key * cos + rotate_half(key) * sin
    return query, key


def block_attention_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, *, causal: bool, sliding_window: int | None
) -> torch.Tensor:
    """Boolean ``[batch, 1, queries, keys]`` mask: True where a block query may attend to a key.

    Keys at earlier positions (the context) are always visible, keys inside the block are visible in both directions
    unless ``causal``; a sliding window keeps keys closer than ``sliding_window`` positions.
    """
    distance = query_positions[:, :, None] - key_positions[:, None, :]
    visible = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
    if sliding_window is not None:
        visible = visible & (distance.abs() < sliding_window)
    return visible[:, None]


class DFlashAttention(nn.Module):
    """Multi-head attention whose keys/values cover the fused target context followed by the block."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = bool(config.is_causal)
        is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if is_sliding else None
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor | None,
        position_ids: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        packed_block_length: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        batch, q_len = hidden_states.shape[:2]
        kv_input = hidden_states if context is None else torch.cat([context, hidden_states], dim=1)
        query = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(kv_input).view(batch, kv_input.shape[1], -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_input).view(batch, kv_input.shape[1], -1, self.head_dim).transpose(1, 2)
        query, key = apply_rotary_to_block(query, key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        if packed_block_length is not None:
            output = self._packed_blocks_attention(query, key, value, attention_mask, position_ids, packed_block_length)
            return self.o_proj(output.reshape(batch, q_len, -1))
        if attention_mask is None or attention_mask.shape[-2] == 1:
            attention_mask = self._default_mask(position_ids, q_len, key.shape[-2], key_padding=attention_mask)
        elif self.is_causal or self.sliding_window is not None:
            # An explicit mask (training packs many blocks) still keeps this layer's causal and window rules, so a
            # block is trained with the attention it drafts with.
            attention_mask = attention_mask & self._layer_rule(position_ids, q_len, key.shape[-2])
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        output, _ = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        return self.o_proj(output.reshape(batch, q_len, -1))

    def _packed_blocks_attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, context_mask: torch.Tensor,
        position_ids: torch.Tensor, block_length: int,
    ) -> torch.Tensor:
        """Attention of many blocks side by side (training), ``[batch, blocks * block_length, heads, head_dim]``.

        Each block's queries see the context keys ``context_mask`` (``[batch, 1, queries, context]``) allows and
        the keys of their own block, under this layer's causal and window rule: what the same block sees when it is
        drafted alone. Scores against other blocks' keys are never computed, so a step's attention grows with the
        blocks times (context + block) instead of with the square of all blocks."""
        batch, heads, queries, dim = query.shape
        blocks, context_len = queries // block_length, key.shape[-2] - queries
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
        query_positions = position_ids[:, context_len:]
        sees_context = context_mask.bool()
        if self.is_causal or self.sliding_window is not None:
            sees_context = sees_context & block_attention_mask(query_positions, position_ids[:, :context_len],
                                                               causal=self.is_causal, sliding_window=self.sliding_window)
        in_block = query_positions.reshape(batch * blocks, block_length)
        sees_block = block_attention_mask(in_block, in_block, causal=self.is_causal, sliding_window=self.sliding_window)
        context_scores = torch.matmul(query, key[:, :, :context_len].transpose(-1, -2)) * self.scaling
        context_scores = context_scores.masked_fill(~sees_context, float("-inf"))
        query_blocks = query.view(batch, heads, blocks, block_length, dim)
        key_blocks = key[:, :, context_len:].view(batch, heads, blocks, block_length, dim)
        block_scores = torch.matmul(query_blocks, key_blocks.transpose(-1, -2)) * self.scaling
        block_scores = block_scores.masked_fill(~sees_block.view(batch, blocks, block_length, block_length)[:, None],
                                                float("-inf"))
        scores = torch.cat([context_scores.view(batch, heads, blocks, block_length, context_len), block_scores], -1)
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        weights = F.dropout(weights, p=self.attention_dropout, training=self.training)
        from_context = torch.matmul(weights[..., :context_len].reshape(batch, heads, queries, context_len),
                                    value[:, :, :context_len])
        from_block = torch.matmul(weights[..., context_len:], value[:, :, context_len:].view(*key_blocks.shape))
        return (from_context + from_block.reshape(batch, heads, queries, dim)).transpose(1, 2)

    def _default_mask(
        self, position_ids: torch.Tensor, q_len: int, k_len: int, key_padding: torch.Tensor | None
    ) -> torch.Tensor | None:
        """All context, the block bidirectionally (or causally), within the sliding window, minus padded keys."""
        has_rule = self.is_causal or self.sliding_window is not None
        mask = self._layer_rule(position_ids, q_len, k_len) if has_rule else None
        if key_padding is not None:
            mask = key_padding if mask is None else mask & key_padding
        return mask

    def _layer_rule(self, position_ids: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
        """This layer's causal and sliding-window rule over its keys. Keys are at ``position_ids`` when there is one
        key per position (no cache: training's packed blocks); cached keys are contiguous and end at the last new
        position."""
        if k_len == position_ids.shape[-1]:
            key_positions = position_ids
        else:
            key_positions = position_ids[:, -1:] - k_len + 1 + torch.arange(k_len, device=position_ids.device)
        return block_attention_mask(
            position_ids[:, -q_len:], key_positions, causal=self.is_causal, sliding_window=self.sliding_window
        )


class GroupedDynamicConv(nn.Module):
    """DFlash 2's two-stage grouped dynamic causal convolution along the block.

    ``prepare`` convolves the normalised layer input with ``base_kernel[0]`` plus a per-token kernel projected from
    that input, and returns the second-stage kernel; ``finish`` convolves the sublayer's output with
    ``base_kernel[1]`` plus that second-stage kernel. Each of the ``kernel_size`` taps mixes position ``t - tap``
    into ``t`` with one static weight per channel and one dynamic weight per channel group.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def _convolve(
        self, hidden: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block_length: int | None = None
    ) -> torch.Tensor:
        if block_length is not None and block_length != hidden.shape[1]:
            # Several blocks side by side (training): convolve each block on its own, nothing leaks across.
            batch, length, hidden_size = hidden.shape
            blocks = hidden.reshape(batch * (length // block_length), block_length, hidden_size)
            kernels = dynamic.reshape(blocks.shape[0], block_length, *dynamic.shape[2:])
            return self._convolve(blocks, kernels, base).reshape(batch, length, hidden_size)
        batch, length, hidden_size = hidden.shape
        taps = torch.stack(
            [F.pad(hidden[:, : length - tap], (0, 0, tap, 0)) for tap in range(self.kernel_size)], dim=2
        ).view(batch, length, self.kernel_size, self.groups, self.group_size)
        weight = base.view(1, 1, self.kernel_size, self.groups, self.group_size).to(hidden.dtype) + dynamic[..., None]
        return (weight * taps).sum(dim=2).view(batch, length, hidden_size)

    def prepare(self, hidden: torch.Tensor, block_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(hidden, dynamic[..., 0, :, :], self.base_kernel[0], block_length), dynamic[..., 1, :, :]

    def finish(self, hidden: torch.Tensor, dynamic: torch.Tensor, block_length: int | None = None) -> torch.Tensor:
        return self._convolve(hidden, dynamic, self.base_kernel[1], block_length)


class DFlashDecoderLayer(nn.Module):
    """Pre-norm attention + MLP block; DFlash 2 wraps each sublayer in a :class:`GroupedDynamicConv`."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.conv_kernel_size is not None:
            self.attention_conv = GroupedDynamicConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
            self.mlp_conv = GroupedDynamicConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
        else:
            self.attention_conv = self.mlp_conv = None

    @staticmethod
    def _sublayer(
        conv: GroupedDynamicConv | None, sublayer, hidden: torch.Tensor, block_length: int | None, **kwargs: Any
    ) -> torch.Tensor:
        if conv is None:
            return sublayer(hidden, **kwargs)
        hidden, second_stage = conv.prepare(hidden, block_length)
        return conv.finish(sublayer(hidden, **kwargs), second_stage, block_length)

    def forward(self, hidden_states: torch.Tensor, block_length: int | None = None, **attention_kwargs: Any) -> torch.Tensor:
        hidden_states = hidden_states + self._sublayer(
            self.attention_conv, self.self_attn, self.input_layernorm(hidden_states), block_length,
            packed_block_length=block_length, **attention_kwargs
        )
        return hidden_states + self._sublayer(
            self.mlp_conv, self.mlp, self.post_attention_layernorm(hidden_states), block_length
        )


class CandidateSelector(nn.Module):
    """DFlash 2's pair scorer over the top-K candidate lattice.

    The score of candidate ``b`` at block position ``i`` following token ``a`` is the drafter's own logit for ``b``
    plus a context-gated bilinear term ``sum_r P[a, r] * (W h_i)[r] * S[b, r]``: ``P`` / ``S`` are the predecessor /
    successor codes of the tokens and ``W`` projects the drafter's hidden state at position ``i`` to the selector rank.

    The published selector keeps ``P`` and ``S`` as two bare ``[vocab, rank]`` codebooks. With
    ``config.selector_factorised`` they are derived from the target's frozen input embedding matrix ``E``:
    ``P = E @ A`` and ``S = E @ B`` with learned ``[hidden, rank]`` projections ``A`` / ``B``
    (``predecessor_projection`` / ``successor_projection``), so the selector holds ``3 * hidden * rank`` parameters
    whatever the vocabulary. ``E`` is not a weight of the drafter: callers pass it to :meth:`pair_scores`.
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        rank = int(config.selector_rank)
        self.top_k = int(config.selector_top_k)
        self.factorised = bool(config.selector_factorised)
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)
        if self.factorised:
            self.predecessor_projection = nn.Linear(config.hidden_size, rank, bias=False)
            self.successor_projection = nn.Linear(config.hidden_size, rank, bias=False)
        else:
            self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
            self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))

    def _embedding_table(self, embedding_table: torch.Tensor | None) -> torch.Tensor:
        """The target's input embedding matrix a factorised selector reads, checked, in the projections' dtype."""
        width = self.predecessor_projection.in_features
        if embedding_table is None:
            raise ValueError(
                "This candidate selector is factorised: its token codes come from the target's input embeddings; "
                "pass embedding_table=target.get_input_embeddings().weight."
            )
        if embedding_table.dim() != 2 or embedding_table.shape[1] != width:
            raise ValueError(
                f"embedding_table must be the target's [vocab, {width}] input embedding matrix, "
                f"got shape {list(embedding_table.shape)}."
            )
        return embedding_table.to(self.predecessor_projection.weight.dtype)

    def token_codes(
        self, predecessor_ids: torch.Tensor, candidate_ids: torch.Tensor, embedding_table: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Predecessor codes of ``predecessor_ids`` and successor codes of ``candidate_ids`` (``[..., rank]`` each).

        A factorised selector embeds the tokens with ``embedding_table`` and projects only those rows, never the
        whole vocabulary.
        """
        if not self.factorised:
            predecessors = F.embedding(predecessor_ids, self.predecessor_codebook)
            return predecessors, F.embedding(candidate_ids, self.successor_codebook)
        table = self._embedding_table(embedding_table)
        predecessors = self.predecessor_projection(F.embedding(predecessor_ids, table))
        return predecessors, self.successor_projection(F.embedding(candidate_ids, table))

    def codebooks(self, embedding_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The full ``[vocab, rank]`` predecessor and successor codebooks, in float32.

        For a factorised selector these are ``E @ A`` and ``E @ B`` computed from ``embedding_table``: the codebooks a
        full-codebook selector needs to score exactly as this one does (what the published layout stores).
        """
        if not self.factorised:
            return self.predecessor_codebook.float(), self.successor_codebook.float()
        table = self._embedding_table(embedding_table).float()
        return (F.linear(table, self.predecessor_projection.weight.float()),
                F.linear(table, self.successor_projection.weight.float()))

    def pair_scores(
        self,
        hidden: torch.Tensor,
        predecessor_ids: torch.Tensor,
        candidate_ids: torch.Tensor,
        candidate_logits: torch.Tensor,
        embedding_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Score every (predecessor, candidate) pair at every block position in one batched op.

        Args:
            hidden: drafter hidden states of the drafted positions, ``[batch, positions, hidden]``.
            predecessor_ids: tokens that may precede each position, ``[batch, positions, P]``.
            candidate_ids: candidate tokens per position, ``[batch, positions, K]``.
            candidate_logits: the drafter's logits of those candidates, ``[batch, positions, K]``.
            embedding_table: the target's input embedding matrix ``[vocab, hidden]``
                (``target.get_input_embeddings().weight``); required by a factorised selector, unused otherwise.

        Returns:
            ``[batch, positions, P, K]`` scores.
        """
        gate = self.hidden_projection(hidden)
        predecessors, successors = self.token_codes(predecessor_ids, candidate_ids, embedding_table)
        follow = torch.einsum("blpr,blr,blkr->blpk", predecessors, gate.to(predecessors.dtype), successors)
        return candidate_logits[:, :, None, :] + follow.to(candidate_logits.dtype)


#: safetensors dtype names of floating-point tensors: the only kind a drafter's weights may be stored as.
FLOATING_SAFETENSORS_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
#: Tensors stored as something else: the draft vocabulary's token ids (speculators': offsets to them).
STORED_DTYPES = {"draft_vocabulary": {"I64", "I32"}, "d2t": {"I64", "I32"}}


def _checkpoint_files(location: Any, hub_kwargs: dict) -> list[str]:
    """The safetensors files a drafter was loaded from: every one in a local folder, else the Hub repository's
    single ``model.safetensors`` as cached (none found: an empty list)."""
    location = os.fspath(location)
    if os.path.isdir(location):
        return [os.path.join(location, name) for name in sorted(os.listdir(location)) if name.endswith(".safetensors")]
    try:
        found = cached_file(location, "model.safetensors", **hub_kwargs)
    except OSError:  # sharded, or not on the Hub: loading itself read the files and found nothing amiss
        return []
    return [found] if found else []


def stored_dtypes(path: str) -> dict[str, str]:
    """Each tensor's dtype as a safetensors file stores it (read from its JSON header, no tensor loaded)."""
    with open(path, "rb") as file:
        header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
    return {name: entry["dtype"] for name, entry in header.items() if name != "__metadata__"}


def check_stored_dtypes(location: Any, hub_kwargs: dict, not_loaded: frozenset[str] = frozenset()) -> None:
    """Refuse a checkpoint storing a weight as anything but floating point (an integer ``fc.weight`` would
    otherwise be cast to float on load and draft silently wrong), naming the tensor; ``not_loaded``: tensors of the
    file that the drafter does not load (a speculators checkpoint's integer vocabulary maps)."""
    for path in _checkpoint_files(location, hub_kwargs):
        wrong = {name: dtype for name, dtype in stored_dtypes(path).items()
                 if dtype not in STORED_DTYPES.get(name, FLOATING_SAFETENSORS_DTYPES) and name not in not_loaded}
        if wrong:
            named = "; ".join(f"{name} as {dtype}, where {_expected_storage(name)} belongs"
                              for name, dtype in sorted(wrong.items()))
            raise DrafterLoadError(f"Checkpoint at {location} stores {named}; save the drafter again from the "
                                   "trained model.")


def _expected_storage(name: str) -> str:
    """What a tensor of this name is stored as, in words: integer token ids or offsets, or floating-point weights."""
    if name in STORED_DTYPES:
        return f"an integer tensor ({' or '.join(sorted(STORED_DTYPES[name]))}: token ids or offsets)"
    return "floating point (a weight)"


def check_draft_vocabulary(model: nn.Module, location: Any) -> None:
    """Refuse a draft vocabulary that is not distinct ids of the target's vocabulary, which would draft tokens the
    target does not have or waste rows of the draft head on one token."""
    ids = getattr(model, "draft_vocabulary", None)
    if ids is None:
        return
    vocab = model.config.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != ids.numel():
        raise DrafterLoadError(f"Checkpoint at {location} has a draft_vocabulary that is not {ids.numel()} distinct "
                               f"token ids below vocab_size {vocab}; save the drafter again.")


def refuse_meta_device_map(device_map: Any) -> None:
    """Refuse loading a drafter (or any of its modules) onto the meta device: it would hold no weights to draft
    with, and transformers fails there with an error that names neither the drafter nor the fix."""
    places = device_map.values() if isinstance(device_map, dict) else [device_map]
    if any(place is not None and str(place) == "meta" for place in places):
        raise DrafterLoadError("A drafter loaded with device_map='meta' has no weights to draft with; load it on the "
                               "target's device (device_map=None, 'cpu' or the target's GPU).")


def layout_of(config: DFlashConfig) -> tuple[dict[str, str], frozenset[str]]:
    """How a checkpoint of ``config``'s layout loads: the tensor renames (transformers' ``key_mapping``) and the
    tensors it stores that the drafter does not load. transformers' assistant layout renames two modules; a
    speculators checkpoint's verifier-owned tensors stay unloaded, except a draft vocabulary's head and offsets,
    which become ``draft_head`` and ``draft_vocabulary``."""
    if "MuseGlimmerAssistantModel" in (config.architectures or []):
        return ASSISTANT_KEY_MAPPING, frozenset()
    if getattr(config, "checkpoint_format", None) != CHECKPOINT_FORMAT:
        return {}, frozenset()
    if config.draft_vocab_size is None:
        return {}, VERIFIER_TENSORS
    renamed = {"^" + name.replace(".", r"\.") + "$": ours for name, ours in DRAFT_VOCABULARY_TENSORS.items()}
    return renamed, VERIFIER_TENSORS - set(DRAFT_VOCABULARY_TENSORS)


def _describe_key(entry: Any) -> str:
    """A loading-report entry as text: a tensor name, or ``name (checkpoint shape vs model shape)``."""
    if isinstance(entry, tuple) and len(entry) == 3:
        name, checkpoint_shape, model_shape = entry
        return f"{name} (checkpoint {list(checkpoint_shape)} vs model {list(model_shape)})"
    return str(entry)


class DFlashPreTrainedModel(PreTrainedModel):
    """Weight init, strict loading and Hub plumbing shared by the drafter classes."""

    config_class = DFlashConfig
    config: DFlashConfig
    base_model_prefix = "drafter"
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_attention_backend = True

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, GroupedDynamicConv):
            # Start as the identity: full weight on the current position, nothing from earlier positions.
            init.zeros_(module.base_kernel)
            with torch.no_grad():
                init.ones_(module.base_kernel[:, 0])
        elif isinstance(module, CandidateSelector) and not module.factorised:  # its projections are nn.Linear
            init.normal_(module.predecessor_codebook, mean=0.0, std=std)
            init.normal_(module.successor_codebook, mean=0.0, std=std)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any):
        """Load a drafter from any published layout, refusing partial or mis-shaped checkpoints.

        The class is picked from the config (DFlash 2 when it has a candidate selector); checkpoints in transformers'
        ``MuseGlimmerAssistantModel`` layout are renamed on load, and a speculators checkpoint's verifier-owned
        tensors (``modeling.speculators_format.VERIFIER_TENSORS``) are left unloaded. Only safetensors files are read.
        """
        refuse_meta_device_map(kwargs.get("device_map"))
        config = kwargs.pop("config", None)
        hub_kwargs = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only") if k in kwargs}
        # Duck-typed: as Hub remote code, the config class may come from another copy of this module.
        if not isinstance(config, PreTrainedConfig) or not hasattr(config, "is_dflash2"):
            config = DFlashConfig.from_pretrained(config or pretrained_model_name_or_path, **hub_kwargs)
        model_class = cls.class_for_config(config)
        key_mapping, not_loaded = layout_of(config)
        if key_mapping:
            kwargs.setdefault("key_mapping", key_mapping)
        kwargs.setdefault("use_safetensors", True)
        kwargs.setdefault("ignore_mismatched_sizes", True)  # reported below as an error, with the shapes
        wants_info = kwargs.pop("output_loading_info", False)
        try:
            model, info = super(DFlashPreTrainedModel, model_class).from_pretrained(
                pretrained_model_name_or_path, *model_args, config=config, output_loading_info=True, **kwargs
            )
        except Exception as error:
            # safetensors' error type is not importable from torch/transformers (remote-code rule): match its name.
            if type(error).__name__ != "SafetensorError":
                raise
            raise DrafterLoadError(
                f"The safetensors file at {pretrained_model_name_or_path} is truncated or corrupt ({error}); "
                "download or save it again."
            ) from error
        check_stored_dtypes(pretrained_model_name_or_path, hub_kwargs, not_loaded)
        problems = [
            f"{kind.replace('_', ' ')}: {', '.join(sorted(map(_describe_key, info.get(kind) or [])))}"
            for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
            if info.get(kind)
        ]
        if problems:
            raise DrafterLoadError(f"Checkpoint at {pretrained_model_name_or_path} does not match its config: " + "; ".join(problems))
        broken = [name for name, tensor in model.state_dict().items()
                  if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
        if broken:
            raise DrafterLoadError(f"Checkpoint at {pretrained_model_name_or_path} has NaN or Inf values in: {', '.join(broken)}.")
        if "draft_vocabulary" in key_mapping.values():  # speculators stores offsets: target id = row + offset
            model.draft_vocabulary += torch.arange(model.draft_vocabulary.numel(), device=model.draft_vocabulary.device)
        check_draft_vocabulary(model, pretrained_model_name_or_path)
        if "key_mapping" in kwargs:
            # transformers would replay the renaming backwards on save; always save in this class's own layout.
            model.__dict__.pop("_weight_conversions", None)
        return (model, info) if wants_info else model

    @classmethod
    def class_for_config(cls, config: DFlashConfig) -> type[DFlashDraftModel]:
        """The drafter class a config describes; raises if ``cls`` is more specific than the config."""
        model_class = DFlash2DraftModel if config.is_dflash2 else DFlashDraftModel
        if not issubclass(model_class, cls):
            raise ValueError(f"{cls.__name__} needs a DFlash 2 config (conv_* and selector_* fields); this config is DFlash v1.")
        return model_class


class DFlashDraftModel(DFlashPreTrainedModel):
    """A DFlash block drafter; DFlash 2 components are built when the config asks for them."""

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.candidate_selector = CandidateSelector(config) if config.is_dflash2 else None
        draft_vocab = config.draft_vocab_size
        self.draft_head = None if draft_vocab is None else nn.Linear(config.hidden_size, draft_vocab, bias=False)
        # The target id of each draft-vocabulary token (row of draft_head), saved with the weights.
        self.register_buffer("draft_vocabulary", None if draft_vocab is None else torch.arange(draft_vocab))
        self.gradient_checkpointing = False
        self.post_init()
        # The tensors a checkpoint of this config's layout stores for the verifier (a speculators checkpoint's t2d,
        # say) are left unloaded on purpose: transformers' load report is not to call them unexpected.
        self._keys_to_ignore_on_load_unexpected = {"^" + name.replace(".", r"\.") + "$" for name in layout_of(config)[1]}

    @property
    def block_size(self) -> int:
        return int(self.config.block_size)

    @property
    def mask_token_id(self) -> int:
        return int(self.config.mask_token_id)

    @property
    def target_layer_ids(self) -> list[int]:
        return [int(i) for i in self.config.target_layer_ids]

    def fuse_context(self, context_hidden_states: torch.Tensor) -> torch.Tensor:
        """Fuse the concatenated target features ``[batch, tokens, n_taps * hidden]`` into drafter width."""
        return self.hidden_norm(self.fc(context_hidden_states))

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        block_length: int | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """Run the drafter over one block (or, in training, many blocks) of embeddings.

        Args:
            noise_embeds: the target's input embeddings of ``[anchor, mask, ...]`` (times
                ``config.input_embedding_scale``), ``[batch, block, hidden]``.
            context_hidden_states: target features of tokens new to the drafter, concatenated over
                ``config.target_layer_ids``, ``[batch, context, n_taps * hidden]``; ``None`` for no new context.
            position_ids: absolute positions of the context tokens followed by the block, ``[batch, context + block]``.
            attention_mask: optional boolean ``[batch, 1, block, keys]`` mask of the keys each query may see, in place
                of "all context", still under each layer's causal and sliding-window rule; or a 2D ``[batch, keys]``
                padding mask combined with the default. With ``block_length``: ``[batch, 1, blocks * block,
                context]``, the context keys each packed block's queries may see.
            cache: cache of earlier context keys/values. It receives this call's context *and* block keys;
                the caller crops the block away before the next call.
            block_length: with several blocks side by side (training), the length of each: every block attends to
                the context keys ``attention_mask`` allows and to itself, never to another block, and DFlash 2's
                convolutions stay inside it; ``None`` for one block.
        """
        if block_length is not None and (attention_mask is None or attention_mask.dim() != 4 or cache is not None):
            raise ValueError("Packed blocks (block_length) need a [batch, 1, queries, context] attention_mask of the "
                             "context keys each block sees, and no cache.")
        if attention_mask is not None and attention_mask.dim() == 2:
            # A 2D padding mask over [cached + context + block] keys, as transformers' DFlash generator passes it.
            attention_mask = None if bool(attention_mask.all()) else attention_mask.bool()[:, None, None, :]
        context = None if context_hidden_states is None else self.fuse_context(context_hidden_states)
        context_len = 0 if context is None else context.shape[1]
        if position_ids is None:
            start = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(start, start + context_len + noise_embeds.shape[1], device=noise_embeds.device)
            position_ids = position_ids.expand(noise_embeds.shape[0], -1)
        position_embeddings = self.rotary_emb(noise_embeds, position_ids)
        hidden_states = noise_embeds
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                context=context,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                cache=cache,
                block_length=block_length,
                **kwargs,
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)

    def output_head(self, output_embeddings: nn.Module) -> nn.Module:
        """The head drafted positions' logits come from: the drafter's own over its draft vocabulary, if it has one,
        else the target's LM head (``output_embeddings``)."""
        return output_embeddings if self.draft_head is None else self.draft_head

    def target_token_ids(self, head_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of indices into :meth:`output_head`'s logits (the same ids without a draft vocabulary)."""
        return head_ids if self.draft_vocabulary is None else self.draft_vocabulary[head_ids]

    def head_token_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Indices into :meth:`output_head`'s logits of target token ids; negative where the head has no row for the
        id (outside the draft vocabulary, or a negative label, which is kept as it is without a draft vocabulary)."""
        if self.draft_vocabulary is None:
            return target_ids
        rows = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=target_ids.device)
        rows[self.draft_vocabulary.to(target_ids.device)] = torch.arange(self.draft_vocabulary.numel(), device=rows.device)
        return torch.where(target_ids >= 0, rows[target_ids.clamp_min(0)], -1)

    def compute_logits(self, hidden_states: torch.Tensor, output_embeddings: nn.Module) -> torch.Tensor:
        """Logits of drafted positions through :meth:`output_head` (the target's LM head, or the drafter's own over its
        draft vocabulary), with the configured multiplier and soft cap. The positions go through the head as one
        matrix: a strided 3-D input (a slice of the block) would make torch multiply by a copy of the head per row."""
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        head = self.output_head(output_embeddings)
        logits = head(flat).view(*hidden_states.shape[:-1], -1) * float(self.config.output_multiplier)
        softcap = self.config.final_logit_softcapping
        if softcap:
            logits = torch.tanh(logits / float(softcap)) * float(softcap)
        return logits


class DFlash2DraftModel(DFlashDraftModel):
    """A DFlash 2 drafter: :class:`DFlashDraftModel` with convolutions and the :class:`CandidateSelector` head."""

    def __init__(self, config: DFlashConfig):
        if not config.is_dflash2 or config.conv_kernel_size is None:
            raise ValueError("DFlash2DraftModel needs conv_kernel_size, conv_group_size and selector_rank in its config.")
        super().__init__(config)


DFlashDraftModel.register_for_auto_class("AutoModel")
DFlashConfig.register_for_auto_class()

__all__ = [
    "CandidateSelector",
    "DFlash2DraftModel",
    "DFlashDraftModel",
    "DFlashPreTrainedModel",
    "DrafterLoadError",
    "GroupedDynamicConv",
]
