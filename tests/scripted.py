"""A drafter that drafts a known continuation, to exercise acceptance of long prefixes deterministically.

This is a test double of *our* drafter only: it runs the real drafter forward pass (so caches and positions are
exercised) and then replaces the drafted logits with a script: the true next tokens, except at chosen positions.
"""

from __future__ import annotations

import torch

from dflash2_hf import DFlash2DraftModel


class ScriptedDrafter(DFlash2DraftModel):
    script: list[int] = []
    wrong_positions: set[int] = set()

    def forward(self, noise_embeds, context_hidden_states=None, position_ids=None, **kwargs):
        self._anchor_position = int(position_ids[0, -noise_embeds.shape[1]])
        return super().forward(noise_embeds, context_hidden_states=context_hidden_states, position_ids=position_ids, **kwargs)

    def compute_logits(self, hidden_states, output_embeddings):
        logits = super().compute_logits(hidden_states, output_embeddings)
        scripted = torch.zeros_like(logits)
        for offset in range(logits.shape[1]):
            position = self._anchor_position + 1 + offset
            if position < len(self.script):
                token = self.script[position]
                if position in self.wrong_positions:
                    token = (token + 1) % logits.shape[-1]
                scripted[0, offset, token] = 30.0
        return logits + scripted


def scripted_drafter(base: DFlash2DraftModel, script: list[int], wrong_positions=()) -> ScriptedDrafter:
    drafter = ScriptedDrafter(base.config)
    drafter.load_state_dict(base.state_dict())
    drafter.script = list(script)
    drafter.wrong_positions = set(wrong_positions)
    return drafter.eval()
