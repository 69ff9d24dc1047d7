"""Write ``docs/api.md``, the API reference, from the package's docstrings and signatures.

    python scripts/make_api_docs.py              # rewrites docs/api.md
    python scripts/make_api_docs.py --out FILE   # writes elsewhere (tests/test_docs.py compares the two)

Documented: the names in ``dflash2_hf.__all__``, then every public class and function defined in the public modules
below. For a class: its constructor signature, its docstring, and the public methods and properties it defines
itself (inherited ones are left to their own documentation). Only the standard library is used (``inspect``).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import inspect
from pathlib import Path

PACKAGE = "dflash2_hf"
MODULES = [
    "generation.config",
    "generation.loop",
    "generation.verification",
    "generation.stats",
    "generation.integration",
    "generation.exported",
    "drafting.block",
    "drafting.lattice",
    "drafting.tree",
    "drafting.lookup",
    "cost.cycle_cost",
    "cost.guard",
    "cost.timing",
    "cpu.kernels",
    "cpu.exact_attention",
    "training.setup",
    "training.blocks",
    "training.trainer",
    "training.data",
    "training.code_prompts",
    "training.checkpoint",
    "measuring.evaluation",
    "measuring.benchmark",
    "measuring.exactness",
    "measuring.reference_peer",
    "measuring.llama_cpp_peer",
    "export",
    "presets",
]
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "api.md"
HEADER = """\
# API reference

Generated from the docstrings by `scripts/make_api_docs.py`; do not edit by hand. After changing a public
signature or docstring, run `python scripts/make_api_docs.py` (`tests/test_docs.py` fails until this file matches).

Start with [Quickstart](quickstart.md) and [Generating](generation.md); this page lists what the package defines.
"""


class _Text:
    """An annotation written as source text (``from __future__ import annotations``), shown without quotes."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _unquote(annotation):
    return _Text(annotation) if isinstance(annotation, str) else annotation


def signature(obj, drop_first: bool = False) -> str | None:
    """``(a: int, b: str = 'x') -> bool`` for ``obj`` (a class: its constructor's parameters), or ``None`` when
    Python cannot tell."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    parameters = list(sig.parameters.values())
    if drop_first and parameters and parameters[0].name in ("self", "cls"):
        parameters = parameters[1:]
    parameters = [p.replace(annotation=_unquote(p.annotation)) for p in parameters]
    returns = inspect.Signature.empty if inspect.isclass(obj) else _unquote(sig.return_annotation)
    sig = sig.replace(parameters=parameters, return_annotation=returns)
    return str(sig)


def docstring(obj) -> str:
    """The object's own docstring (not an inherited one), dedented; empty when it has none."""
    doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else None
    if doc is None:
        return ""
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
        return ""  # the text dataclasses generate from the fields, already shown by the signature
    if inspect.isclass(obj) and issubclass(obj, enum.Enum) and doc == enum.Enum.__doc__:
        return ""
    return inspect.cleandoc(doc)


def _block(code: str) -> str:
    return f"```python\n{code}\n```\n"


def _members(cls) -> list[tuple[str, object]]:
    """Public methods and properties ``cls`` defines itself, in definition order."""
    found = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            found.append((name, value))
        elif isinstance(value, property) or inspect.isfunction(value):
            found.append((name, value))
    return found


def document_member(cls, name: str, value) -> str:
    if isinstance(value, property):
        code = f"{cls.__name__}.{name}  # property"
        doc = docstring(value.fget) if value.fget is not None else ""
    else:
        function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        kind = "@classmethod " if isinstance(value, classmethod) else "@staticmethod " if isinstance(value, staticmethod) else ""
        sig = signature(function, drop_first=not isinstance(value, staticmethod)) or "(...)"
        code = f"{kind}{cls.__name__}.{name}{sig}"
        doc = docstring(function)
    return f"#### `{cls.__name__}.{name}`\n\n" + _block(code) + (f"\n{doc}\n" if doc else "")


def document(name: str, obj) -> str:
    if inspect.isclass(obj):
        bases = [base for base in obj.__bases__ if base is not object]
        base_text = f"({', '.join(b.__name__ for b in bases)})" if bases else ""
        if issubclass(obj, enum.Enum):
            values = ", ".join(f"{member.name} = {member.value!r}" for member in obj)
            code = f"class {name}{base_text}: {values}"
        else:
            sig = signature(obj)
            code = f"class {name}{base_text}" + (f"\n{name}{sig}" if sig is not None else "")
        parts = [f"### `{name}`\n\n", _block(code)]
        doc = docstring(obj)
        if doc:
            parts.append(f"\n{doc}\n")
        for member_name, value in _members(obj):
            parts.append("\n" + document_member(obj, member_name, value))
        return "".join(parts)
    sig = signature(obj) or "(...)"
    doc = docstring(obj)
    return f"### `{name}`\n\n" + _block(f"def {name}{sig}") + (f"\n{doc}\n" if doc else "")


def public_names(module) -> list[str]:
    """``__all__`` when the module has one, else the public classes and functions it defines, in source order."""
    if hasattr(module, "__all__"):
        return [name for name in module.__all__ if inspect.isclass(getattr(module, name)) or inspect.isroutine(getattr(module, name))]
    names = []
    for name, value in vars(module).items():
        if name.startswith("_") or not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        if getattr(value, "__module__", None) == module.__name__:
            names.append(name)
    return names


def section(module_name: str, documented: list[str]) -> str:
    """A module's docstring and members; a re-exported member documented in another section gets a link there."""
    module = importlib.import_module(module_name)
    parts = [f"## `{module_name}`\n"]
    doc = docstring(module)
    if doc:
        parts.append(f"\n{doc}\n")
    for name in public_names(module):
        obj = getattr(module, name)
        home = getattr(obj, "__module__", module_name)
        if home != module_name and home in documented:
            parts.append(f"\n* `{name}`: see [`{home}`](#{anchor(home)}).\n")
        else:
            parts.append("\n" + document(name, obj))
    return "".join(parts)


def anchor(module_name: str) -> str:
    """GitHub's anchor for the heading ``## `module_name` ``."""
    return module_name.replace(".", "").lower()


def render() -> str:
    modules = [PACKAGE] + [f"{PACKAGE}.{name}" for name in MODULES]
    contents = "\n".join(f"* [`{name}`](#{anchor(name)})" for name in modules)
    body = "\n".join(section(name, modules) for name in modules)
    return f"{HEADER}\n{contents}\n\n{body}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="file to write (default: docs/api.md)")
    args = parser.parse_args(argv)
    args.out.write_text(render())
    print(f"API reference written to {args.out}")


if __name__ == "__main__":
    main()
