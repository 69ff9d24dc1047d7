"""Cheap labels: the target's own choices on text it did not write, from one forward and no generation.

A target forward over a conversation gives, at every position, the token the target would pick next given the text
so far (its teacher-forced greedy choice). A drafter's block labels can come from three places
(:data:`LABEL_SOURCES`):

* ``text``: the record's own tokens (the target's answers, or a chat file's replies);
* ``target``: the target's teacher-forced choices at every drafted position;
* ``target-prefix``: as ``target``, with each block's labels stopped after the first position where the text leaves
  the target's greedy choice: past it the block's context is text the target would not have written, so only the
  labels before it (and the target's own correction there) are what decoding from the anchor would have verified.
"""

from __future__ import annotations

import torch

#: Where a block's labels come from (see the module docstring).
LABEL_SOURCES = ("text", "target", "target-prefix")


@torch.no_grad()
def teacher_forced_choices(target: torch.nn.Module, prompt_ids: list[int], response_ids: list[int]) -> list[int]:
    """The target's greedy choice for every response token, given the prompt and the response before it (one
    forward): entry ``i`` is what the target picks where ``response_ids[i]`` stands."""
    if not response_ids:
        return []
    ids = torch.tensor([prompt_ids + response_ids[:-1]], device=target.device)
    logits = target(input_ids=ids, logits_to_keep=len(response_ids)).logits[0]
    return logits.argmax(dim=-1).tolist()


def label_row(record: dict, source: str) -> list[int]:
    """The labels a block reads at each position of ``record``'s prompt and response: its own tokens, or the prompt
    followed by the target's teacher-forced choices (``record["target_choices"]``)."""
    if source == "text":
        return record["prompt_ids"] + record["response_ids"]
    return record["prompt_ids"] + record["target_choices"]


def block_labels(ids: list[int], labels: list[int], anchor: int, block_size: int, source: str) -> list[int]:
    """The labels of the block at ``anchor``: the anchor token itself, then ``labels`` at the drafted positions;
    ``target-prefix`` keeps them only up to the first position where the text (``ids``) leaves the target's
    choice there (that choice kept: it is the token verification would have corrected to)."""
    span = [ids[anchor]] + labels[anchor + 1: anchor + block_size]
    if source != "target-prefix":
        return span
    for position in range(1, len(span)):
        if ids[anchor + position] != span[position]:
            return span[: position + 1]
    return span


def missing_choices(records: list[dict]) -> int:
    """How many records hold no ``target_choices`` of the right length (made before they were recorded, or by
    another command)."""
    return sum(1 for record in records
               if len(record.get("target_choices") or []) != len(record["response_ids"]))
