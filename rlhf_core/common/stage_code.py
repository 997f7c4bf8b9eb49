"""The code a pipeline stage runs: its entry in the stage table and the package modules that
entry imports, found by walking the sources' syntax trees (nothing is imported), and their digest.

A stage's cache key (:func:`rlhf_core.run.pipeline.stage_key`) covers this code and no other, so that
an edit re-runs the stages that may run the edited code and no others.
"""

from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
#: The position of the run function among a ``Stage(...)`` entry's arguments (or ``run=``).
RUN_ARGUMENT = 3


@dataclass(frozen=True)
class ModuleImports:
    """The package modules a module imports, by dotted name: ``top`` when it is imported
    (module-level statements, class bodies and ``if`` blocks included), ``inner`` inside its
    functions; ``names`` maps each name a module-level ``from ... import`` binds to the
    package modules it may come from."""

    top: frozenset[str]
    inner: frozenset[str]
    names: dict[str, frozenset[str]]


@cache
def module_file(root: Path, module: str) -> Path | None:
    """The source file of dotted ``module`` in the package whose directory is ``root`` (its
    ``__init__.py`` for a subpackage), or ``None`` when the name is not a module of it; looked
    up once per process."""
    parts = module.split(".")
    if parts[0] != root.name:
        return None
    base = root.joinpath(*parts[1:])
    for path in (base.with_suffix(".py") if len(parts) > 1 else None, base / "__init__.py"):
        if path is not None and path.is_file():
            return path
    return None


