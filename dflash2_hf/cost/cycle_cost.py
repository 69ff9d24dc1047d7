"""Cost-aware block length: verify only as much of the drafted path as pays for itself.

A target forward over ``m`` tokens costs more as ``m`` grows (a little in bf16, markedly in fp32 on a CPU), while a
drafted token is only accepted if every token before it was. With ``c_i`` the chance that drafted token ``i`` is
accepted once the ones before it were, verifying the first ``n`` drafted tokens emits in expectation

    E(n) = 1 + c_1 + c_1 c_2 + ... + c_1 ... c_n

tokens (the target's own correction or bonus token included), and the cycle costs ``C(n) = fixed + verify(n + 1)``
seconds (``fixed``: drafting and path selection; ``verify(m)``: the target's forward over the anchor and ``m - 1``
drafted tokens). Walking along the path, the decoder adds token ``n`` while that raises the expected rate,
``E(n) / C(n) >= E(n - 1) / C(n - 1)``, and cuts the block at the first token whose expected gain no longer pays for
its measured cost.

``c_i`` is estimated from the drafter (:func:`~dflash2_hf.drafting.lattice.path_confidences`) and depends only on the path
before token ``i``, never on token ``i`` itself. So the cut is a stopping rule over the drafted tokens: whether token
``i`` is verified is settled before it is looked at, every verified token is still distributed as the proposal its
rejection test assumes, and verification stays exact (greedy: identical to plain decoding; sampling: the target's
distribution).

A token tree is sized the same way (:meth:`CycleCost.worthwhile_size`): its nodes, grown best-first, each add their
branch probability ``q_1 ... q_d`` to the expected accepted tokens, and nodes are added while the expected rate does
not drop. The size is read from the lattice alone, before any token is drawn from it, so exactness is unchanged.

:class:`CycleCost` holds the machine's costs; :func:`measure_cycle_cost` times them on the real target and drafter,
and :func:`cycle_cost_for` caches the measurement per machine, model pair, dtype and thread count.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import operator
import os
import platform
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from ..cpu.kernels import cpu_description, linears_packed
from ..drafting.block import BlockDrafter
from ..drafting.options import DraftOptions
from ..modeling import DFlashDraftModel
from .timing import device_seconds

MEASURED_LENGTHS = (1, 2, 4, 8, 16, 32)
#: How the cost is measured; part of the cache key, so costs measured another way are measured again.
MEASUREMENT = "fastest of rounds"


@dataclass(frozen=True)
class CycleCost:
    """What one decoding cycle costs on this machine, in seconds.

    Attributes:
        fixed_seconds: drafting a block and picking its path (independent of how much of it is verified).
        verify_seconds: ``verify_seconds[m - 1]`` is one target forward over ``m`` new tokens (the anchor and
            ``m - 1`` drafted tokens), for ``m = 1 .. len(verify_seconds)``.
    """

    fixed_seconds: float
    verify_seconds: tuple[float, ...]

    def __post_init__(self):
        times = (self.fixed_seconds, *self.verify_seconds)
        if (not self.verify_seconds or not all(math.isfinite(t) for t in times) or min(self.verify_seconds) <= 0
                or self.fixed_seconds < 0):
            raise ValueError("A cycle cost needs positive verify times for 1.. tokens and a non-negative fixed time; "
                             f"got fixed={self.fixed_seconds}, verify={self.verify_seconds}.")

    def cycle_seconds(self, drafted: int) -> float:
        """Seconds of a cycle that verifies ``drafted`` drafted tokens (plus the anchor)."""
        if drafted >= len(self.verify_seconds):
            raise ValueError(f"This cost model covers at most {len(self.verify_seconds) - 1} drafted tokens.")
        return self.fixed_seconds + self.verify_seconds[drafted]

    def verified_length(self, confidences: Sequence[float]) -> int:
        """How many leading drafted tokens to verify (0 .. ``len(confidences)``); ``confidences[i]`` is the estimated
        chance that token ``i + 1`` is accepted given the ones before it."""
        return self.worthwhile_size(list(itertools.accumulate((float(c) for c in confidences), operator.mul)))

    def worthwhile_size(self, gains: Sequence[float]) -> int:
        """How many of the candidate drafted tokens to verify (0 .. ``len(gains)``), taken in order; ``gains[i]`` is
        the expected number of extra accepted tokens that verifying token ``i + 1`` brings (a path's survival
        probability up to it, a tree node's branch probability, a copied token's odds), non-increasing.

        Tokens are added while the expected emitted tokens per second does not drop. A size is priced at the
        cheapest forward over at least that many tokens: when a longer forward costs less (CPU kernels switch at some
        widths), verifying more is free and can only add accepted tokens, so the longer one is verified.
        """
        available = len(gains)
        expected, size = 1.0, 0
        for drafted, gain in enumerate(gains, start=1):
            longer = expected + float(gain)
            if longer / self._cheapest(drafted, available)[1] < expected / self._cheapest(drafted - 1, available)[1]:
                break
            expected, size = longer, drafted
        return self._cheapest(size, available)[0]

    def _cheapest(self, at_least: int, at_most: int) -> tuple[int, float]:
        """The drafted-token count in ``at_least .. at_most`` whose cycle is cheapest (the longest among equals)."""
        seconds, longest = min((self.cycle_seconds(n), -n) for n in range(at_least, at_most + 1))
        return -longest, seconds

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, record: object) -> CycleCost:
        """The cost :meth:`to_json` wrote; anything of another shape (a cache file edited by hand, or written by
        another version) is a ``ValueError``."""
        fixed = record.get("fixed_seconds") if isinstance(record, dict) else None
        verify = record.get("verify_seconds") if isinstance(record, dict) else None
        if not isinstance(verify, list) or not all(_is_number(t) for t in (fixed, *verify)):
            raise ValueError('a cycle cost is {"fixed_seconds": number, "verify_seconds": [number, ...]}')
        return cls(float(fixed), tuple(float(t) for t in verify))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def interpolate(measured: dict[int, float], up_to: int) -> tuple[float, ...]:
    """Seconds for every length ``1 .. up_to`` from a few measured lengths, linear between them (and beyond the last
    two points)."""
    lengths = sorted(measured)
    values = []
    for m in range(1, up_to + 1):
        low = max((n for n in lengths if n <= m), default=lengths[0])
        high = min((n for n in lengths if n > low), default=None)
        if high is None:  # past the last measurement: extend the last segment
            low, high = (lengths[-2], lengths[-1]) if len(lengths) > 1 else (low, low)
        slope = (measured[high] - measured[low]) / (high - low) if high != low else 0.0
        values.append(max(measured[low] + slope * (m - low), 1e-9))
    return tuple(values)


def _fastest_seconds(actions: dict, rounds: int, device: torch.device) -> dict:
    """The fastest of ``rounds`` timings of each action, the actions taken in turn round by round. The cost is measured
    once and kept, so it must not record a moment of load: a burst from another process slows one round of every
    action alike, not every timing of one, and the fastest timing of each is the one such a burst disturbed least."""
    fastest = dict.fromkeys(actions, math.inf)
    for _ in range(rounds):
        for name, action in actions.items():
            started = device_seconds(device)
            action()
            fastest[name] = min(fastest[name], device_seconds(device) - started)
    return fastest


@torch.no_grad()
def measure_cycle_cost(
    target: torch.nn.Module, drafter: DFlashDraftModel, block_size: int, context_tokens: int = 128, repeats: int = 5,
    longest_forward: int | None = None,
) -> CycleCost:
    """Time, on this machine, the target's forward over 1 .. ``longest_forward`` (default ``block_size``) new tokens
    after ``context_tokens`` cached ones (a few lengths measured, the rest interpolated) and one draft + path selection
    of a block: the fastest of ``repeats`` rounds of each.

    Uses a fixed pseudo-random prompt; every forward runs once untimed first, so one-off work is not counted.
    """
    device = target.device
    vocab = target.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    longest = max(block_size, longest_forward or block_size)
    prompt = torch.randint(0, vocab, (1, context_tokens + longest), generator=generator).to(device)
    options = DraftOptions.for_drafter(drafter, block_size=block_size)
    block = BlockDrafter(drafter, target, options)
    cache = DynamicCache(config=target.config)
    prefill = target(input_ids=prompt[:, :context_tokens], cache=cache, use_cache=True,
                     output_hidden_states=block.hidden_state_indices, logits_to_keep=1)
    cache.activate_past_recording()

    def verify(length: int) -> None:
        target(input_ids=prompt[:, context_tokens : context_tokens + length], cache=cache, use_cache=True,
               output_hidden_states=block.hidden_state_indices)
        cache.crop(-length)

    context = block.context_features(prefill.hidden_states, context_tokens)
    anchor, anchor_position = int(prompt[0, context_tokens]), context_tokens

    def draft() -> None:
        lattice, hidden = block.draft(context, anchor, anchor_position, block_size - 1)
        block.score(lattice, hidden)
        block.cache.crop(-context_tokens)  # forget the context again so each repeat drafts the same block

    actions = {length: functools.partial(verify, length)
               for length in tuple(n for n in MEASURED_LENGTHS if n < longest) + (longest,)}
    actions["draft"] = draft
    for action in actions.values():
        action()
    seconds = _fastest_seconds(actions, repeats, device)
    fixed = seconds.pop("draft")
    return CycleCost(fixed_seconds=fixed, verify_seconds=interpolate(seconds, longest))


def cost_cache_folder() -> Path:
    """Where measured cycle costs are kept: ``$DFLASH2_HF_CACHE/cycle-costs`` if set, else
    ``~/.cache/dflash2-hf/cycle-costs``."""
    root = os.environ.get("DFLASH2_HF_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "dflash2-hf"
    return base / "cycle-costs"


def _cost_key(target: torch.nn.Module, drafter: DFlashDraftModel, block_size: int, longest_forward: int) -> str:
    """Everything a cost measurement depends on: machine, kernel limits and thread count (:func:`cpu_description`),
    torch, both models' configs and dtypes, whether their linears run packed and which attention the target runs."""
    parts = [
        platform.node(), platform.processor(), platform.machine(), str(os.cpu_count()), cpu_description(),
        MEASUREMENT, torch.__version__, str(target.device), str(target.dtype), str(drafter.dtype), str(block_size),
        str(longest_forward), f"packed {linears_packed(target)} {linears_packed(drafter)}",
        str(target.config._attn_implementation),
        target.config.to_json_string(use_diff=False), drafter.config.to_json_string(use_diff=False),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def cycle_cost_for(
    target: torch.nn.Module, drafter: DFlashDraftModel, block_size: int, folder: Path | None = None,
    longest_forward: int | None = None,
) -> CycleCost:
    """The cycle cost of this target/drafter pair here, for forwards over up to ``longest_forward`` (default
    ``block_size``) tokens: read from the cache folder, else measured (a few seconds) and stored there. A cache entry
    of another shape is measured again and replaced; a cache folder that cannot be written leaves decoding to go on
    with the measurement, and a warning."""
    longest = max(block_size, longest_forward or block_size)
    folder = Path(folder) if folder is not None else cost_cache_folder()
    path = folder / f"{_cost_key(target, drafter, block_size, longest)}.json"
    cached = _read_cost(path, longest)
    if cached is not None:
        return cached
    cost = measure_cycle_cost(target, drafter, block_size, longest_forward=longest)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(cost.to_json(), indent=1))
        temporary.replace(path)
    except OSError as error:
        warnings.warn(f"dflash2-hf cannot keep the measured cycle cost in {folder} ({error}); decoding goes on, and "
                      "each new process measures it again (a few seconds). Set DFLASH2_HF_CACHE to a writable folder.",
                      stacklevel=2)
    return cost


def _read_cost(path: Path, longest: int) -> CycleCost | None:
    """The cost cached at ``path`` if there is one of the right shape covering forwards of ``longest`` tokens; else
    ``None`` (with a warning when a file was there, since it is measured again and replaced)."""
    try:
        if not path.is_file():
            return None
        cost = CycleCost.from_json(json.loads(path.read_text()))
        if len(cost.verify_seconds) < longest:
            raise ValueError(f"it covers forwards of {len(cost.verify_seconds)} tokens, not {longest}")
        return cost
    except (OSError, ValueError) as error:
        warnings.warn(f"dflash2-hf: the cached cycle cost {path} cannot be used ({error}); measuring it again.",
                      stacklevel=3)
        return None
