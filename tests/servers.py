"""Real servers on 127.0.0.1 for tests: MLflow, an S3 API (moto) and Prefect. Each is started
as a subprocess on a free port and stopped by the PID it was started with."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent

QUIET_ENV = {
    "DO_NOT_TRACK": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A subprocess serving HTTP on 127.0.0.1:port; ``stop()`` ends exactly that process group."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        log_dir: Path,
        health_path: str = "/",
        env: dict | None = None,
        timeout: float = 120.0,
    ):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        full_env = {**os.environ, **QUIET_ENV, **(env or {})}
        self.proc = subprocess.Popen(
            cmd, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + health_path, timeout=2) as response:
                    if response.status < 500:
                        return
            except Exception:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(
            f"{name} did not answer on {self.url} within {timeout} s: {self.log_path.read_text()[-2000:]}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_moto(log_dir: Path) -> Server:
    port = free_port()
    return Server(
        "moto", [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], port, log_dir, health_path="/moto-api/"
    )


def start_mlflow(root: Path) -> Server:
    port = free_port()
    root.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(BIN / "mlflow"),
        "server",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        str(root / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    fresh_mlflow_store(root / "mlflow.db")
    return Server("mlflow", cmd, port, root, health_path="/health", timeout=180)


def start_prefect(home: Path) -> Server:
    """A Prefect server (its API and UI) on a free port, its ``PREFECT_HOME`` ``home``
    (:func:`fresh_prefect_home`: the database migrated once per pytest run, copied)."""
    port = free_port()
    cmd = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    env = {"PREFECT_HOME": str(fresh_prefect_home(home))}
    return Server("prefect", cmd, port, home, health_path="/api/health", env=env, timeout=180)


#: The folder that the test processes of one pytest run share (the ``shared_runs`` fixture of
#: tests/conftest.py, which sets it): the migrated databases below are made there, once.
SHARED_RUNS: list[Path] = []


def _migrated(name: str, migrate) -> Path | None:
    """``SHARED_RUNS/NAME-database/NAME.db``, made by ``migrate(directory)`` the first time a test of the
    pytest run needs it (:func:`tests.stages.made_once`); ``None`` outside a pytest run."""
    if not SHARED_RUNS:
        return None
    from tests.stages import made_once

    return made_once(SHARED_RUNS[0], f"{name}-database", migrate) / f"{name}.db"


def _migrate_prefect(home: Path) -> None:
    env = {**os.environ, **QUIET_ENV, "PREFECT_HOME": str(home)}
    argv = [str(BIN / "prefect"), "server", "database", "upgrade", "-y"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def _migrate_mlflow(directory: Path) -> None:
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    directory.mkdir(parents=True)
    # MLflow's Default experiment (no test logs to it) keeps its artifacts beside the finished copy
    default_root = (SHARED_RUNS[0] / "mlflow-database" / "default-artifacts").as_uri()
    SqlAlchemyStore(f"sqlite:///{directory / 'mlflow.db'}", default_root).engine.dispose()


def fresh_prefect_home(home: Path) -> Path:
    """``home`` as a new ``PREFECT_HOME``: no flow runs, no cache records, no settings; where it
    has no database, a copy of an empty one at Prefect's current schema (``prefect server
    database upgrade``, run once per pytest run), so that no server migrates one again."""
    home.mkdir(parents=True, exist_ok=True)
    migrated = None if (home / "prefect.db").exists() else _migrated("prefect", _migrate_prefect)
    if migrated is not None:
        shutil.copyfile(migrated, home / "prefect.db")
    return home


def fresh_mlflow_store(path: Path) -> str:
    """A new SQLite MLflow store at ``path`` (no experiments but MLflow's ``Default``, no runs,
    no models) where none is: a copy of an empty one migrated to MLflow's current schema once
    per pytest run, as MLflow's own suite caches one (``cached_db``). Its tracking URI."""
    path.parent.mkdir(parents=True, exist_ok=True)
    migrated = None if path.exists() else _migrated("mlflow", _migrate_mlflow)
    if migrated is not None:
        shutil.copyfile(migrated, path)
    return f"sqlite:///{path}"
