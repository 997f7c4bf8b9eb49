"""The lower bound of every range in pyproject.toml's ``dependencies`` and ``dev`` extra, as pip
pins (``name==lower``, one a line, extras dropped) on standard output: the constraints that
``make test-min`` installs, read from the one place the ranges are kept.

A requirement with no lower bound (a cap only, such as ``fastapi<0.151``) is left to pip within
its range. Exits 1 naming the requirement when a lower bound cannot be read as one version
(an exclusive ``>``, an environment marker). Standard library only: runs on any Python >= 3.11.
Usage: ``python3 infra/lower_bounds.py [pyproject.toml] > constraints.txt``.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

REQUIREMENT = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.\-]*)\s*(\[[^\]]*\])?\s*(.*)")


def lower_bounds(pyproject: dict) -> list[str]:
    """``name==lower`` for each requirement of ``dependencies`` and the ``dev`` extra that has a
    lower bound (``>=``, ``==`` or ``~=``), in pyproject order. Raises ValueError naming the
    requirement when its specifier is not of that form."""
    project = pyproject["project"]
    pins = []
    for req in project["dependencies"] + project["optional-dependencies"]["dev"]:
        name, _extras, spec = REQUIREMENT.fullmatch(req.strip()).groups()
        if ";" in spec or "@" in spec:
            raise ValueError(f"{req!r}: environment markers and URLs are not read here")
        lows = [m.group(2) for m in re.finditer(r"(>=|==|~=)\s*([^\s,]+)", spec)]
        if re.search(r"(^|,)\s*>(?!=)", spec):
            raise ValueError(f"{req!r}: an exclusive lower bound has no one oldest version")
        if len(lows) > 1:
            raise ValueError(f"{req!r}: more than one lower bound")
        if lows:
            pins.append(f"{name}=={lows[0]}")
    return pins


def main(argv: list[str]) -> int:
    path = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parents[1] / "pyproject.toml")
    try:
        pins = lower_bounds(tomllib.loads(path.read_text()))
    except ValueError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 1
    print(f"# The lower bound of every range in {path.name} (infra/lower_bounds.py): make test-min")
    print("\n".join(pins))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
