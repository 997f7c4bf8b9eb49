"""Check the installed packages against the project's own ranges (pyproject.toml's
``[project].dependencies``): a GPU image's packages are its own, and one older than the project
needs fails where the code relies on it (transformers 5.17's ``generate`` takes no ``cache``
argument, so the compiled decoding step falls back to the eager dynamic cache).

    python3 infra/offline-gpu/check_versions.py [--pyproject PATH]

Prints one line per installed package outside its range and one line naming the ones not
installed; exits 1 when any installed package is outside its range, else 0. ``env.sh`` runs it.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement


def out_of_range(pyproject: Path) -> tuple[list[str], list[str]]:
    """``(problems, missing)``: a line per installed requirement whose version is outside its
    specifier, and the names of those not installed. Requirements whose marker does not hold
    here are skipped."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    problems, missing = [], []
    for line in dependencies:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(req.name)
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name} {version} is outside the project's range {req.name}{req.specifier}")
    return problems, missing


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parents[2]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pyproject", type=Path, default=root / "pyproject.toml")
    args = p.parse_args(argv)
    problems, missing = out_of_range(args.pyproject)
    for problem in problems:
        print(f"check_versions: {problem}", file=sys.stderr)
    if missing:
        print(f"check_versions: not installed (needed only by the stages that import them): {', '.join(missing)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
