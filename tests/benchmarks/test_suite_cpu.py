"""benchmarks/suite_cpu.py: each test's CPU seconds, its subprocesses' included, and the summary."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.suite_cpu import summarise

REPO = Path(__file__).resolve().parents[2]

TESTS = """
import subprocess, sys

def test_burns_in_a_subprocess():
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)

def test_idle():
    pass
"""


@pytest.mark.heavy
def test_a_test_is_charged_its_subprocesses_cpu(tmp_path):
    (tmp_path / "test_burn.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    out = tmp_path / "records.jsonl"
    out.write_text(json.dumps({"test": "an earlier run's"}) + "\n")  # replaced, not appended to
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not an xdist worker's
    env |= {"PYTHONPATH": str(REPO), "SUITE_CPU_OUT": str(out)}
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "benchmarks.suite_cpu",
        "-p",
        "no:cacheprovider",
        "test_burn.py",
    ]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    records = {r["test"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"test_burn.py::test_burns_in_a_subprocess", "test_burn.py::test_idle"}
    burn, idle = records["test_burn.py::test_burns_in_a_subprocess"], records["test_burn.py::test_idle"]
    assert burn["cpu_children"] > 0.05 and idle["cpu_children"] == 0 and burn["process"] == "main"
    assert burn["end"] >= burn["start"]
    summary = summarise(out, top=1).splitlines()
    assert summary[0].startswith("2 tests in ") and summary[1].startswith("  main: busy ")
    assert summary[-1].endswith("  test_burn.py::test_burns_in_a_subprocess")  # the one that used most


def test_each_process_is_charged_its_idle_time_and_its_longest_idle_stretch(tmp_path):
    """Two processes over a 100-second run: gw0 busy 0-40, 45-90 and 95-100 (idle 10 s, at most
    5 at once); gw1 busy 0-30 only (idle 70 s, all of it at the end)."""
    spans = {"gw0": [(0, 40), (45, 90), (95, 100)], "gw1": [(0, 10), (10, 30)]}
    records = [
        {"test": f"{p}-{i}", "process": p, "start": 1000 + a, "end": 1000 + b, "cpu_own": 1.0, "cpu_children": 0.0}
        for p, edges in spans.items()
        for i, (a, b) in enumerate(edges)
    ]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = summarise(path).splitlines()
    assert lines[1] == "  gw0: busy 90 s, idle 10 s (longest 5 s), 3 CPU seconds, 3 tests"
    assert lines[2] == "  gw1: busy 30 s, idle 70 s (longest 70 s), 2 CPU seconds, 2 tests"
