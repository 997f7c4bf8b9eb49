"""benchmarks/suite_cpu.py: each test's CPU seconds, its subprocesses' included, and the summary."""

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.suite_cpu import summarise

REPO = Path(__file__).resolve().parents[2]

TESTS = """
import subprocess, sys

def test_burns_in_a_subprocess():
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)

def test_idle():
    pass
"""


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
