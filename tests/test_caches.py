"""The caches `generate` accepts for a target: DFlash decoding either gives plain `generate`'s tokens with them or
refuses them with a ValueError naming the cache, before any forward of the target or the drafter."""

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from transformers import DynamicCache, QuantizedCache, StaticCache
from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

import dflash2_hf

PROMPT = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(3))
ROUTES = {
    "assistant_model": lambda drafter: {"assistant_model": drafter},
    "custom_generate": lambda drafter: {"custom_generate": dflash2_hf.custom_generate, "drafter": drafter},
}
CACHE_OBJECTS = {
    "DynamicCache": lambda target: DynamicCache(config=target.config),
    "DynamicCache(offloading=True)": lambda target: DynamicCache(config=target.config, offloading=True),
    "StaticCache": lambda target: StaticCache(config=target.config, max_cache_len=64),
    "QuantizedCache": lambda target: QuantizedCache("quanto", config=target.config),
}


@pytest.fixture(scope="module")
def models():
    return tiny_target("qwen3"), tiny_drafter("dflash2")


def drafted_or_refusal(target, drafter, route: str, **kwargs):
    """The drafted output, or the ValueError raised before any forward ran (asserted)."""
    forwards = []
    hooks = [model.register_forward_pre_hook(lambda module, args: forwards.append(type(module).__name__))
             for model in (target, drafter)]
    try:
        return target.generate(PROMPT, max_new_tokens=24, do_sample=False, **ROUTES[route](drafter), **kwargs)
    except ValueError as error:
        assert forwards == [], f"{forwards} ran before the refusal"
        return error
    finally:
        for hook in hooks:
            hook.remove()


def same_as_plain_or_refused(target, drafter, route: str, cache_kwargs) -> str:
    """Decode with ``cache_kwargs()`` (fresh each call) plainly and drafted: a cache plain ``generate`` refuses here is
    refused drafted too; one it takes gives plain's tokens drafted, or a refusal before any forward. Returns the
    refusal's message ("" when it decoded)."""
    try:
        expected = target.generate(PROMPT, max_new_tokens=24, do_sample=False, **cache_kwargs())
    except Exception:  # noqa: BLE001 - e.g. offloading needs an accelerator
        with pytest.raises(Exception):  # noqa: B017
            target.generate(PROMPT, max_new_tokens=24, do_sample=False, **cache_kwargs(), **ROUTES[route](drafter))
        return "refused by plain generate too"
    result = drafted_or_refusal(target, drafter, route, **cache_kwargs())
    if isinstance(result, ValueError):
        assert "cannot do exactly" in str(result) and "DynamicCache" in str(result)
        return str(result)
    assert torch.equal(result, expected)
    return ""


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("implementation", ALL_CACHE_IMPLEMENTATIONS)
def test_every_cache_implementation_decodes_as_plain_or_is_refused_first(models, route, implementation):
    same_as_plain_or_refused(*models, route, lambda: {"cache_implementation": implementation})


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("cache", CACHE_OBJECTS)
def test_every_cache_object_decodes_as_plain_or_is_refused_first(models, route, cache):
    target, drafter = models
    refusal = same_as_plain_or_refused(target, drafter, route, lambda: {"cache": CACHE_OBJECTS[cache](target)})
    assert not refusal.startswith("DFlash") or cache.split("(")[0] in refusal, "the refusal names the cache"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("tree_nodes", [0, 6])
@pytest.mark.parametrize("cache", [{}, {"cache_implementation": "dynamic"}, {"cache_implementation": "static"}],
                         ids=["default", "dynamic", "static"])
def test_the_default_dynamic_and_static_caches_decode_as_plain_generate_with_them(models, route, tree_nodes, cache):
    target, drafter = models
    expected = target.generate(PROMPT, max_new_tokens=24, do_sample=False, **cache)
    drafted = drafted_or_refusal(target, drafter, route, dflash_tree_nodes=tree_nodes, **cache)
    assert torch.equal(drafted, expected)

