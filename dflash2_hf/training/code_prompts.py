"""Code-completion prompts from Python sources, asked the way the HumanEval benchmark asks.

The chat pool runs out of programming prompts long before a drafter has seen enough code. Any documented function
of a Python source tree makes one more: its signature and docstring, with the body left for the target to write,
as HumanEval states its problems. The standard library alone gives several thousand, on every machine, offline.
"""

from __future__ import annotations

import ast
import random
import sysconfig
import textwrap
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

CODE_REQUEST = "Complete the following Python function.\n\n```python\n{}```"  # HumanEval's prompt, in a chat turn


def code_request(stub: str) -> str:
    """The user turn asking for the body of ``stub`` (a signature and docstring ending in a newline)."""
    return CODE_REQUEST.format(stub)


def standard_library() -> Path:
    """The running Python's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def function_stubs(source: str) -> list[str]:
    """Signature and docstring of every documented public function of ``source`` (module level, or a method of a
    module-level class, dedented), in source order; none for a file that does not parse."""
    try:
        with warnings.catch_warnings():  # old sources' invalid escapes and the like: not this reader's business
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.split("\n")
    methods = [node for cls in tree.body if isinstance(cls, ast.ClassDef) for node in cls.body]
    stubs = []
    for node in [*tree.body, *methods]:
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")
                and ast.get_docstring(node)):
            stubs.append(textwrap.dedent("\n".join(lines[node.lineno - 1: node.body[0].end_lineno]) + "\n"))
    return stubs


def source_files(roots: Iterable[str | Path]) -> list[Path]:
    """The ``.py`` files under each root, sorted; installed packages (``site-packages``) are left out of the
    standard library, whose folder may hold them."""
    files = []
    stdlib = standard_library().resolve()
    for root in map(Path, roots):
        if not root.is_dir():
            raise FileNotFoundError(f"{root} is not a folder of Python sources")
        skip_installed = root.resolve() == stdlib
        files += [path for path in sorted(root.rglob("*.py"))
                  if not (skip_installed and {"site-packages", "dist-packages"} & set(path.relative_to(root).parts))]
    return files


def code_conversations(roots: Iterable[str | Path] = (), seed: int = 0) -> Iterator[list[dict[str, str]]]:
    """One single-turn conversation per function stub of the sources under ``roots`` (default: the standard
    library), shuffled with ``seed`` so that any prefix spreads over many modules. The sources are read at once, so
    a root that is not a folder, or roots holding no documented function, are refused here (``FileNotFoundError``),
    before any work on the conversations."""
    folders = list(roots) or [standard_library()]
    stubs = [stub for path in source_files(folders)
             for stub in function_stubs(path.read_text(encoding="utf-8", errors="replace"))]
    if not stubs:
        raise FileNotFoundError(f"no documented function (a def with a docstring) in the .py files under "
                                f"{', '.join(map(str, folders))}; name folders of Python sources that have some, or "
                                "give no folder to use the standard library's")
    random.Random(seed).shuffle(stubs)
    return iter([[{"role": "user", "content": code_request(stub)}] for stub in stubs])
