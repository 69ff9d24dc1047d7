"""The module paths of dflash2-hf 0.1's flat layout, kept importable while users move to the wings.

``import dflash2_hf.cpu_kernels`` (or ``from dflash2_hf.block_length import CycleCost``, or a star-import) still works:
it gives a module that forwards every name to the module's new home and warns, with a ``FutureWarning`` naming the new
path.
Two wings carry the name of a 0.1 module (``training``, ``drafting``): they forward that module's names the same
way (:func:`wing_getattr`). The old paths go in dflash2-hf 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

#: Old module (under ``dflash2_hf.``) -> its new path. ``decoding``, split in two, forwards to the loop, which also
#: holds the names of the statistics and options it uses.
MOVED_MODULES = {
    "lattice": "drafting.lattice", "tree": "drafting.tree", "context_lookup": "drafting.lookup",
    "decoding": "generation.loop", "verification": "generation.verification",
    "integration": "generation.integration", "block_length": "cost.cycle_cost", "planning": "cost.guard",
    "timing": "cost.timing", "cpu_kernels": "cpu.kernels", "exact_attention": "cpu.exact_attention",
    "grouped_attention": "cpu.grouped_attention", "data": "training.data", "drafter_setup": "training.setup",
    "training_blocks": "training.blocks", "checkpoint": "training.checkpoint", "code_prompts": "training.code_prompts",
    "benchmark": "measuring.benchmark", "evaluation": "measuring.evaluation", "plots": "measuring.plots",
    "reference_peer": "measuring.reference_peer", "llama_cpp_peer": "measuring.llama_cpp_peer",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``dflash2_hf.<old>`` and loads a module forwarding to ``dflash2_hf.<new>``."""

    def find_spec(self, fullname: str, path=None, target=None):
        package, _, old = fullname.partition(".")
        if package == __package__ and old in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        new_name = f"{__package__}.{MOVED_MODULES[module.__name__.partition('.')[2]]}"
        warnings.warn(f"{module.__name__} moved to {new_name}; import from there (the old path goes in "
                      "dflash2-hf 0.3).", FutureWarning, stacklevel=2)
        new = importlib.import_module(new_name)
        module.__getattr__ = lambda name: getattr(new, name)
        module.__dir__ = lambda: dir(new)
        # ``from <old> import *`` imports what ``from <new> import *`` would (each name forwarded by __getattr__)
        module.__all__ = list(getattr(new, "__all__", [name for name in vars(new) if not name.startswith("_")]))
        module.__doc__ = f"Moved to {new_name}."


def install() -> None:
    """Make the old module paths importable (once per process)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())


def wing_getattr(wing: str, homes: tuple[str, ...]):
    """A ``__getattr__`` for the wing ``dflash2_hf.<wing>``, whose name was a 0.1 module: a name that module defined
    is taken from its new home among ``homes`` (modules under ``dflash2_hf.``), with a ``FutureWarning``. The wing's
    own submodules are left to the import system."""

    def forward(name: str):
        if not name.startswith("_"):
            for home in homes:
                module = importlib.import_module(f"{__package__}.{home}")
                value = getattr(module, name, None)
                if value is not None and not isinstance(value, types.ModuleType):
                    warnings.warn(f"{__package__}.{wing}.{name} moved to {module.__name__}.{name}; import from there "
                                  "(the old path goes in dflash2-hf 0.3).", FutureWarning, stacklevel=2)
                    return value
        raise AttributeError(f"module '{__package__}.{wing}' has no attribute {name!r}")

    return forward
