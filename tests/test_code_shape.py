"""The core's shape: no module in ``rlhf_core`` over 700 lines, no function over 80 code lines
(the statements from the first to the last of its body, a leading docstring excluded), and
each module opening with a docstring whose first line says its job."""

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "rlhf_core"
MODULES = sorted(CORE.rglob("*.py"))
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80


def code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement of ``function``'s body to the end of its last, a leading
    docstring left out (0 for a body that is only a docstring)."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            body = body[1:]
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def long_functions(source: str) -> list[str]:
    """``name (lines)`` of each function or method of ``source`` over :data:`MAX_FUNCTION_LINES`."""
    return [
        f"{node.name} ({code_lines(node)})"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and code_lines(node) > MAX_FUNCTION_LINES
    ]


def test_code_lines_count_the_body_without_its_docstring():
    source = 'def f():\n    """Doc.\n\n    More.\n    """\n    a = 1\n\n    return (\n        a\n    )\n'
    [function] = ast.parse(source).body
    assert code_lines(function) == 5
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    assert long_functions(f"def g():\n{body}\n") == [f"g ({MAX_FUNCTION_LINES + 1})"]
    assert long_functions(f'def g():\n    """Doc."""\n{body[: body.rindex(chr(10))]}\n') == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(CORE).as_posix())
def test_each_core_module_is_short_with_short_functions_and_says_its_job(path):
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES, f"{len(source.splitlines())} lines"
    assert long_functions(source) == []
    docstring = ast.get_docstring(ast.parse(source))
    assert docstring and docstring.splitlines()[0].strip(), "no docstring saying the module's job"
