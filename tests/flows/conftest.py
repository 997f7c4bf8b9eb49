"""Fixtures of the flow tests."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.servers import BIN, PREFECT_DATABASE, QUIET_ENV


@pytest.fixture(scope="session", autouse=True)
def prefect_database(shared_runs) -> Path:
    """``prefect server database upgrade`` into an empty ``PREFECT_HOME``, once for all test
    processes of the run (a file lock): its ``prefect.db``."""
    from filelock import FileLock

    made = shared_runs / "prefect-database" / "prefect.db"
    with FileLock(str(shared_runs / "prefect-database.lock")):
        if not made.is_file():
            part = made.parent.with_name("prefect-database.part")
            shutil.rmtree(part, ignore_errors=True)
            env = {**os.environ, **QUIET_ENV, "PREFECT_HOME": str(part)}
            done = subprocess.run(
                [str(BIN / "prefect"), "server", "database", "upgrade", "-y"],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, done.stdout + done.stderr
            os.rename(part, made.parent)
    PREFECT_DATABASE[:] = [made]
    return made
