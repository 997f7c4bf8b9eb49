"""Which stage keys an edit to each module changes: for every module of ``rlhf_core``, the
stages whose code part of the cache key (:func:`rlhf_core.common.stage_code.stage_code`) covers it.

Usage::

    .venv/bin/python benchmarks/stage_keys.py            # the table (markdown), then the targets
    .venv/bin/python benchmarks/stage_keys.py --json     # {module: [stage, ...]}
    .venv/bin/python benchmarks/stage_keys.py --check    # exit 1 when a target is missed

An edit changes the key of a stage whose code covers the module directly; in ``rlhf stages`` the
stages after it follow through their inputs' keys, in the Prefect flow only when the artifact it
writes differs. The table counts the direct ones: what the edit itself costs. Nothing is run or
imported beyond the stage table: the sources' syntax trees are read.

The targets: no module of plotting, HTML or the report (:data:`PRESENTATION`) re-keys a
training stage (:data:`TRAINING_STAGES`), and at most :data:`MOST_WIDE` modules re-key
:data:`WIDE` or more of a pipeline run's stages (``policy_eval``, run on demand by ``rlhf evaluate``,
is listed but not counted there).
"""

from __future__ import annotations

import argparse
import json
import sys

from rlhf_core.common.stage_code import runs_nothing, stage_code
from rlhf_core.run.pipeline import ON_DEMAND, SOURCE_ROOT, STAGES

#: Every stage, the pipeline's in run order, then those a command runs on demand (``policy_eval``).
ALL_STAGES = [*STAGES, *ON_DEMAND]

#: The stages that train a model: an edit that re-keys one costs hours on a GPU.
TRAINING_STAGES = ("sft", "reward", "ppo", "dpo")
#: The modules that only present results: plots, HTML pages, the report.
PRESENTATION = (
    "rlhf_core/views/plots.py",
    "rlhf_core/views/html.py",
    "rlhf_core/views/page.py",
    "rlhf_core/report/run_report.py",
    "rlhf_core/report/policy_report.py",
)
#: A module re-keying this many stages or more is "wide"; at most MOST_WIDE modules may be.
WIDE, MOST_WIDE = 9, 6


def rekeyed() -> dict[str, list[str]]:
    """``{module path: [stage, ...]}`` for every ``rlhf_core`` source file but a package's
    docstring-only ``__init__.py``, which runs nothing (relative to the
    repository root, as :class:`~rlhf_core.common.stage_code.StageCode` names it), the stages in run
    order (``policy_eval`` last); a module no stage's code covers maps to ``[]``."""
    covered = {name: stage_code(SOURCE_ROOT, "rlhf_core.run.pipeline", name).modules for name in ALL_STAGES}
    files = [p for p in SOURCE_ROOT.rglob("*.py") if not runs_nothing(p)]  # a docstring-only __init__: never
    modules = sorted(p.relative_to(SOURCE_ROOT.parent).as_posix() for p in files)
    return {m: [s for s in ALL_STAGES if m in covered[s]] for m in modules}


def _in_a_run(stages: list[str]) -> int:
    """How many of ``stages`` a pipeline run holds (:data:`STAGES`; not those run on demand)."""
    return sum(s in STAGES for s in stages)


def misses(table: dict[str, list[str]]) -> list[str]:
    """The targets the table misses, one line each (empty when it meets them all)."""
    found = [
        f"{m} (presentation) re-keys the training stage {s}"
        for m in PRESENTATION
        for s in table.get(m, [])
        if s in TRAINING_STAGES
    ]
    wide = [m for m, stages in table.items() if _in_a_run(stages) >= WIDE]
    if len(wide) > MOST_WIDE:
        found.append(f"{len(wide)} modules re-key {WIDE} or more stages (at most {MOST_WIDE}): {', '.join(wide)}")
    return found


def markdown(table: dict[str, list[str]]) -> str:
    """The table as markdown: a row per module, widest first, a column per stage (``x``: an
    edit to the module changes that stage's key)."""
    names = ALL_STAGES
    lines = ["| module | stages | " + " | ".join(names) + " |", "|---|--:|" + "---|" * len(names)]
    for module, stages in sorted(table.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        marks = " | ".join("x" if s in stages else "" for s in names)
        lines.append(f"| `{module.removeprefix('rlhf_core/')}` | {len(stages)} | {marks} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print {module: [stage, ...]} as JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    table = rekeyed()
    missed = misses(table)
    if args.json:
        print(json.dumps(table, indent=1))
    else:
        print(markdown(table))
        wide = sum(_in_a_run(s) >= WIDE for s in table.values())
        print(f"\n{wide} modules re-key {WIDE} or more of a run's {len(STAGES)} stages (target: at most {MOST_WIDE}).")
        print("targets met" if not missed else "targets missed:\n  " + "\n  ".join(missed))
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
