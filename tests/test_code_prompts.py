"""HumanEval-style code prompts made from Python sources: what a stub keeps, which functions give one, where the
sources come from, and that the HumanEval problems themselves never become training prompts."""

import pytest

from dflash2_hf.measuring.evaluation import chat_inputs
from dflash2_hf.presets import SMOLLM2_135M
from dflash2_hf.training.code_prompts import (
    code_conversations,
    code_request,
    function_stubs,
    source_files,
    standard_library,
)
from dflash2_hf.training.data import evaluation_prompts, excluded_from_training, training_prompts

SOURCE = '''import math


def area(radius: float) -> float:
    """The area of a circle of this radius."""
    return math.pi * radius ** 2


def undocumented(x):
    return x


def _private(x):
    """Internal."""
    return x


class Shape:
    """A shape."""

    def scaled(self, factor):
        """This shape, made ``factor`` times larger.

        Negative factors mirror it.
        """
        def helper():
            """Nested: not a stub of its own."""
        return helper
'''


def test_a_stub_is_the_signature_and_docstring_without_the_body():
    expected = 'def area(radius: float) -> float:\n    """The area of a circle of this radius."""\n'
    assert function_stubs(SOURCE)[0] == expected


def test_documented_public_functions_and_methods_give_stubs_others_do_not():
    stubs = function_stubs(SOURCE)
    first_lines = [stub.splitlines()[0] for stub in stubs]
    assert first_lines == ["def area(radius: float) -> float:", "def scaled(self, factor):"]
    assert stubs[1].endswith('\n\n    Negative factors mirror it.\n    """\n'), "dedented, the docstring whole"


def test_a_file_that_does_not_parse_gives_no_stubs():
    assert function_stubs("def broken(:\n    pass\n") == []


def test_each_conversation_asks_for_one_stub_as_humaneval_is_asked(tmp_path):
    (tmp_path / "shapes.py").write_text(SOURCE)
    conversations = list(code_conversations([tmp_path]))
    assert sorted(c[0]["content"] for c in conversations) == sorted(code_request(s) for s in function_stubs(SOURCE))
    assert all(len(c) == 1 and c[0]["role"] == "user" for c in conversations)
    tokenizer = SMOLLM2_135M.load_tokenizer()
    problem = evaluation_prompts()["humaneval"][0]
    turn = [{"role": "user", "content": code_request(problem)}]
    asked = tokenizer.apply_chat_template(turn, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    asked = asked["input_ids"]
    assert asked.tolist() == chat_inputs(tokenizer, "humaneval", problem).tolist(), "evaluation asks the same way"


def test_the_order_is_a_seeded_shuffle_over_the_sources(tmp_path):
    for index in range(20):
        (tmp_path / f"module_{index:02d}.py").write_text(f'def f{index}():\n    """Number {index}."""\n')
    first = [c[0]["content"] for c in code_conversations([tmp_path], seed=0)]
    assert first == [c[0]["content"] for c in code_conversations([tmp_path], seed=0)]
    other_seed = [c[0]["content"] for c in code_conversations([tmp_path], seed=1)]
    assert first != sorted(first) and first != other_seed and sorted(first) == sorted(other_seed)


def test_the_default_source_is_the_standard_library_without_installed_packages():
    files = source_files([standard_library()])
    assert standard_library() / "textwrap.py" in files
    assert not any("site-packages" in path.parts for path in files)
    assert any(c[0]["content"].startswith(code_request("def dedent(text):")[:-3]) for c in code_conversations())


def test_a_source_root_that_is_not_a_folder_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder of Python sources"):
        code_conversations([tmp_path / "missing"])


def test_a_humaneval_problem_in_the_sources_never_becomes_a_training_prompt(tmp_path):
    problem = evaluation_prompts()["humaneval"][0]  # imports, then the function: its stub alone lacks the imports
    (tmp_path / "leak.py").write_text(problem + "    pass\n\n\n" + SOURCE)
    conversations = list(code_conversations([tmp_path]))
    assert any("def has_close_elements" in c[0]["content"] for c in conversations)
    prompts = training_prompts(iter(conversations), limit=100, exclude=excluded_from_training())
    assert len(prompts) == len(conversations) - 1 and not any("has_close_elements" in p for p in prompts)


NO_DOCUMENTED_FUNCTION = {
    "no Python file": {"notes.txt": "text"},
    "Python without functions": {"constants.py": "PI = 3.14\n"},
    "functions without docstrings": {"plain.py": "def f(x):\n    return x\n"},
}


@pytest.mark.parametrize("files", NO_DOCUMENTED_FUNCTION.values(), ids=NO_DOCUMENTED_FUNCTION.keys())
def test_code_prompts_from_folders_without_a_documented_function_are_refused_with_advice_that_works(files, tmp_path):
    from conftest import refusal

    for name, text in files.items():
        (tmp_path / "sources" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "sources" / name).write_text(text)
    message = refusal(["data", "--code-prompts", str(tmp_path / "sources"), "--out", str(tmp_path / "out")])
    assert "no documented function (a def with a docstring) in the .py files under" in message
    assert "--max-prompt-chars" not in message and not (tmp_path / "out").exists()
    (tmp_path / "sources" / "circle.py").write_text(SOURCE)  # the advice: sources that have some
    assert list(code_conversations([tmp_path / "sources"])), "the same folder with a documented function gives prompts"
