"""Fixtures of the flow tests."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _prefect_database(prefect_database) -> Path:
    """Every flow test's new ``PREFECT_HOME`` starts from the migrated database (tests/conftest.py)."""
    return prefect_database
