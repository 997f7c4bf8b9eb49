"""docs/layout.md's table of the core lists its packages and every package's modules in the order
of import-linter's layers contracts (pyproject.toml): the packages top to bottom, and in each
package its modules top to bottom."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _split(layers: list[str]) -> list[str]:
    return [m.strip() for layer in layers for m in layer.split("|")]


def contract_modules() -> list[str]:
    """``package/module`` for every module the contracts place, packages and modules in order."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = {c["containers"][0]: c["layers"] for c in contracts if c["type"] == "layers" and c.get("containers")}
    return [f"{pkg}/{mod}" for pkg in _split(layers["rlhf_core"]) for mod in _split(layers[f"rlhf_core.{pkg}"])]


def table_modules() -> list[str]:
    """``package/module`` for every module the layout page's table names, row by row."""
    page = (ROOT / "docs" / "layout.md").read_text()
    section = page[page.index("## The core by layer") :]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| `")]
    return [
        f"{row[1].strip().strip('`/')}/{m.rstrip('/')}" for row in rows for m in re.findall(r"`([a-z_]+/?)`", row[3])
    ]


def test_the_layout_table_lists_the_contracts_layers_in_order():
    assert table_modules() == contract_modules()


def test_every_module_of_the_core_is_in_a_package_and_the_contracts():
    core = ROOT / "rlhf_core"
    assert sorted(p.name for p in core.glob("*.py")) == ["__init__.py"]  # the rest sits in the packages
    modules = {f"{p.parent.name}/{p.stem}" for p in core.glob("*/*.py") if p.stem != "__init__"}
    subpackages = {f"{p.parent.parent.name}/{p.parent.name}" for p in core.glob("*/*/__init__.py")}
    assert sorted(contract_modules()) == sorted(modules | subpackages)


def test_a_packages_init_holds_only_its_docstring():
    """So that importing a module of a package runs nothing else, and no package's ``__init__``
    enters a stage's code (:func:`rlhf_core.common.stage_code.runs_nothing`)."""
    from rlhf_core.common.stage_code import runs_nothing

    inits = sorted((ROOT / "rlhf_core").glob("*/__init__.py"))
    assert len(inits) == 11 and all(runs_nothing(p) for p in inits)
