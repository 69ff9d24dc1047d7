"""Write golden fixtures from the authors' reference implementation (PyPI ``dflash`` 0.1.0) for parity tests.

The reference pins transformers 5.15.0, so it runs in a virtual environment of its own::

    python -m venv .venv-reference
    .venv-reference/bin/pip install torch==2.13.0 dflash==0.1.0 transformers==5.15.0
    .venv-reference/bin/python scripts/make_reference_fixtures.py tests/fixtures/reference

It builds a tiny random Qwen3 target and tiny DFlash v1 / DFlash 2 drafters with the reference classes, saves their
weights in the published layouts (safetensors), and records the reference's block hidden states, logits, selector
choices, and its greedy ``spec_generate`` output with the block drafted in every cycle, in ``golden.safetensors``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from dflash.model import DFlash2DraftModel, DFlashDraftModel, extract_context_feature
from safetensors.torch import save_file
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

VOCAB, HIDDEN, TARGET_LAYERS = 96, 64, 4
PROMPT_LENGTH, BLOCK, NEW_TOKENS = 12, 8, 24


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter (norm gains around 1) random values so no path of the model is trivial."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)


def target_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
    )


def drafter_config(dflash2: bool) -> Qwen3Config:
    dflash = {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 2], "block_size": BLOCK}
    extra = {"layer_types": ["full_attention", "full_attention"]}
    if dflash2:
        dflash |= {
            "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4,
            "output_multiplier": 0.5, "final_logit_softcapping": 6.0,
        }
        extra = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
                 "use_sliding_window": True, "is_causal": False}
    return Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_target_layers=TARGET_LAYERS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dflash_config=dflash, **extra,
    )


def save_published_layout(model: torch.nn.Module, folder: Path, architecture: str) -> None:
    """Save config.json and model.safetensors as the published checkpoints are laid out (bare codebooks)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.update(architectures=[architecture], dtype="float32")
    config.pop("auto_map", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name.removesuffix(".weight") if "codebook" in name else name: t.contiguous()
               for name, t in model.state_dict().items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@torch.inference_mode()
def one_block(drafter, target, prompt: torch.Tensor, anchor: int) -> dict[str, torch.Tensor]:
    """The reference's first drafting step after prefill: block hidden states, logits and (DFlash 2) its path."""
    output = target(prompt, output_hidden_states=True)
    context = extract_context_feature(output.hidden_states, drafter.target_layer_ids)
    block = torch.tensor([[anchor] + [drafter.mask_token_id] * (BLOCK - 1)])
    scale = float(drafter.config.dflash_config.get("input_embedding_scale", 1.0))
    noise = target.get_input_embeddings()(block) * scale
    positions = torch.arange(PROMPT_LENGTH + BLOCK)[None]
    hidden = drafter(target_hidden=context, noise_embedding=noise, position_ids=positions,
                     past_key_values=DynamicCache(), use_cache=True)[:, 1:]
    result = {"context": context, "hidden": hidden, "logits": drafter.compute_logits(hidden, target.lm_head)}
    if isinstance(drafter, DFlash2DraftModel):
        path, candidates, _ = drafter.propose(hidden, block[:, 0], target.lm_head, 0.0)
        result |= {"path": path, "candidates": candidates}
    return result


@torch.inference_mode()
def greedy_run(drafter, target, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``spec_generate``, recording the drafted tokens of every full-size block (padded rows of -1)."""
    drafts = []
    if isinstance(drafter, DFlash2DraftModel):
        propose = drafter.propose
        def recording(*args, **kwargs):
            result = propose(*args, **kwargs)
            drafts.append(result[0][0].tolist())
            return result
        drafter.propose = recording
    else:
        compute_logits = drafter.compute_logits
        def recording(*args, **kwargs):
            logits = compute_logits(*args, **kwargs)
            drafts.append(logits.argmax(-1)[0].tolist())
            return logits
        drafter.compute_logits = recording
    output = drafter.spec_generate(target, prompt, NEW_TOKENS, stop_token_ids=None)
    full = [d for d in drafts if len(d) == BLOCK - 1]
    return output, torch.tensor(full)


def main(out: Path) -> None:
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(target_config()).eval()
    randomize(target, seed=1)
    target.save_pretrained(out / "target", safe_serialization=True)
    prompt = torch.randint(0, VOCAB - 1, (1, PROMPT_LENGTH), generator=torch.Generator().manual_seed(2))
    golden = {"prompt": prompt}
    for name, cls, architecture, seed in (
        ("dflash_v1", DFlashDraftModel, "DFlashDraftModel", 3),
        ("dflash2", DFlash2DraftModel, "DFlash2DraftModel", 4),
    ):
        drafter = cls(drafter_config(dflash2=cls is DFlash2DraftModel)).eval()
        randomize(drafter, seed=seed)
        save_published_layout(drafter, out / name, architecture)
        for key, value in one_block(drafter, target, prompt, anchor=7).items():
            golden[f"{name}.{key}"] = value
        golden[f"{name}.greedy_output"], golden[f"{name}.greedy_drafts"] = greedy_run(drafter, target, prompt)
    save_file({k: v.contiguous() for k, v in golden.items()}, out / "golden.safetensors")
    print(f"wrote fixtures to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/reference"))
