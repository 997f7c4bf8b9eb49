"""docs/layout.md's table of the core's layers lists every module of import-linter's layers
contract for ``rlhf_core`` (pyproject.toml), top to bottom, in the contract's order."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def contract_modules() -> list[str]:
    """The modules of the core's layers contract, top to bottom, siblings as listed."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (core,) = [c for c in contracts if c["type"] == "layers" and c.get("containers") == ["rlhf_core"]]
    return [m.strip() for layer in core["layers"] for m in layer.split("|")]


def table_modules() -> list[str]:
    """The modules the layout page's table names, row by row (``judging/`` as ``judging``)."""
    page = (ROOT / "docs" / "layout.md").read_text()
    section = page[page.index("## The core by layer") :]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| layer")]
    return [m.rstrip("/") for row in rows for m in re.findall(r"`([a-z_]+/?)`", row.split("|")[3])]


def test_the_layout_table_lists_the_contracts_layers_in_order():
    assert table_modules() == contract_modules()


def test_every_module_of_the_core_is_in_the_contract():
    modules = {p.stem for p in (ROOT / "rlhf_core").glob("*.py") if p.stem != "__init__"}
    packages = {p.parent.name for p in (ROOT / "rlhf_core").glob("*/__init__.py")}
    assert sorted(contract_modules()) == sorted(modules | packages)
