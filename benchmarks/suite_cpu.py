"""Where the test suite's CPU goes: the CPU seconds of each test, its own and its subprocesses'.

`pytest --durations` gives wall time, which on a machine with two test processes mixes a test's
work with its neighbour's and with waiting. This pytest plugin records, for each test (setup,
call and teardown), the CPU seconds of the test process and of the subprocesses it reaped
(`getrusage`: a `torchrun` job's ranks, an `rlhf run` with its temporary Prefect server), with
the test process's name and its start and end time, one JSON line per test:

    make test PYTEST_ARGS="-p benchmarks.suite_cpu"           # writes $SUITE_CPU_OUT afresh
    python benchmarks/suite_cpu.py [FILE] [--top N]           # the summary below

Not counted: processes that a test starts and does not reap, such as the server stack of the
deployment tests (`infra/stack.sh` detaches it) and the flow runs its worker starts. A server
that a session fixture starts (the Prefect server of each test process) is charged to the test
after which it stops, and a test that waits for another process (a file lock on what is made
once for both) counts as busy.

The summary: the span of the run; each test process's busy time, its idle time (the span less
its busy time) with the longest stretch of it, and its CPU; the CPU of each test file and the
N tests that use most.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import time
from pathlib import Path

import pytest

OUT = Path(os.environ.get("SUITE_CPU_OUT", Path(__file__).resolve().parent / ".work" / "suite_cpu.jsonl"))


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def pytest_configure(config):
    """The records of one pytest run only: the main process (pytest-xdist's controller, which
    configures before its workers start) removes an earlier run's."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        OUT.unlink(missing_ok=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around a test's setup, call and teardown, in the process that runs it."""
    start, (own, children) = time.time(), _cpu()
    yield
    own_now, children_now = _cpu()
    record = {
        "test": item.nodeid,
        "process": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "start": start,
        "end": time.time(),
        "cpu_own": own_now - own,
        "cpu_children": children_now - children,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def longest_idle(records: list[dict], start: float, span: float) -> float:
    """The longest time in seconds within the run's span (``start``, ``span``) in which the
    process of ``records`` ran no test: before its first, between two, or after its last."""
    edges = sorted((r["start"], r["end"]) for r in records)
    gaps = [edges[0][0] - start, start + span - max(end for _, end in edges)]
    reached = edges[0][1]
    for begin, end in edges[1:]:
        gaps.append(begin - reached)
        reached = max(reached, end)
    return max(0.0, *gaps)


def summarise(path: Path, top: int = 30) -> str:
    """The summary of a file of records, as text."""
    records = [json.loads(line) for line in path.open()]
    if not records:
        return f"{path}: no records"
    start = min(r["start"] for r in records)
    span = max(r["end"] for r in records) - start
    cpu = {r["test"]: r["cpu_own"] + r["cpu_children"] for r in records}
    lines = [f"{len(records)} tests in {span:.0f} s; {sum(cpu.values()):.0f} CPU seconds counted"]
    for process in sorted({r["process"] for r in records}):
        mine = [r for r in records if r["process"] == process]
        busy = sum(r["end"] - r["start"] for r in mine)
        used = sum(cpu[r["test"]] for r in mine)
        lines.append(
            f"  {process}: busy {busy:.0f} s, idle {span - busy:.0f} s (longest {longest_idle(mine, start, span):.0f} s), "
            f"{used:.0f} CPU seconds, {len(mine)} tests"
        )
    by_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for r in records:
        by_file[r["test"].split("::")[0]][0] += cpu[r["test"]]
        by_file[r["test"].split("::")[0]][1] += r["end"] - r["start"]
    lines.append("\n CPU s   wall s  file")
    for name, (used, wall) in sorted(by_file.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{used:6.0f}  {wall:7.0f}  {name}")
    lines.append("\n CPU s   wall s  test")
    for r in sorted(records, key=lambda r: -cpu[r["test"]])[:top]:
        lines.append(f"{cpu[r['test']]:6.0f}  {r['end'] - r['start']:7.0f}  {r['test']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", type=Path, default=OUT, help=f"records (default {OUT})")
    parser.add_argument("--top", type=int, default=30, help="files and tests listed (default 30)")
    args = parser.parse_args(argv)
    print(summarise(args.file, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