def _module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def _import_names(node: ast.AST, module: str, is_package: bool) -> tuple[str, ...]:
    """The dotted names an import statement or an ``importlib.import_module`` call with a
    literal name may load, in module ``module``: the named module and, for ``from X import y``,
    ``X.y`` (a module, if one has that name)."""
    if isinstance(node, ast.Import):
        return tuple(alias.name for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, node.module] if node.module else package)
        else:
            base = node.module or ""
        return (base, *(f"{base}.{alias.name}" for alias in node.names))
    if (
        isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return (node.args[0].value,)
    return ()


def _in_package(root: Path, names: tuple[str, ...] | frozenset[str]) -> frozenset[str]:
    return frozenset(n for n in names if module_file(root, n) is not None)


@cache
def _parse(source: bytes) -> ast.Module:
    """The syntax tree of a source, cached by content (not to be modified)."""
    return ast.parse(source)


@cache
def _parsed_imports(module: str, is_package: bool, source: bytes) -> tuple[frozenset, frozenset, tuple]:
    """:func:`_import_names` over a module's source: those at import time, those inside its
    functions, and ``(name, names)`` for each name a module-level ``from ... import`` binds.
    Cached by content: copies of a file are parsed once."""
    top: set[str] = set()
    inner: set[str] = set()
    bound: list[tuple[str, tuple[str, ...]]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        found = _import_names(node, module, is_package)
        (inner if in_function else top).update(found)
        if found and not in_function and isinstance(node, ast.ImportFrom):
            bound.extend((alias.asname or alias.name, found) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(node, _FUNCTIONS))

    visit(_parse(source), False)
    return frozenset(top), frozenset(inner), tuple(bound)


@cache
def module_imports(root: Path, path: Path) -> ModuleImports:
    """The package modules the source file ``path`` (a module of the package at ``root``)
    imports, from its syntax tree; read once per process.

    Raises:
        OSError, SyntaxError: ``path`` cannot be read or parsed.
    """
    top, inner, bound = _parsed_imports(_module_name(root, path), path.name == "__init__.py", path.read_bytes())
    names = {name: _in_package(root, found) for name, found in bound}
    return ModuleImports(_in_package(root, top), _in_package(root, inner), {k: v for k, v in names.items() if v})


def _with_packages(module: str) -> list[str]:
    """``module`` and the packages above it, whose ``__init__`` runs when it is imported."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def import_closure(root: Path, modules: set[str], table: str) -> set[str]:
    """Every package module that importing or running ``modules`` may load: their imports at
    module level and inside functions, transitively, with the packages above each.

    The stage table's module ``table``, when reached, counts with its module-level imports
    only: importing it (to read the stage names, say) runs none of its stage functions, whose
    imports belong to their own stages (:func:`stage_code_digest`).
    """
    seen: set[str] = set()
    todo = [p for m in modules for p in _with_packages(m)]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        imports = module_imports(root, module_file(root, module))  # type: ignore[arg-type]
        found = imports.top if module == table else imports.top | imports.inner
        todo.extend(p for m in found for p in _with_packages(m))
    return seen


def table_entry(root: Path, table: str, stage: str) -> tuple[list[str], set[str]]:
    """Stage ``stage``'s run function in the table module ``table``: in its ``Stage(...)`` call
    (the call whose first argument is the literal ``stage``), the argument ``run`` (the fourth,
    or by keyword); the source of every module-level definition of ``table`` it names,
    transitively (the function, the constants and helpers it uses), in file order; and the
    package modules those import, inside the functions or through a module-level ``from ...
    import`` of a name they use. The entry's other arguments (inputs, settings, ``reads``) are
    not followed: they enter the stage's key as values.

    Raises:
        KeyError: no such call in ``table``'s source, or it names no run function.
    """
    path = module_file(root, table)
    source = path.read_bytes()  # type: ignore[union-attr]
    tree = _parse(source)
    defined: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    defined[target.id] = node
    entry = next(
        (
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "Stage"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == stage
        ),
        None,
    )
    if entry is None:
        raise KeyError(f"no Stage({stage!r}, ...) entry in {path}")
    run = entry.args[RUN_ARGUMENT] if len(entry.args) > RUN_ARGUMENT else None
    run = run or next((k.value for k in entry.keywords if k.arg == "run"), None)
    if run is None:
        raise KeyError(f"the Stage({stage!r}, ...) entry in {path} names no run function")
    imports = module_imports(root, path)  # type: ignore[arg-type]
    is_package = path.name == "__init__.py"  # type: ignore[union-attr]
    parts: list[ast.AST] = [] if isinstance(run, ast.Name) else [run]
    modules: set[str] = set()
    todo: list[ast.AST] = [run]
    while todo:
        for node in ast.walk(todo.pop()):
            modules.update(_in_package(root, _import_names(node, table, is_package)))
            if isinstance(node, ast.Name):
                modules.update(imports.names.get(node.id, ()))
                definition = defined.get(node.id)
                if definition is not None and definition not in parts:
                    parts.append(definition)
                    todo.append(definition)
    parts.sort(key=lambda n: (n.lineno, n.col_offset))  # type: ignore[attr-defined]
    lines = source.decode().splitlines(keepends=True)
    return ["".join(lines[n.lineno - 1 : n.end_lineno]) for n in parts], modules  # type: ignore[attr-defined]


def runs_nothing(path: Path) -> bool:
    """Whether ``path`` is a package's ``__init__.py`` that holds a docstring and nothing else:
    importing it runs no code, so no edit to it can change what a stage computes, and the code
    a stage runs (:func:`stage_code`) does not count it."""
    if path.name != "__init__.py":
        return False
    body = _parse(path.read_bytes()).body
    return all(
        isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str) for n in body
    )


@dataclass(frozen=True)
class StageCode:
    """The code a stage runs (:func:`stage_code`): ``digest`` (SHA-256, 16 hex) over its table
    entry and its modules; ``entry`` (16 hex) of the table entry alone; ``modules`` maps each
    module's path relative to the package's parent (``rlhf_core/ppo/algorithm.py``) to the SHA-256
    (16 hex) of its source: what ``rlhf plan`` compares to name the modules an edit touched."""

    digest: str
    entry: str
    modules: dict[str, str]


@cache
def stage_code(root: Path, table: str, stage: str) -> StageCode:
    """The code stage ``stage`` runs: its run function in the stage table (:func:`table_entry`)
    and the source of every package module that function may load (:func:`import_closure`),
    each module named by its path relative to ``root``'s parent; read once per process.

    The rule: a module counts when a static import, an import inside a function, or an
    ``importlib.import_module`` call with a literal name reaches it from the stage's run
    function, through modules of the package only; a subpackage's ``__init__.py`` that holds
    only a docstring runs nothing and does not count (:func:`runs_nothing`). What the key covers otherwise (the
    entry's settings, inputs and ``reads`` fingerprints) enters the key as values, so the code
    that computes them is not covered here. Code loaded any other way (a name built at run time;
    a module outside the package, such as a rule reward ``python:MODULE:FUNCTION``) is not
    covered either: what the stage reads of it belongs in its ``Stage.reads``, as the rule
    reward's own digest does. Imports inside functions count although a stage may never call
    those functions, so an edit can re-run a stage that would not have run the edited code.

    Args:
        root: the package's directory (``rlhf_core/``).
        table: the dotted name of the module holding the stage table (``rlhf_core.run.pipeline``).
        stage: a stage name of that table.

    Raises:
        KeyError: ``stage`` has no entry in the table, or its entry names no run function.
        OSError, SyntaxError: a source file cannot be read or parsed.
    """
    segments, imported = table_entry(root, table, stage)
    entry = hashlib.sha256(b"".join(segment.encode() + b"\0" for segment in segments))
    h = hashlib.sha256(entry.digest())
    modules = {}
    for module in sorted(import_closure(root, imported | {root.name}, table)):
        path = module_file(root, module)
        if runs_nothing(path):  # type: ignore[arg-type]
            continue
        name, source = path.relative_to(root.parent).as_posix(), path.read_bytes()  # type: ignore[union-attr]
        h.update(name.encode() + b"\0" + source)
        modules[name] = hashlib.sha256(source).hexdigest()[:16]
    return StageCode(h.hexdigest()[:16], entry.hexdigest()[:16], modules)


def stage_code_digest(root: Path, table: str, stage: str) -> str:
    """:attr:`StageCode.digest` of :func:`stage_code`: one digest of the code stage ``stage`` runs.

    Raises:
        KeyError, OSError, SyntaxError: as :func:`stage_code`.
    """
    return stage_code(root, table, stage).digest
