"""Helpers for tests that build on the session's smoke stage outputs (``smoke_stages`` in conftest)."""

from pathlib import Path


def link_stages(smoke_stages: Path, root: Path, **names: str) -> Path:
    """Make ``root/NAME`` a symbolic link to ``smoke_stages/TARGET`` for each ``NAME=TARGET``."""
    root.mkdir(parents=True, exist_ok=True)
    for name, target in names.items():
        (root / name).symlink_to(smoke_stages / target, target_is_directory=True)
    return root
