"""Never slower than plain decoding: draft only while drafting is measured to pay, here and now.

Whether a drafting cycle beats plain decoding depends on the machine (what a target forward over many rows costs
next to one row: little on a CPU with AMX or on a GPU, up to 3-4x on an AVX2-only CPU in float32, more in bf16
without bf16 instructions), on the dtype and threads, and on the text (a drafter guesses code far better than open
chat). No fixed setting is right everywhere, so :class:`DraftingGuard` measures both while generating:

* the **drafting rate**: tokens emitted per second over the latest drafting cycles (draft, select, verify, all in);
* the **plain rate**: tokens per second of plain one-token steps, which the decoder takes now and then (each one emits
  the target's own next token, so none is wasted).

While drafting is at least as fast, it drafts (re-timing one plain step every ``replain_every`` cycles, since speeds
drift). When it is slower, it decodes plainly for ``pause`` steps, then probes drafting again for ``min_cycles``
cycles; each failed probe doubles the pause (up to ``longest_pause``), a successful one resets it. Drafting pays in
bursts (an answer that starts copying its prompt), so a pause also ends early once ``foreseen_to_probe`` plain steps
in a row emitted the token the context lookup foresaw (a free guess: it reads the text only). On text where drafting
never pays, the probes cost a few cycles per generation; on text where it pays, a plain step now and then.

Speeds are wall-clock when decoding greedily (the output is the same whichever steps are taken). Given a
:class:`~dflash2_hf.cost.cycle_cost.CycleCost` the guard prices each step by that cost model instead (a cycle:
``cost.cycle_seconds(verified tokens)``; a plain step: ``cost.verify_seconds[0]``), which makes its choices
reproducible: sampled decoding prices steps by the machine's measured, cached cycle cost, so a seed gives the same
text from run to run, and tests inject one (``dflash_plain_fallback=cost``).

Exactness is untouched: a plain step is exactly plain decoding's step (one-token target forward, the same logits
processors and choice), and which kind of step comes next is decided from the past alone, before the step's own
tokens are drawn, so greedy output stays token-identical and sampling keeps the target's distribution.
"""

from __future__ import annotations

from collections import deque

from .cycle_cost import CycleCost


class DraftingGuard:
    """Chooses, before each step of a generation, a drafting cycle or a plain one-token step, from measured speeds.

    Args:
        min_cycles: drafting cycles timed before drafting is judged (at the start and at each probe).
        first_pause: plain steps taken the first time drafting is found slower.
        longest_pause: the most plain steps between two probes.
        replain_every: while drafting pays, one plain step after this many drafting cycles, to keep the plain rate
            current.
        window: how many of the latest steps of each kind the rates are computed over.
        foreseen_to_probe: plain steps in a row whose token the context lookup foresaw that end a pause.
        prices: price each step by this cost model instead of the seconds it took.
    """

    def __init__(self, min_cycles: int = 2, first_pause: int = 16, longest_pause: int = 256, replain_every: int = 32,
                 window: int = 4, foreseen_to_probe: int = 2, prices: CycleCost | None = None):
        if (min(min_cycles, first_pause, longest_pause, replain_every, window, foreseen_to_probe) < 1
                or longest_pause < first_pause):
            raise ValueError("DraftingGuard needs positive counts and longest_pause >= first_pause.")
        self.min_cycles, self.first_pause, self.longest_pause = min_cycles, first_pause, longest_pause
        self.replain_every, self.foreseen_to_probe = replain_every, foreseen_to_probe
        self.prices = prices
        self._drafted: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds) per drafting cycle
        self._plain: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds) per step without drafting
        self._pause = first_pause
        self._plain_left = 0  # plain steps still to take before the next probe
        self._since_plain = 0  # drafting cycles since the last plain step
        self._foreseen = 0  # plain steps in a row whose token the context lookup foresaw

    @property
    def drafting_rate(self) -> float | None:
        """Tokens per second of the latest drafting cycles (``None`` before one was timed)."""
        seconds = sum(s for _, s in self._drafted)
        return sum(t for t, _ in self._drafted) / seconds if self._drafted and seconds > 0 else None

    @property
    def plain_rate(self) -> float | None:
        """Tokens per second of the latest steps without drafting (``None`` before one was timed)."""
        seconds = sum(s for _, s in self._plain)
        return sum(t for t, _ in self._plain) / seconds if self._plain and seconds > 0 else None

    def drafts_next(self) -> bool:
        """Whether the next step is a drafting cycle (else a plain one-token step)."""
        if self._plain_left > 0:
            return False
        if len(self._drafted) < self.min_cycles:
            return True
        return bool(self._plain) and self._since_plain < self.replain_every

    def record_cycle(self, tokens: int, verified: int, seconds: float) -> None:
        """A drafting cycle that verified ``verified`` drafted tokens emitted ``tokens`` in ``seconds``."""
        if self.prices is not None:
            seconds = self.prices.cycle_seconds(min(verified, len(self.prices.verify_seconds) - 1))
        self._drafted.append((tokens, seconds))
        self._since_plain += 1
        self._judge()

    def record_plain(self, seconds: float, foreseen: bool = False, tokens: int = 1, verified: int = 0) -> None:
        """A step without drafting took ``seconds`` and emitted ``tokens``: a plain step, or a cycle that verified
        ``verified`` tokens copied from the context; ``foreseen``: its first token is the one the context lookup had
        guessed."""
        if self.prices is not None:
            seconds = self.prices.verify_seconds[min(verified, len(self.prices.verify_seconds) - 1)]
        self._plain.append((tokens, seconds))
        self._since_plain = 0
        self._foreseen = self._foreseen + 1 if foreseen else 0
        if self._plain_left > 0:  # in a pause: its last step, or a run of foreseen tokens, starts the probe
            self._plain_left = 0 if self._foreseen >= self.foreseen_to_probe else self._plain_left - 1
        else:
            self._judge()  # a plain step taken to time it

    def _judge(self) -> None:
        """Once both rates are known: pause drafting if it is the slower (each pause twice the last, up to the
        longest), else keep drafting (the next pause starts short again)."""
        if len(self._drafted) < self.min_cycles or not self._plain:
            return
        if self.drafting_rate < self.plain_rate:
            self._plain_left = self._pause
            self._pause = min(2 * self._pause, self.longest_pause)
            self._drafted.clear()  # the probe after the pause is judged on its own cycles
        else:
            self._pause = self.first_pause
