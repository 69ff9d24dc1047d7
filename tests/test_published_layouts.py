"""Every published drafter config builds, on the meta device, exactly the tensors its checkpoint holds."""

import json
import re

import pytest
import torch
from conftest import PUBLISHED

from dflash2_hf import DFlash2DraftModel, DFlashConfig, DFlashDraftModel
from dflash2_hf.modeling.modeling_dflash import ASSISTANT_KEY_MAPPING

SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def meta_drafter(config_name: str) -> DFlashDraftModel:
    config = DFlashConfig.from_pretrained(PUBLISHED / f"{config_name}.config.json")
    with torch.device("meta"):
        return DFlashDraftModel.class_for_config(config)(config).to(config.dtype)


def our_layout(model: torch.nn.Module) -> dict[str, tuple[list[int], torch.dtype]]:
    return {name: (list(t.shape), t.dtype) for name, t in model.state_dict().items()}


def published_layout(header_name: str) -> dict[str, tuple[list[int], torch.dtype]]:
    header = json.loads((PUBLISHED / f"{header_name}.safetensors-header.json").read_text())
    header.pop("__metadata__", None)
    layout = {}
    for name, entry in header.items():
        for pattern, replacement in ASSISTANT_KEY_MAPPING.items():
            name = re.sub(pattern, replacement, name)
        layout[name] = (entry["shape"], SAFETENSORS_DTYPES[entry["dtype"]])
    return layout


@pytest.mark.parametrize("name", ["muse-glimmer-30b-dflash2", "muse-glimmer-30b-assistant"])
def test_meta_model_has_exactly_the_published_tensors(name):
    ours, published = our_layout(meta_drafter(name)), published_layout(name)
    assert sorted(set(published) - set(ours)) == [], "tensors the model would not load"
    assert sorted(set(ours) - set(published)) == [], "tensors the model would leave random"
    assert {k: v for k, v in ours.items() if published[k] != v} == {}


def test_dflash2_selector_codebooks_are_bare_tensors():
    model = meta_drafter("muse-glimmer-30b-dflash2")
    assert isinstance(model, DFlash2DraftModel)
    names = set(model.state_dict())
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"} <= names
    assert model.candidate_selector.predecessor_codebook.shape == (202048, 256)


@pytest.mark.parametrize("name", ["qwen3-8b-dflash-b16", "qwen3-4b-dflash-b16", "qwen2.5-0.5b-dflash"])
def test_dflash_v1_layout_has_no_prefix_embedding_or_head(name):
    config = DFlashConfig.from_pretrained(PUBLISHED / f"{name}.config.json")
    model = meta_drafter(name)
    hidden, taps = config.hidden_size, len(config.target_layer_ids)
    per_layer = {
        "input_layernorm.weight": [hidden],
        "post_attention_layernorm.weight": [hidden],
        "self_attn.q_proj.weight": [config.num_attention_heads * config.head_dim, hidden],
        "self_attn.k_proj.weight": [config.num_key_value_heads * config.head_dim, hidden],
        "self_attn.v_proj.weight": [config.num_key_value_heads * config.head_dim, hidden],
        "self_attn.o_proj.weight": [hidden, config.num_attention_heads * config.head_dim],
        "self_attn.q_norm.weight": [config.head_dim],
        "self_attn.k_norm.weight": [config.head_dim],
        "mlp.gate_proj.weight": [config.intermediate_size, hidden],
        "mlp.up_proj.weight": [config.intermediate_size, hidden],
        "mlp.down_proj.weight": [hidden, config.intermediate_size],
    }
    expected = {"fc.weight": [hidden, taps * hidden], "hidden_norm.weight": [hidden], "norm.weight": [hidden]}
    for layer in range(config.num_hidden_layers):
        expected |= {f"layers.{layer}.{name}": shape for name, shape in per_layer.items()}
    assert {k: shape for k, (shape, _) in our_layout(model).items()} == expected
    assert all(dtype == torch.bfloat16 for _, dtype in our_layout(model).values())
