"""Checking that sampled output follows the target's distribution exactly: the statistics behind the exactness tests
and ``scripts/device_check.py``.

On a target with a tiny vocabulary every continuation of a few tokens can be enumerated, so its exact probability
under plain sampling is computable from the very scores plain ``generate`` samples from (temperature, top-k, top-p
and penalties applied). Continuations drawn with a drafter are then compared with it by a chi-square
goodness-of-fit test: a p-value near 0 means the drafter changed the distribution. A check that cannot fail proves
nothing, so each is run again with a biased verifier in place of the real one (:func:`keep_every_draft`, or one
built on :func:`walk_down`), which must fail it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from ..generation.verification import Verdict


def randomize(model: torch.nn.Module, seed: int, scale: float = 0.2) -> torch.nn.Module:
    """Give every parameter of ``model`` seeded random values (norm gains around 1), so no component is the
    identity and next-token distributions are peaked rather than uniform: a tiny drafter then proposes far from a
    tiny target's distribution, and the exactness checks see rejections, residuals and bonus tokens."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else scale * noise)
    return model


def continuation_distribution(target, prompt: torch.Tensor, new_tokens: int,
                              **sampling) -> dict[tuple[int, ...], float]:
    """P(continuation) under plain sampling for every ``new_tokens``-token continuation of ``prompt`` (one row),
    from the processed scores plain ``generate`` samples from with ``sampling`` (e.g. ``temperature``, ``top_k``)."""
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def next_probs(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in cache:
            inputs = torch.cat([prompt, prompt.new_tensor([prefix])], dim=1) if prefix else prompt
            out = target.generate(inputs, max_new_tokens=1, do_sample=True, return_dict_in_generate=True,
                                  output_scores=True, **{"top_k": 0} | sampling)
            cache[prefix] = torch.softmax(out.scores[0][0].double(), dim=-1).cpu()
        return cache[prefix]

    probs = {}
    for continuation in itertools.product(range(target.config.vocab_size), repeat=new_tokens):
        probs[continuation] = 1.0
        for i, token in enumerate(continuation):
            probs[continuation] *= float(next_probs(continuation[:i])[token])
    return probs


def chi_square_pvalue(observed: list[float], expected: list[float]) -> float:
    """The p-value of Pearson's chi-square statistic with ``len(observed) - 1`` degrees of freedom (the regularized
    upper incomplete gamma function: the chi-square distribution's survival function)."""
    observed, expected = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    statistic = ((observed - expected) ** 2 / expected).sum()
    degrees = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(degrees, statistic / 2))


def goodness_of_fit(draws: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Chi-square p-value of ``draws`` against the ``exact`` distribution, pooling the cells expected below 5 times
    (where the chi-square approximation does not hold) into one."""
    counts = dict.fromkeys(exact, 0)
    for draw in draws:
        counts[draw] += 1
    big = [key for key in exact if exact[key] * len(draws) >= 5]
    small = [key for key in exact if key not in big]
    observed = [counts[key] for key in big] + ([sum(counts[key] for key in small)] if small else [])
    expected = [exact[key] * len(draws) for key in big] + ([sum(exact[key] for key in small) * len(draws)] if small else [])
    scale = len(draws) / sum(expected)  # remove float rounding so the totals match
    return chi_square_pvalue(observed, [e * scale for e in expected])


def walk_down(tree, target_probs: Callable[[int], torch.Tensor],
              choose: Callable[[int, torch.Tensor], tuple[int | None, torch.Tensor]]) -> Verdict:
    """A verifier walk for negative controls: from the anchor (``-1``), ``choose(node, p)`` gives the child to keep
    (or ``None``) and the distribution the emitted token is drawn from when none is kept."""
    node, nodes, emitted = -1, [], []
    while True:
        kept, p = choose(node, target_probs(node))
        if kept is None:
            return Verdict(nodes, emitted + [int(torch.multinomial(p, 1))])
        nodes.append(kept)
        emitted.append(tree.tokens[kept])
        node = kept


def keep_every_draft(tree, target_probs: Callable[[int], torch.Tensor], generator=None) -> Verdict:
    """A biased verifier (negative control): keep the first drafted child at every node, never reject, then emit a
    token of the target's. Output then follows the drafter, and an exactness check must say so."""
    return walk_down(tree, target_probs, lambda node, p: (next(iter(tree.draws.get(node, [])), None), p))
