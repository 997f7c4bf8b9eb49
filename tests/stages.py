"""Helpers for tests that build on the session's smoke stage outputs (``smoke_stages`` in
conftest), and for the kill-and-resume tests of the trainers."""

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Bitwise equality needs MKL's strict reproducibility mode: by default its matrix products may
# round differently with the memory alignment of their operands, which varies from run to run.
BITWISE_ENV = {**os.environ, "MKL_CBWR": "AUTO,STRICT"}


def link_stages(smoke_stages: Path, root: Path, **names: str) -> Path:
    """Make ``root/NAME`` a symbolic link to ``smoke_stages/TARGET`` for each ``NAME=TARGET``."""
    root.mkdir(parents=True, exist_ok=True)
    for name, target in names.items():
        (root / name).symlink_to(smoke_stages / target, target_is_directory=True)
    return root


def made_once(shared: Path, name: str, build: Callable[[Path], object]) -> Path:
    """``shared/NAME``, made by ``build(directory)`` once for all test processes of the pytest
    run and read only after: processes side by side (pytest-xdist) wait for the one that makes it
    (a file lock), and a half-made directory never takes the name."""
    from filelock import FileLock

    done = shared / name
    with FileLock(str(done) + ".lock"):
        if not done.is_dir():
            part = Path(str(done) + ".part")
            shutil.rmtree(part, ignore_errors=True)
            build(part)
            os.rename(part, done)
    return done


def run_made_once(shared: Path, name: str, build: Callable[[Path], object]) -> Path:
    """``shared/NAME``, a run directory made by ``build(directory)`` once for all test processes
    of the pytest run, in place (its stores hold its absolute paths, so it is never renamed):
    processes side by side wait for the one that makes it (a file lock); ``NAME.done`` marks it
    finished, and a directory without it is made again. Tests that go on in it run in one
    process (an ``xdist_group``); the others read only what ``build`` wrote."""
    from filelock import FileLock

    done, marker = shared / name, shared / f"{name}.done"
    with FileLock(str(done) + ".lock"):
        if not marker.exists():
            shutil.rmtree(done, ignore_errors=True)
            done.mkdir()
            build(done)
            marker.touch()
    return done


def finished_run(shared: Path, until: str, overrides: list[str]) -> Path:
    """A run directory of ``rlhf stages --preset smoke OVERRIDES --until UNTIL`` under
    :data:`BITWISE_ENV`, made once in ``shared`` for each ``(until, overrides)``
    (:func:`made_once`)."""

    def build(out: Path) -> None:
        exe = str(Path(sys.executable).with_name("rlhf"))
        argv = [exe, "stages", "--preset", "smoke", *overrides, "--until", until, "--out", str(out)]
        result = subprocess.run(argv, capture_output=True, text=True, env=BITWISE_ENV, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]

    name = hashlib.sha256(repr((until, overrides)).encode()).hexdigest()[:16]
    return made_once(shared, f"{until}-{name}", build)


def kill_then_resume(
    command: str, stage: str, overrides: list[str], root: Path, step: int = 2, start_from: Path | None = None
) -> dict[str, str]:
    """Run ``rlhf COMMAND --preset smoke OVERRIDES`` into ``root/killed``, SIGKILL it once stage
    ``stage`` has written its checkpoint of step ``step``, run it again there (it resumes) and
    once, uninterrupted, into ``root/clean``, both under :data:`BITWISE_ENV`. With
    ``start_from`` (a run directory of the stages before ``stage``, :func:`finished_run`), both
    directories start as copies of it, so that neither trains those stages again.

    Returns:
        ``{"killed": stderr, "clean": stderr}`` of the two complete runs; each exited 0, the
        killed one died of SIGKILL after that checkpoint and before the stage's ``model``.
    """
    exe = str(Path(sys.executable).with_name("rlhf"))
    argv = [exe, command, "--preset", "smoke", *overrides, "--out"]
    killed = root / "killed"
    if start_from is not None:
        for name in ("killed", "clean"):
            shutil.copytree(start_from, root / name)
    proc = subprocess.Popen([*argv, str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=BITWISE_ENV)
    checkpoint = killed / stage / "checkpoints" / f"step-{step:06d}" / "state.pt"
    deadline = time.time() + 600
    while not checkpoint.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the stage finished before it could be killed"
    assert checkpoint.exists() and not (killed / stage / "model").exists()
    logs = {}
    for name in ("killed", "clean"):
        result = subprocess.run([*argv, str(root / name)], capture_output=True, text=True, env=BITWISE_ENV, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        logs[name] = result.stderr
    assert "resumed from" in logs["killed"] and "resumed from" not in logs["clean"]
    return logs
