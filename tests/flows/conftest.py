"""Fixtures of the flow tests."""

import os
import subprocess
from pathlib import Path

import pytest

from tests.servers import BIN, PREFECT_DATABASE, QUIET_ENV
from tests.stages import made_once


@pytest.fixture(scope="session", autouse=True)
def prefect_database(shared_runs) -> Path:
    """``prefect server database upgrade`` into an empty ``PREFECT_HOME``, once for all test
    processes of the run (:func:`tests.stages.made_once`): its ``prefect.db``."""

    def migrate(home: Path) -> None:
        env = {**os.environ, **QUIET_ENV, "PREFECT_HOME": str(home)}
        argv = [str(BIN / "prefect"), "server", "database", "upgrade", "-y"]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr

    made = made_once(shared_runs, "prefect-database", migrate) / "prefect.db"
    PREFECT_DATABASE[:] = [made]
    return made
